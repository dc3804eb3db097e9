/* float32 linear layers over block-quantized weights (GGUF's Q4_0, Q4_1 and Q8_0, Q4_K and
   Q6_K as repacked by quant.py, and `--quantization int8`): y[M, N] = x[M, K] @ W[N, K]^T
   (+ bias[N]), the weight kept in its 4-, 6- or 8-bit blocks and unpacked inside the matmul, so a
   decode step reads 4.5 to 8.5 bits a weight instead of 16 or 32.

   Every 32 consecutive weights of an output row share a float16 scale d (and, for 4-bit, an
   offset m): w = d * q + m with q in 0..15 (Q4_0 is d * (q - 8), packed as m = -8 d), or
   w = d * q with q in -128..127, or (6-bit, Q6_K's) w = d_h * (q - 32) with q in 0..63 and a
   scale per 16 weights (d_0 for weights 0..15, d_1 for 16..31). The packed weight is panels of PANEL_MIXED output columns (two
   vectors, as linear_mixed), each a run of records, one per 32-weight block:

       4-bit: d[P] f16 | m[P] f16 | q[4][P][4] bytes: byte (g, o, i) holds output o's weight
              4g + i in its low nibble and weight 16 + 4g + i in its high nibble
       8-bit: d[P] f16 | q[8][P][4] int8: byte (g, o, i) is output o's weight 4g + i
       6-bit: d_0[P] f16 | d_1[P] f16 | q[4][P][4] as 4-bit's (the low nibbles) | h[2][P][4]:
              byte (h, o, i) holds the top two bits of output o's weight 16h + 4g + i at bit 2g

   so a load of 4 * LANES bytes gives LANES outputs four consecutive weights each: the shape of
   the integer dot-product instructions (AVX512-VNNI's vpdpbusd: four u8 x s8 products summed
   into each 32-bit lane; AVX2's vpmaddubsw + vpmaddwd).

   What 4- and 8-bit weights multiply is a mode (linear_q_set_activations;
   SHARDSERVE_QUANT_ACTIVATIONS from Python), the same for every call, so a row's result does not
   depend on the rows beside it (6-bit weights always take float32):
   - float32 (every build; 8-bit weights in the int8 mode too): weights unpacked (mask or
     shift, convert, one FMA with d and m) and multiplied in float32 tiles, a panel unpacked
     once per 48-row block where a block has more rows than a tile; 4-bit calls of 1-4 rows
     (1-2 on 16-register ISAs) take d and m out of the loop and mask nibbles in place
     (hoisted_tile): 1.15-1.36x faster per call; 8-bit ones take d out of the loop
     (hoisted_tile): a Q8_0 LM head of 49,152 x 576 at one row 1.40x;
   - bfloat16 (AVX512-BF16 builds; their default): x rounded to bfloat16 once per call; calls of
     more than MIXED_ROWS rows unpack each panel's quants, a K chunk at a time, into bfloat16
     pairs (integers 0..15, exact) and sum each block's products with vdpbf16ps, then scale the
     block sums by d and add m sum(x) in float32: the weights stay exact, only x is rounded
     (~0.4% of a product), and a 135M model's greedy answers stay transformers' ("The capital of
     France is Paris."). 1.4-1.7x the float32 tiles at 48-512 rows on Zen 4 (~300 GFLOP/s of the
     ~450 the instruction peaks at); calls of up to MIXED_ROWS rows (decode of a few streams)
     make the quants bfloat16 in registers instead (pairs_tile: from L2 2.2-2.4x the float32
     tiles' speed at one row, 1.5-1.9x at 6-8). 8-bit weights the same ways (integers -128..127,
     exact in bfloat16; pairs_tile up to Q8_PAIR_ROWS rows): the default model's Q8_0 LM head
     (49,152 x 576) at 32 rows 11.5 -> 7.5-8.2 ms, at one row 0.89 -> 0.55-0.72;
   - int8 (AVX2 and AVX-512 builds): as llama.cpp does, each row's block of 32 activations
     becomes int8 with a float scale (dx = max|x| / 127) and the block's products are integer dot
     products (vpdpbusd with VNNI, else vpmaddubsw + vpmaddwd): sum(x w) ~ d dx sum(qx q) +
     m sum(x). 64 products take 2 instructions (VNNI) plus a share of the nibble split: 2.4-3x the
     float32 path at every size. The same arithmetic as llama.cpp's Q4 x Q8_1 dot products; the
     activations' rounding moves a product by ~0.5-1% of the largest, and a 135M model's greedy
     answers with it are llama.cpp's, not transformers' ("What is the capital of France?":
     "L'Etoile, la Marseillaise, ..." from both).

   A 64-byte header in front says the type and the shape, and the kernel refuses a buffer whose
   header does not match its arguments. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "vec.h"

#define QK 32
#define Q_HEADER 64
#define Q_MAGIC 0x51535353u /* "SSSQ" */
enum { Q4 = 0, Q8 = 1, Q6 = 2 };

#if VBYTES == 64 && defined(__AVX512BW__)
#define DOT 1
#define DOT_MT 4
#elif VBYTES == 32 && defined(__AVX2__)
#define DOT 1
#define DOT_MT 2
#else
#define DOT 0
#endif
#if VBYTES == 64 && defined(__AVX512BF16__)
#define BF_DOT 1
#define BF_MT 6 /* 12 block sums, 12 accumulators, 2 weight vectors, d, m and an x pair */
#else
#define BF_DOT 0
#endif
/* 8-bit weights take twice the dot products a weight: past this many rows the unpacked chunks
   (bf16_panel) are faster (3072 x 576 from L2, Zen 4: 2 rows 57-61 against 87 us, 4 rows
   even, 8 rows 188 against 170) */
#define Q8_PAIR_ROWS 4

/* what 4-bit weights (and, but in the int8 mode, 8-bit ones) multiply
   (linear_q_set_activations; every call alike, so a row's result does not depend on the rows
   beside it): float32 x; x rounded to bfloat16; or x as 8-bit blocks (llama.cpp's arithmetic) */
enum { ACT_F32 = 0, ACT_BF16 = 1, ACT_INT8 = 2 };
static int act_mode = ACT_F32;

typedef struct {
    uint32_t magic, qtype;
    int64_t n, k;
    uint32_t panel;
} QHeader;

int quant_header_bytes(void) { return Q_HEADER; }

int linear_q_activations(void) { return act_mode; }

/* ACT_F32, ACT_BF16 (builds with AVX512-BF16) or ACT_INT8 (AVX2 and AVX-512 builds); returns
   the mode in effect: ACT_F32 where the build lacks the one asked for */
int linear_q_set_activations(int mode) {
    act_mode = (mode == ACT_BF16 && BF_DOT) || (mode == ACT_INT8 && DOT) ? mode : ACT_F32;
    return act_mode;
}

/* bytes per 32-weight block of one panel */
static int64_t record_bytes(uint32_t qtype) {
    if (qtype == Q6) return (int64_t)PANEL_MIXED * (4 + QK / 2 + QK / 4);
    return qtype == Q4 ? (int64_t)PANEL_MIXED * (4 + QK / 2) : (int64_t)PANEL_MIXED * (2 + QK);
}

/* where a record's quants start: after d (and m, or d_1) */
static inline int64_t quants_at(uint32_t qtype) { return (qtype == Q8 ? 2 : 4) * PANEL_MIXED; }

KERNEL_INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                   mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        v.f = (float)mant * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return v.f;
}

/* LANES float16 at p as float32 */
KERNEL_INLINE vf halves(const uint8_t *p) {
#if VBYTES == 64
    return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)p));
#elif VBYTES == 32 && defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const void *)p));
#else
    vf v;
    for (int l = 0; l < LANES; l++) {
        uint16_t h;
        memcpy(&h, p + 2 * l, 2);
        v[l] = half_to_float(h);
    }
    return v;
#endif
}

/* 4 * LANES bytes at p: LANES outputs' four bytes each, one output a 32-bit lane */
KERNEL_INLINE vi quads(const uint8_t *p) {
    vi v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define P PANEL_MIXED

/* ---- float32: unpacked weights ------------------------------------------------------------ */

/* One weight position of LANES outputs from a quads() load: 4-bit, the nibble at `shift`
   (8 i for position 4g + i, 8 i + 4 for 16 + 4g + i) times d plus m; 8-bit, byte i
   sign-extended (shifted to the top, then back) times d. */
KERNEL_INLINE vf q4_weight(vi v, int shift, vf d, vf o) {
    return __builtin_convertvector((v >> shift) & ((vi){0} + 15), vf) * d + o;
}

KERNEL_INLINE vf q8_weight(vi v, int i, vf d) {
    return __builtin_convertvector((v << (24 - 8 * i)) >> 24, vf) * d;
}

/* block b's 32 weights of the panel's LANES outputs h*LANES.., as float32: w[k] for k 0..31 */
KERNEL_INLINE void q4_block(const uint8_t *r, int h, vf w[QK]) {
    const vf d = halves(r + 2 * LANES * h), o = halves(r + 2 * P + 2 * LANES * h);
    const uint8_t *qs = r + 4 * P + 4 * LANES * h;
    for (int g = 0; g < 4; g++) {
        const vi v = quads(qs + 4 * P * g);
        for (int i = 0; i < 4; i++) {
            w[4 * g + i] = q4_weight(v, 8 * i, d, o);
            w[16 + 4 * g + i] = q4_weight(v, 8 * i + 4, d, o);
        }
    }
}

KERNEL_INLINE void q8_block(const uint8_t *r, int h, vf w[QK]) {
    const vf d = halves(r + 2 * LANES * h);
    const uint8_t *qs = r + 2 * P + 4 * LANES * h;
    for (int g = 0; g < 8; g++) {
        const vi v = quads(qs + 4 * P * g);
        for (int i = 0; i < 4; i++) w[4 * g + i] = q8_weight(v, i, d);
    }
}

/* 6-bit weight 16 half + 4g + i of LANES outputs: its low nibble from the 4-bit layout's quads v,
   its top two bits at bit 8 i + 2g of the half's high-bit quads vh, times d plus m (m = -32 d) */
KERNEL_INLINE vf q6_weight(vi v, vi vh, int half, int g, int i, vf d, vf o) {
    const vi lo = (v >> (8 * i + 4 * half)) & ((vi){0} + 15);
    const vi hi = ((vh >> (8 * i + 2 * g)) & ((vi){0} + 3)) << 4;
    return __builtin_convertvector(lo | hi, vf) * d + o;
}

KERNEL_INLINE void q6_block(const uint8_t *r, int h, vf w[QK]) {
    const vf d0 = halves(r + 2 * LANES * h), d1 = halves(r + 2 * P + 2 * LANES * h);
    const vf o0 = d0 * -32.0f, o1 = d1 * -32.0f;
    const uint8_t *qs = r + 4 * P + 4 * LANES * h, *qh = qs + 16 * P;
    const vi h0 = quads(qh), h1 = quads(qh + 4 * P);
    for (int g = 0; g < 4; g++) {
        const vi v = quads(qs + 4 * P * g);
        for (int i = 0; i < 4; i++) {
            w[4 * g + i] = q6_weight(v, h0, 0, g, i, d0, o0);
            w[16 + 4 * g + i] = q6_weight(v, h1, 1, g, i, d1, o1);
        }
    }
}

/* One 32-weight block of a panel (record r, weights k0 ..) into a tile's MT rows: each group of
   four weight positions unpacked once for all the rows */
KERNEL_INLINE void q4_rows(vf acc[8][2], const float *const xr[8], const uint8_t *r, int64_t k0,
                           int MT) {
    const uint8_t *qs = r + 4 * P;
    const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
    const vf o0 = halves(r + 2 * P), o1 = halves(r + 2 * P + 2 * LANES);
    for (int g = 0; g < 4; g++) {
        const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
        for (int i = 0; i < 4; i++)
            for (int half = 0; half < 2; half++)  /* weight 4g + i, then 16 + 4g + i */
                add_rows(acc, xr, k0 + 16 * half + 4 * g + i,
                         q4_weight(v0, 8 * i + 4 * half, d0, o0),
                         q4_weight(v1, 8 * i + 4 * half, d1, o1), MT);
    }
}

KERNEL_INLINE void q8_rows(vf acc[8][2], const float *const xr[8], const uint8_t *r, int64_t k0,
                           int MT) {
    const uint8_t *qs = r + 2 * P;
    const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
    for (int g = 0; g < 8; g++) {
        const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
        for (int i = 0; i < 4; i++)
            add_rows(acc, xr, k0 + 4 * g + i, q8_weight(v0, i, d0), q8_weight(v1, i, d1), MT);
    }
}

KERNEL_INLINE void q6_rows(vf acc[8][2], const float *const xr[8], const uint8_t *r, int64_t k0,
                           int MT) {
    const uint8_t *qs = r + 4 * P, *qh = qs + 16 * P;
    /* [output vector][half]: the scales of weights 0..15 and 16..31, and their high bits */
    const vf d[2][2] = {{halves(r), halves(r + 2 * P)},
                        {halves(r + 2 * LANES), halves(r + 2 * P + 2 * LANES)}};
    const vi vh[2][2] = {{quads(qh), quads(qh + 4 * P)},
                         {quads(qh + 4 * LANES), quads(qh + 4 * P + 4 * LANES)}};
    for (int g = 0; g < 4; g++) {
        const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
        for (int i = 0; i < 4; i++)
            for (int half = 0; half < 2; half++)
                add_rows(acc, xr, k0 + 16 * half + 4 * g + i,
                         q6_weight(v0, vh[0][half], half, g, i, d[0][half], d[0][half] * -32.0f),
                         q6_weight(v1, vh[1][half], half, g, i, d[1][half], d[1][half] * -32.0f),
                         MT);
    }
}

/* Rows m0 .. m0+MT of x times one panel of QTYPE, unpacked in registers (QTYPE and MT constants
   at each call: one specialised loop each, the accumulators in registers). */
KERNEL_INLINE void quant_tile(int qtype, const float *x, const uint8_t *panel, const float *bias,
                              float *y, int64_t N, int64_t K, int64_t m0, int64_t n0, Ahead ahead,
                              int MT) {
    vf acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};
    const float *xr[8];
    for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;
    const int64_t rec = record_bytes(qtype);
    for (int64_t b = 0; b < K / QK; b++) {
        ahead_step(&ahead, K / QK);
        if (qtype == Q4) q4_rows(acc, xr, panel + b * rec, b * QK, MT);
        else if (qtype == Q6) q6_rows(acc, xr, panel + b * rec, b * QK, MT);
        else q8_rows(acc, xr, panel + b * rec, b * QK, MT);
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

#define QUANT_TILE(NAME, QTYPE)                                                              \
    KERNEL_INLINE void NAME(const float *x, const uint8_t *panel, const float *bias, float *y, \
                            int64_t N, int64_t K, int64_t m0, int64_t n0, Ahead ahead,       \
                            int MT) {                                                         \
        quant_tile(QTYPE, x, panel, bias, y, N, K, m0, n0, ahead, MT);                        \
    }
QUANT_TILE(q4_tile, Q4)
QUANT_TILE(q8_tile, Q8)
QUANT_TILE(q6_tile, Q6)

/* Calls of at most HOIST_ROWS rows (decode of a few streams), where unpacking 4-bit weights is
   the cost, not the products. Two savings, exact in float32:
   - sum(x (d q + m)) over a block is d sum(x q) + m sum(x), with each row's block sums of x
     (xsum) taken once per call: no d q + m FMA per weight;
   - the nibble at bit s is masked in place, not shifted down: (v & 15 << s) converts to q 2^s
     exactly, and x comes pre-multiplied by 2^-s for that position (once per call), so the
     product is x q to the bit; the top nibble (s = 28, past int32's sign) is one logical shift.
   A weight then costs a mask, a convert and its FMA: 3 vector operations, 5 before. The
   accumulators of a block's sums take MT more register pairs, hence the bound on rows. */
#if VBYTES == 64 || defined(__aarch64__)
#define HOIST_ROWS 4 /* 32 vector registers */
#else
#define HOIST_ROWS 2
#endif

/* 2^-e scales x at position j of a 32-weight block, whose nibble sits at bit 8 i (j = 4g + i)
   or 8 i + 4 (j = 16 + 4g + i), masked in place; 0 for bit 28, shifted down instead */
static inline int q4_x_exponent(int j) {
    const int bit = 8 * (j % 4) + 4 * (j / 16);
    return bit == 28 ? 0 : bit;
}

KERNEL_INLINE vf q4_scaled(vi v, int shift) {
    if (shift == 28) return __builtin_convertvector((vi)((vu)v >> 28), vf);
    return __builtin_convertvector(v & ((vi){0} + (15 << shift)), vf);
}

/* a 4-bit block's sums of x q 2^-s (x pre-scaled: q4_x_exponent) into s, per row */
KERNEL_INLINE void q4_sums(vf s[HOIST_ROWS][2], const float *const xr[HOIST_ROWS],
                           const uint8_t *r, int64_t k0, int MT) {
    const uint8_t *qs = r + 4 * P;
    for (int g = 0; g < 4; g++) {
        const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
        for (int i = 0; i < 4; i++)
            for (int half = 0; half < 2; half++) {  /* weight 4g + i, then 16 + 4g + i */
                const int shift = 8 * i + 4 * half;
                const vf q0 = q4_scaled(v0, shift), q1 = q4_scaled(v1, shift);
                const int64_t k = k0 + 16 * half + 4 * g + i;
                for (int m = 0; m < MT; m++) {
                    s[m][0] += xr[m][k] * q0;
                    s[m][1] += xr[m][k] * q1;
                }
            }
    }
}

/* 8-bit weights in calls of at most HOIST_ROWS rows (a lone stream's Q8_0 LM head): the
   block's scale d out of the inner loop, d sum(x q) per block, so a weight costs its sign
   extension (two shifts, one for the top byte), a convert and its FMA: 4 operations, 5 before. */
KERNEL_INLINE void q8_sums(vf s[HOIST_ROWS][2], const float *const xr[HOIST_ROWS],
                           const uint8_t *r, int64_t k0, int MT) {
    const uint8_t *qs = r + 2 * P;
    for (int g = 0; g < 8; g++) {
        const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
        for (int i = 0; i < 4; i++) {
            const vf q0 = __builtin_convertvector((v0 << (24 - 8 * i)) >> 24, vf);
            const vf q1 = __builtin_convertvector((v1 << (24 - 8 * i)) >> 24, vf);
            const int64_t k = k0 + 4 * g + i;
            for (int m = 0; m < MT; m++) {
                s[m][0] += xr[m][k] * q0;
                s[m][1] += xr[m][k] * q1;
            }
        }
    }
}

/* Rows m0 .. m0+MT (at most HOIST_ROWS) times one panel: per block the sums of x q, then
   acc += d sum(x q) (+ m sum(x) for 4-bit, from xsum) */
KERNEL_INLINE void hoisted_tile(int qtype, const float *x, const float *xsum,
                                const uint8_t *panel, const float *bias, float *y, int64_t N,
                                int64_t K, int64_t m0, int64_t n0, int MT) {
    vf acc[8][2];
    const float *xr[HOIST_ROWS], *sr[HOIST_ROWS];
    for (int i = 0; i < MT; i++) {
        acc[i][0] = acc[i][1] = (vf){0};
        xr[i] = x + (m0 + i) * K;
        sr[i] = qtype == Q4 ? xsum + (m0 + i) * (K / QK) : NULL;
    }
    const int64_t rec = record_bytes(qtype);
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *r = panel + b * rec;
        vf s[HOIST_ROWS][2];
        for (int i = 0; i < MT; i++) s[i][0] = s[i][1] = (vf){0};
        if (qtype == Q4) q4_sums(s, xr, r, b * QK, MT);
        else q8_sums(s, xr, r, b * QK, MT);
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        if (qtype == Q4) {
            const vf o0 = halves(r + 2 * P), o1 = halves(r + 2 * P + 2 * LANES);
            for (int m = 0; m < MT; m++) {
                acc[m][0] += d0 * s[m][0] + o0 * sr[m][b];
                acc[m][1] += d1 * s[m][1] + o1 * sr[m][b];
            }
        } else {
            for (int m = 0; m < MT; m++) {
                acc[m][0] += d0 * s[m][0];
                acc[m][1] += d1 * s[m][1];
            }
        }
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

/* rows m0 .. m1 (at most HOIST_ROWS) of a QTYPE panel; xsum: 4-bit's per-block sums of x */
KERNEL_INLINE void hoisted_rows(int qtype, const float *x, const float *xsum,
                                const uint8_t *panel, const float *bias, float *y, int64_t m0,
                                int64_t m1, int64_t N, int64_t K, int64_t n0) {
    switch (m1 - m0) {
        case 1: hoisted_tile(qtype, x, xsum, panel, bias, y, N, K, m0, n0, 1); break;
#if HOIST_ROWS >= 4
        case 3: hoisted_tile(qtype, x, xsum, panel, bias, y, N, K, m0, n0, 3); break;
        case 4: hoisted_tile(qtype, x, xsum, panel, bias, y, N, K, m0, n0, 4); break;
#endif
        default: hoisted_tile(qtype, x, xsum, panel, bias, y, N, K, m0, n0, 2); break;
    }
}

PANEL_ROWS(q4_panel_rows, q4_tile, uint8_t)
PANEL_ROWS(q8_panel_rows, q8_tile, uint8_t)
PANEL_ROWS(q6_panel_rows, q6_tile, uint8_t)

/* Where a row block has more rows than a tile (prefill), each tile would unpack the panel again:
   the panel is unpacked once per row block into float32 [K][P] (thread-local, L2-sized) and the
   block's tiles multiply that, so unpacking costs 1/48 of the products instead of 1/8. */
static void unpack(uint32_t qtype, const uint8_t *panel, float *out, int64_t K) {
    const int64_t rec = record_bytes(qtype);
    for (int64_t b = 0; b < K / QK; b++)
        for (int h = 0; h < 2; h++) {
            vf w[QK];
            if (qtype == Q4) q4_block(panel + b * rec, h, w);
            else if (qtype == Q6) q6_block(panel + b * rec, h, w);
            else q8_block(panel + b * rec, h, w);
            for (int k = 0; k < QK; k++)
                memcpy(out + (b * QK + k) * P + h * LANES, &w[k], sizeof(vf));
        }
}

KERNEL_INLINE void load_floats(const float *p, vf *w0, vf *w1) {
    memcpy(w0, p, sizeof *w0);
    memcpy(w1, p + LANES, sizeof *w1);
}

FLOAT_TILE(f32_tile, float, load_floats)
PANEL_ROWS(f32_panel_rows, f32_tile, float)

/* ---- 8-bit activations: integer dot products over 4-bit weights ---------------------------- */
#if DOT

/* four u8 x s8 products summed into each 32-bit lane of acc (without VNNI: vpmaddubsw to int16
   pairs, |15 x 127 x 2| fits, then vpmaddwd with ones) */
KERNEL_INLINE vi dot4(vi acc, vi u, vi s) {
#if VBYTES == 64 && defined(__AVX512VNNI__)
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)s);
#elif VBYTES == 64
    return acc + (vi)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)u, (__m512i)s),
                                       _mm512_set1_epi16(1));
#else
    return acc + (vi)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)s),
                                       _mm256_set1_epi16(1));
#endif
}

/* One row's activations as 8-bit blocks: qx[K] int8, and per block its scale and sum. */
static void quantize_row(const float *x, int64_t K, int8_t *qx, float *scale, float *sum) {
    for (int64_t b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f, s = 0.0f;
        for (int k = 0; k < QK; k++) {
            amax = fmaxf(amax, fabsf(xb[k]));
            s += xb[k];
        }
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < QK; k++) qx[b * QK + k] = (int8_t)lrintf(xb[k] * inv);
        scale[b] = d;
        sum[b] = s;
    }
}

KERNEL_INLINE void dot_tile(const int8_t *qx, const float *xd, const float *xs,
                            const uint8_t *panel, const float *bias, float *y, int64_t N,
                            int64_t K, int64_t m0, int64_t n0, int MT) {
    vf acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};
    const int64_t blocks = K / QK, rec = record_bytes(Q4);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + 4 * P;
        vi isum[8][2];
        for (int i = 0; i < MT; i++) isum[i][0] = isum[i][1] = (vi){0};
        const vi low = (vi){0} + 0x0f0f0f0f; /* each byte's low nibble */
        for (int g = 0; g < 4; g++) {
            const vi v0 = quads(qs + 4 * P * g), v1 = quads(qs + 4 * P * g + 4 * LANES);
            const vi lo0 = v0 & low, lo1 = v1 & low;
            /* a 32-bit shift moves each byte's high nibble down; the mask drops what came in */
            const vi hi0 = (v0 >> 4) & low, hi1 = (v1 >> 4) & low;
            for (int i = 0; i < MT; i++) {
                const int8_t *q = qx + (m0 + i) * K + b * QK;
                int32_t a, c;
                memcpy(&a, q + 4 * g, 4);
                memcpy(&c, q + 16 + 4 * g, 4);
                const vi xa = (vi){0} + a, xc = (vi){0} + c;
                isum[i][0] = dot4(dot4(isum[i][0], lo0, xa), hi0, xc);
                isum[i][1] = dot4(dot4(isum[i][1], lo1, xa), hi1, xc);
            }
        }
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        const vf o0 = halves(r + 2 * P), o1 = halves(r + 2 * P + 2 * LANES);
        for (int i = 0; i < MT; i++) {
            const float dx = xd[(m0 + i) * blocks + b], sx = xs[(m0 + i) * blocks + b];
            acc[i][0] += __builtin_convertvector(isum[i][0], vf) * (d0 * dx) + o0 * sx;
            acc[i][1] += __builtin_convertvector(isum[i][1], vf) * (d1 * dx) + o1 * sx;
        }
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

static void dot_panel_rows(const int8_t *qx, const float *xd, const float *xs,
                           const uint8_t *panel, const float *bias, float *y, int64_t M,
                           int64_t N, int64_t K, int64_t n0) {
    int64_t m = 0;
    for (; m + DOT_MT <= M; m += DOT_MT)
        dot_tile(qx, xd, xs, panel, bias, y, N, K, m, n0, DOT_MT);
    TAIL_TILES(dot_tile, M - m, qx, xd, xs, panel, bias, y, N, K, m, n0)
}

/* returns nonzero where its buffers could not be allocated (the float32 way runs then) */
static int linear_dot(const float *x, const uint8_t *ws, const float *bias, float *y, int64_t M,
                      int64_t N, int64_t K, int num_threads) {
    const int64_t blocks = K / QK, panels = (N + P - 1) / P, panel_size = blocks * record_bytes(Q4);
    int8_t *qx = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(2 * M * blocks));
    if (qx == NULL || xd == NULL) {
        free(qx);
        free(xd);
        return 1;
    }
    float *xs = xd + M * blocks;
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * K, K, qx + m * K, xd + m * blocks, xs + m * blocks);
    Stolen stolen;
    stolen_init(&stolen, panels, num_threads);
#pragma omp parallel num_threads(num_threads)
    FOR_PANELS(t, panels, M, &stolen,
               dot_panel_rows(qx, xd, xs, ws + t * panel_size, bias, y, M, N, K, t * P))
    free(qx);
    free(xd);
    return 0;
}
#endif

/* x rounded to bfloat16 (to nearest even), as float32 in xr and, for the dot products, as
   bfloat16 in xb (NULL: not wanted) */
static void round_bf16(const float *x, int64_t n, float *xr, uint16_t *xb) {
    int64_t i = 0;
#if BF_DOT
    for (; i + 16 <= n; i += 16) {
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
        if (xb) _mm256_storeu_si256((void *)(xb + i), h);
        _mm512_storeu_si512(xr + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
#endif
    for (; i < n; i++) {
        const uint16_t h = float_to_bf16(x[i]);
        xr[i] = bf16_to_float(h);
        if (xb) xb[i] = h;
    }
}

/* One row of x rounded (round_bf16) and, where sums is not NULL, the rounded row's sum over each
   32-weight block (what a block's offset m multiplies) */
static void round_row(const float *x, int64_t K, float *xr, uint16_t *xb, float *sums) {
    round_bf16(x, K, xr, xb);
    for (int64_t b = 0; sums != NULL && b < K / QK; b++) {
        float t = 0;
        for (int j = 0; j < QK; j++) t += xr[b * QK + j];
        sums[b] = t;
    }
}

/* ---- bfloat16 activations: AVX512-BF16 dot products over 4-bit weights ------------------- */
#if BF_DOT

#define BF_CHUNK 8 /* 32-weight blocks per K chunk: a chunk's quants are 16 KiB, L1-resident */

/* Blocks b0 .. b1 of a panel's 4- or 8-bit quants as bfloat16 pairs for vdpbf16ps:
   out[((b - b0) * 16 + p) * 2 P + 2 o + j] is output o's quant 2p + j of block b, an integer
   (0..15, or -128..127), exact in bfloat16. d and m stay in the panel's records and scale each
   block's sums in float32, so the weights are exact and only x is rounded. */
static void unpack_bf16(int qtype, const uint8_t *panel, uint16_t *out, int64_t b0,
                        int64_t b1) {
    const int q8 = qtype == Q8, groups = q8 ? 8 : 4, halves_ = q8 ? 1 : 2;
    const int64_t rec = record_bytes(qtype);
    const vi low = (vi){0} + 0xff, nib = (vi){0} + 0x0f0f0f0f;
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *qs = panel + b * rec + quants_at(qtype);
        uint16_t *ob = out + (b - b0) * (QK / 2) * 2 * P;
        for (int g = 0; g < groups; g++)
            for (int h = 0; h < 2; h++) {
                const vi v = quads(qs + 4 * P * g + 4 * LANES * h);
                /* 4-bit: quants 4g.., then 16 + 4g.. (the high nibbles); 8-bit: 4g.. */
                for (int half = 0; half < halves_; half++) {
                    const vi n = (v >> (4 * half)) & nib;
                    for (int j = 0; j < 2; j++) {  /* the pairs (4g, 4g + 1), (4g + 2, 4g + 3) */
                        /* bytes 2j and 2j + 1 of each lane: 8-bit ones sign-extended */
                        const vi lo = q8 ? (v << (24 - 16 * j)) >> 24 : (n >> (16 * j)) & low;
                        const vi hi = q8 ? (v << (16 - 16 * j)) >> 24 : (n >> (16 * j + 8)) & low;
                        /* a small integer's float32 bits end in 16 zero bits: its bfloat16 is
                           the top half */
                        const vu a = (vu)__builtin_convertvector(lo, vf);
                        const vu c = (vu)__builtin_convertvector(hi, vf);
                        const vu pair = (a >> 16) | (c & 0xffff0000u);
                        const int p = 8 * half + 2 * g + j;
                        memcpy(ob + p * 2 * P + 2 * LANES * h, &pair, sizeof pair);
                    }
                }
            }
    }
}

/* Rows m0 .. m0+MT over blocks b0 .. b1: each block's 16 pairs into block sums s (vdpbf16ps),
   then acc += d s + m sum(x) in float32; acc starts from y's partial sums after the first
   chunk, and the bias joins at the last */
KERNEL_INLINE void bf16_tile(int qtype, const uint16_t *xb, const float *xsum,
                             const uint16_t *qw, const uint8_t *panel, const float *bias,
                             float *y, int64_t N, int64_t K, int64_t b0, int64_t b1, int64_t m0,
                             int64_t n0, int MT) {
    vf acc[8][2]; /* room for any tail (TAIL_TILES); only MT of them are used */
    const uint16_t *xr[8];
    const float *sr[8];
    for (int i = 0; i < MT; i++) {
        acc[i][0] = acc[i][1] = (vf){0};
        xr[i] = xb + (m0 + i) * K;
        sr[i] = xsum + (m0 + i) * (K / QK);
    }
    if (b0 > 0) load_rows(acc, y, N, m0, n0, MT);
    const int64_t rec = record_bytes(qtype);
    for (int64_t b = b0; b < b1; b++) {
        __m512 s[8][2];
        for (int i = 0; i < MT; i++) s[i][0] = s[i][1] = _mm512_setzero_ps();
        const uint16_t *qb = qw + (b - b0) * (QK / 2) * 2 * P;
        for (int p = 0; p < QK / 2; p++) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(qb + p * 2 * P);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(qb + p * 2 * P + 2 * LANES);
            for (int i = 0; i < MT; i++) {
                uint32_t pair;
                memcpy(&pair, xr[i] + b * QK + 2 * p, sizeof pair);
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
                s[i][0] = _mm512_dpbf16_ps(s[i][0], xv, w0);
                s[i][1] = _mm512_dpbf16_ps(s[i][1], xv, w1);
            }
        }
        const uint8_t *r = panel + b * rec;
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        /* 4-bit: + m sum(x); 8-bit weights have no offset */
        const vf o0 = qtype == Q4 ? halves(r + 2 * P) : (vf){0};
        const vf o1 = qtype == Q4 ? halves(r + 2 * P + 2 * LANES) : (vf){0};
        for (int i = 0; i < MT; i++) {
            acc[i][0] += d0 * (vf)s[i][0] + o0 * sr[i][b];
            acc[i][1] += d1 * (vf)s[i][1] + o1 * sr[i][b];
        }
    }
    store_rows(acc, b1 == K / QK ? bias : NULL, y, N, m0, n0, MT);
}

/* ---- a few rows: quants made bfloat16 in registers, no unpacked copy ----------------------
   At decode sizes the quants are read once per call, so the tiles above (an unpacked copy per
   chunk) and the float32 tiles (per weight and 16 outputs a mask or two shifts, a convert and an
   FMA) spend more on the unpacking than on the products: one stream's 4-bit projections read
   ~19 GB/s of the box's ~35. Here a 32-bit lane of a quads() load gives 4 vdpbf16ps operands,
   each two nibbles (bytes 0 and 2, 1 and 3; at bit 0 and at bit 4) masked into the low bits of
   16-bit halves and ORed into 0x4300: bfloat16 128 + n, exact (one vpternlogd). A 4-bit weight
   is its nibble q (weights 4g + i and 16 + 4g + i); an 8-bit one, its sign bit flipped, is
   16 hi + lo - 128 (both nibbles of weight 4g + i), its high nibble's x taken 16 times (exact in
   bfloat16). So a pair of weights costs a shift (for 3 of 4), one logic op and half (4-bit) or a
   whole (8-bit) dot product for 16 outputs; each block's sums carry 128 sum(x) (4-bit) or
   2304 sum(x) (8-bit) more, taken out with the offset: acc += d s + o sum(x), o = m - 128 d or
   -2304 d. The products are the other bf16 paths' (x rounded, the weights exact), only the order
   of the float32 sums differs. */

#define PAIR_ROWS 2 /* rows per tile: 4 sums each per output vector, in registers */

/* quads per 32-weight block (4-bit: 4, each 8 weights; 8-bit: 8, each 4) and so x pairs */
#define PAIR_GROUPS(QTYPE) ((QTYPE) == Q8 ? 8 : 4)

/* x's bfloat16 pairs in the order pairs_tile takes them: per row, block and group g,
   4-bit (4g, 4g + 2), (4g + 1, 4g + 3), (16 + 4g, 18 + 4g), (17 + 4g, 19 + 4g); 8-bit (4g,
   4g + 2), (4g + 1, 4g + 3), then the same two times 16. xr: x rounded, as float32. */
static void pairs_of(int qtype, const float *xr, int64_t K, uint32_t *xp) {
    const int groups = PAIR_GROUPS(qtype);
    for (int64_t b = 0; b < K / QK; b++)
        for (int g = 0; g < groups; g++) {
            const float *xg = xr + b * QK + 4 * g;
            uint32_t *o = xp + (b * groups + g) * 4;
            const int hi = qtype == Q8 ? 0 : 16;
            const float scale = qtype == Q8 ? 16.0f : 1.0f;
            o[0] = float_to_bf16(xg[0]) | (uint32_t)float_to_bf16(xg[2]) << 16;
            o[1] = float_to_bf16(xg[1]) | (uint32_t)float_to_bf16(xg[3]) << 16;
            o[2] = float_to_bf16(scale * xg[hi])
                   | (uint32_t)float_to_bf16(scale * xg[hi + 2]) << 16;
            o[3] = float_to_bf16(scale * xg[hi + 1])
                   | (uint32_t)float_to_bf16(scale * xg[hi + 3]) << 16;
        }
}

/* the nibbles at bits 0 and 16 of each lane of v as bfloat16 128 + n */
KERNEL_INLINE __m512bh nibble_pair(__m512i v) {
    return (__m512bh)_mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi32(0x000f000f)),
                                     _mm512_set1_epi32(0x43004300));
}

KERNEL_INLINE void pairs_tile(int qtype, const uint32_t *xp, const float *xsum,
                              const uint8_t *panel, const float *bias, float *y, int64_t N,
                              int64_t K, int64_t m0, int64_t n0, int MT) {
    vf acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};
    const int groups = PAIR_GROUPS(qtype);
    const int64_t blocks = K / QK, rec = record_bytes(qtype);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + quants_at(qtype);
        __m512 s[PAIR_ROWS][2][4];
        for (int i = 0; i < MT; i++)
            for (int h = 0; h < 2; h++)
                for (int c = 0; c < 4; c++) s[i][h][c] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++)
            for (int h = 0; h < 2; h++) {
                __m512i v = _mm512_loadu_si512(qs + 4 * P * g + 4 * LANES * h);
                if (qtype == Q8) v = _mm512_xor_si512(v, _mm512_set1_epi32((int)0x80808080u));
                const __m512bh w[4] = {nibble_pair(v), nibble_pair(_mm512_srli_epi32(v, 8)),
                                       nibble_pair(_mm512_srli_epi32(v, 4)),
                                       nibble_pair(_mm512_srli_epi32(v, 12))};
                for (int i = 0; i < MT; i++) {
                    const uint32_t *xq = xp + (((m0 + i) * blocks + b) * groups + g) * 4;
                    for (int c = 0; c < 4; c++)
                        s[i][h][c] = _mm512_dpbf16_ps(
                            s[i][h][c], (__m512bh)_mm512_set1_epi32((int)xq[c]), w[c]);
                }
            }
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        const vf o0 = qtype == Q8 ? d0 * -2304.0f : halves(r + 2 * P) - 128.0f * d0;
        const vf o1 = qtype == Q8 ? d1 * -2304.0f : halves(r + 2 * P + 2 * LANES) - 128.0f * d1;
        for (int i = 0; i < MT; i++) {
            const float xs = xsum[(m0 + i) * blocks + b];
            const vf s0 = (vf)_mm512_add_ps(_mm512_add_ps(s[i][0][0], s[i][0][1]),
                                            _mm512_add_ps(s[i][0][2], s[i][0][3]));
            const vf s1 = (vf)_mm512_add_ps(_mm512_add_ps(s[i][1][0], s[i][1][1]),
                                            _mm512_add_ps(s[i][1][2], s[i][1][3]));
            acc[i][0] += d0 * s0 + o0 * xs;
            acc[i][1] += d1 * s1 + o1 * xs;
        }
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

static void pairs_panel(int qtype, const uint32_t *xp, const float *xsum, const uint8_t *panel,
                        const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                        int64_t n0) {
    int64_t m = 0;
#define PAIRS(QTYPE, ROWS) pairs_tile(QTYPE, xp, xsum, panel, bias, y, N, K, m, n0, ROWS)
    if (qtype == Q8) {
        for (; m + PAIR_ROWS <= M; m += PAIR_ROWS) PAIRS(Q8, PAIR_ROWS);
        if (m < M) PAIRS(Q8, 1);
    } else {
        for (; m + PAIR_ROWS <= M; m += PAIR_ROWS) PAIRS(Q4, PAIR_ROWS);
        if (m < M) PAIRS(Q4, 1);
    }
#undef PAIRS
}

/* 4- or 8-bit weights times x rounded to bfloat16 for calls of up to MIXED_ROWS (4-bit) or
   Q8_PAIR_ROWS (8-bit) rows: past them the unpacked chunks of bf16_panel are as fast or faster.
   Nonzero where its buffer could not be allocated (the float32 tiles run then). */
static int linear_pairs(int qtype, const float *x, const uint8_t *ws, const float *bias,
                        float *y, int64_t M, int64_t N, int64_t K, int num_threads) {
    const int64_t blocks = K / QK, panels = (N + P - 1) / P;
    const int64_t panel_size = blocks * record_bytes(qtype);
    const int64_t pairs = blocks * PAIR_GROUPS(qtype) * 4; /* x pairs a row */
    /* per row: x rounded (float32), its pairs, its block sums */
    float *xr = malloc((size_t)(M * K) * sizeof(float) + (size_t)(M * pairs) * sizeof(uint32_t)
                       + (size_t)(M * blocks) * sizeof(float));
    if (xr == NULL) return 1;
    uint32_t *xp = (uint32_t *)(xr + M * K);
    float *xsum = (float *)(xp + M * pairs);
    for (int64_t m = 0; m < M; m++) {
        round_row(x + m * K, K, xr + m * K, NULL, xsum + m * blocks);
        pairs_of(qtype, xr + m * K, K, xp + m * pairs);
    }
    Stolen stolen;
    stolen_init(&stolen, panels, num_threads);
#pragma omp parallel num_threads(num_threads)
    FOR_PANELS(t, panels, M, &stolen,
               pairs_panel(qtype, xp, xsum, ws + t * panel_size, bias, y, M, N, K, t * P))
    free(xr);
    return 0;
}

/* One panel against all M rows, a K chunk at a time: the chunk's quants unpacked once into qw
   (the unpacking is 1/M of the products) and kept in L1 while every row tile passes (a whole
   panel's, 96 KiB at K = 1536, streamed from L2 for each tile: 0.75x the float32 tiles) */
static void bf16_panel(int qtype, const uint16_t *xb, const float *xsum, uint16_t *qw,
                       const uint8_t *panel, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int64_t n0) {
    for (int64_t b0 = 0; b0 < K / QK; b0 += BF_CHUNK) {
        const int64_t b1 = b0 + BF_CHUNK < K / QK ? b0 + BF_CHUNK : K / QK;
        unpack_bf16(qtype, panel, qw, b0, b1);
        int64_t m = 0;
        for (; m + BF_MT <= M; m += BF_MT)
            bf16_tile(qtype, xb, xsum, qw, panel, bias, y, N, K, b0, b1, m, n0, BF_MT);
        TAIL_TILES(bf16_tile, M - m, qtype, xb, xsum, qw, panel, bias, y, N, K, b0, b1, m, n0)
    }
}
#endif

/* One panel against rows m0..m1 of x: unpacked once into `unpacked` for a block of rows (when
   there is a workspace), else per tile in registers. */
static void q_panel(int qtype, const float *x, const uint8_t *panel, float *unpacked,
                    const float *xsum, const float *bias, float *y, int64_t m0, int64_t m1,
                    int64_t N, int64_t K, int64_t n0) {
    if (xsum != NULL) {  /* the whole call: at most HOIST_ROWS rows, 4-bit */
        hoisted_rows(Q4, x, xsum, panel, bias, y, 0, m1, N, K, n0);
    } else if (unpacked != NULL && m1 - m0 > MIXED_ROWS) {
        unpack(qtype, panel, unpacked, K);
        f32_panel_rows(x, unpacked, bias, y, m0, m1, N, K, n0, NULL, 0);
    } else if (qtype == Q4) {
        q4_panel_rows(x, panel, bias, y, m0, m1, N, K, n0, NULL, 0);
    } else if (qtype == Q6) {
        q6_panel_rows(x, panel, bias, y, m0, m1, N, K, n0, NULL, 0);
    } else if (m1 - m0 <= HOIST_ROWS) {
        hoisted_rows(Q8, x, NULL, panel, bias, y, m0, m1, N, K, n0);
    } else {
        q8_panel_rows(x, panel, bias, y, m0, m1, N, K, n0, NULL, 0);
    }
}

/* x [M, K] float32, packed w (header + panels, above), bias [N] float32 or NULL, y [M, N]
   float32. Returns 2 where the header does not describe an [N, K] weight of this build's panel
   (nothing is computed). */
int linear_q(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
             int64_t K, int num_threads) {
    QHeader h;
    memcpy(&h, w, sizeof h);
    if (h.magic != Q_MAGIC || h.n != N || h.k != K || K % QK || h.panel != PANEL_MIXED
        || (h.qtype != Q4 && h.qtype != Q8 && h.qtype != Q6))
        return 2;
    const float *xs = x, *bs = bias;
    const uint8_t *ws = (const uint8_t *)w + Q_HEADER;
    float *ys = y;
#if DOT
    if (h.qtype == Q4 && act_mode == ACT_INT8 && !linear_dot(xs, ws, bs, ys, M, N, K, num_threads))
        return 0;
#endif
    const int64_t panels = (N + P - 1) / P, panel_size = K / QK * record_bytes(h.qtype);
    /* bfloat16 activations: every 4- and 8-bit path multiplies x rounded to bfloat16: up to
       pair_rows rows in bfloat16 pairs (linear_pairs), more in the dot-product tiles over its
       bfloat16 copy xb with each row's block sums xsum; without memory for them, the float32
       tiles over the rounded x (4-bit calls of up to HOIST_ROWS rows round x as they scale it,
       below) */
    const int round_x = (h.qtype == Q4 || h.qtype == Q8) && act_mode == ACT_BF16;
    const int64_t pair_rows = h.qtype == Q8 ? Q8_PAIR_ROWS : MIXED_ROWS;
#if BF_DOT
    if (round_x && M <= pair_rows && !linear_pairs(h.qtype, xs, ws, bs, ys, M, N, K,
                                                   num_threads))
        return 0;
#endif
    float *xround = NULL, *xsum = NULL;
    uint16_t *xb = NULL;
    if (round_x && (M > HOIST_ROWS || h.qtype == Q8)) {
        const int dots = BF_DOT && M > pair_rows;
        xround = malloc((size_t)(M * K) * sizeof(float)
                        + (dots ? (size_t)(M * K / QK) * sizeof(float) + (size_t)(M * K) * 2 : 0));
        if (xround != NULL) {
            if (dots) {
                xsum = xround + M * K;
                xb = (uint16_t *)(xsum + M * K / QK);
            }
            /* row by row across the team beyond a tile of rows: on one thread, with the other
               waiting, this took 14% of a 32-row call at K = 1536 */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > MIXED_ROWS)
            for (int64_t m = 0; m < M; m++)
                round_row(xs + m * K, K, xround + m * K, xb ? xb + m * K : NULL,
                          xsum ? xsum + m * (K / QK) : NULL);
            xs = xround;
        }
    }
#if BF_DOT
    if (xb != NULL) {
        int failed = 0;
        Stolen stolen;
        stolen_init(&stolen, panels, num_threads);
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            uint16_t *qw = malloc((size_t)(BF_CHUNK * QK * P) * sizeof(uint16_t));
            if (qw != NULL) {
                FOR_PANELS(t, panels, M, &stolen,
                           bf16_panel(h.qtype, xb, xsum, qw, ws + t * panel_size, bs, ys, M, N,
                                      K, t * P))
            }
            failed = qw == NULL;
            free(qw);
        }
        if (!failed) {
            free(xround);
            return 0;
        }
        xsum = NULL;  /* no workspace: the float32 tiles over the rounded x */
    }
#endif
    /* few rows of 4-bit weights: x scaled per position and its block sums (hoisted_tile) */
    float *xscaled = NULL;
    if (h.qtype == Q4 && M <= HOIST_ROWS
        && (xscaled = malloc((size_t)(M * K + M * K / QK) * sizeof(float)))) {
        xsum = xscaled + M * K;
        for (int64_t b = 0; b < M * (K / QK); b++) {
            float t = 0;
            for (int j = 0; j < QK; j++) {
                const float v = round_x ? bf16_to_float(float_to_bf16(xs[b * QK + j]))
                                        : xs[b * QK + j];
                t += v;
                xscaled[b * QK + j] = ldexpf(v, -q4_x_exponent(j));
            }
            xsum[b] = t;
        }
    }
    Stolen stolen;
    stolen_init(&stolen, panels, num_threads);
#pragma omp parallel num_threads(num_threads)
    {
        /* NULL (one tile of rows, or no memory): every tile unpacks in registers */
        float *unpacked = M > MIXED_ROWS ? malloc((size_t)K * P * sizeof(float)) : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
            FOR_PANELS(t, panels, M, &stolen,
                       q_panel(h.qtype, xscaled ? xscaled : xs, ws + t * panel_size, unpacked,
                               xsum, bs, ys, m0, m1, N, K, t * P))
        }
        free(unpacked);
    }
    free(xscaled);
    free(xround);
    return 0;
}
