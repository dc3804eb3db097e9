/* float32 linear layers over block-quantized weights (GGUF's Q4_0, Q4_1 and Q8_0, and
   `--quantization int8`): y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), the weight kept in its
   4- or 8-bit blocks and unpacked in registers inside the matmul, so a decode step reads 4.5 to
   8.5 bits a weight instead of 16 or 32.

   Every 32 consecutive weights of an output row share a float16 scale d (and, for 4-bit, an
   offset m): w = d * q + m with q in 0..15 (Q4_0 is d * (q - 8), packed as m = -8 d), or
   w = d * q with q in -128..127. The packed weight is panels of PANEL_MIXED output columns (two
   vectors, as linear_mixed), each a run of records, one per 32-weight block:

       4-bit: d[P] f16 | m[P] f16 | q[16][P] bytes (low nibble: weight j, high: weight j + 16)
       8-bit: d[P] f16 | q[32][P] int8

   so one vector load of a record row gives the same block position for LANES outputs (as GGUF
   stores a block's nibbles: element j low, j + 16 high). Unpacking is a zero/sign-extending load,
   a mask or shift, a conversion and one FMA with (d, m), amortised over a tile of rows; the
   products accumulate in float32 as linear_mixed's do. A 64-byte header in front says the type
   and the shape, and the kernel refuses a buffer whose header does not match its arguments. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtype.h"
#include "vec.h"

#define QK 32
#define Q_HEADER 64
#define Q_MAGIC 0x51535353u /* "SSSQ" */
enum { Q4 = 0, Q8 = 1 };

typedef struct {
    uint32_t magic, qtype;
    int64_t n, k;
    uint32_t panel;
} QHeader;

int quant_header_bytes(void) { return Q_HEADER; }

/* bytes per 32-weight block of one panel */
static int64_t record_bytes(uint32_t qtype) {
    return qtype == Q4 ? (int64_t)PANEL_MIXED * (4 + QK / 2) : (int64_t)PANEL_MIXED * (2 + QK);
}

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

/* LANES bytes at p, zero-extended (unsigned) or sign-extended, as int32 lanes */
KERNEL_INLINE vi bytes_u(const uint8_t *p) {
#if VBYTES == 64
    return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)p));
#elif VBYTES == 32 && defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)p));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
#endif
}

KERNEL_INLINE vi bytes_s(const uint8_t *p) {
#if VBYTES == 64
    return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)p));
#elif VBYTES == 32 && defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)p));
#else
    vsb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, vi);
#endif
}

#define P PANEL_MIXED

KERNEL_INLINE void q4_tile(const float *x, const uint8_t *panel, const float *bias, float *y,
                           int64_t N, int64_t K, int64_t m0, int64_t n0, int MT) {
    vf acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};
    const float *xr[8];
    for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;
    const int64_t blocks = K / QK, rec = record_bytes(Q4);
    const vi low = (vi){0} + 15;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + 4 * P;
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        const vf o0 = halves(r + 2 * P), o1 = halves(r + 2 * P + 2 * LANES);
        for (int j = 0; j < QK / 2; j++) {
            const vi u0 = bytes_u(qs + j * P), u1 = bytes_u(qs + j * P + LANES);
            const vf lo0 = __builtin_convertvector(u0 & low, vf) * d0 + o0;
            const vf lo1 = __builtin_convertvector(u1 & low, vf) * d1 + o1;
            for (int i = 0; i < MT; i++) {
                const float xv = xr[i][b * QK + j];
                acc[i][0] += xv * lo0;
                acc[i][1] += xv * lo1;
            }
            const vf hi0 = __builtin_convertvector(u0 >> 4, vf) * d0 + o0;
            const vf hi1 = __builtin_convertvector(u1 >> 4, vf) * d1 + o1;
            for (int i = 0; i < MT; i++) {
                const float xv = xr[i][b * QK + j + QK / 2];
                acc[i][0] += xv * hi0;
                acc[i][1] += xv * hi1;
            }
        }
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

KERNEL_INLINE void q8_tile(const float *x, const uint8_t *panel, const float *bias, float *y,
                           int64_t N, int64_t K, int64_t m0, int64_t n0, int MT) {
    vf acc[8][2];
    for (int i = 0; i < MT; i++) acc[i][0] = acc[i][1] = (vf){0};
    const float *xr[8];
    for (int i = 0; i < MT; i++) xr[i] = x + (m0 + i) * K;
    const int64_t blocks = K / QK, rec = record_bytes(Q8);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + 2 * P;
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        for (int j = 0; j < QK; j++) {
            const vf w0 = __builtin_convertvector(bytes_s(qs + j * P), vf) * d0;
            const vf w1 = __builtin_convertvector(bytes_s(qs + j * P + LANES), vf) * d1;
            for (int i = 0; i < MT; i++) {
                const float xv = xr[i][b * QK + j];
                acc[i][0] += xv * w0;
                acc[i][1] += xv * w1;
            }
        }
    }
    store_rows(acc, bias, y, N, m0, n0, MT);
}

PANEL_ROWS(q4_panel_rows, q4_tile, uint8_t)
PANEL_ROWS(q8_panel_rows, q8_tile, uint8_t)

/* Where a row block has more rows than a tile (prefill), each tile would unpack the panel again:
   the panel is unpacked once per row block into float32 [K][P] (thread-local, L2-sized) and the
   block's tiles multiply that, so unpacking costs 1/48 of the products instead of 1/8. */
static void q4_unpack(const uint8_t *panel, float *out, int64_t K) {
    const int64_t rec = record_bytes(Q4);
    const vi low = (vi){0} + 15;
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + 4 * P;
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        const vf o0 = halves(r + 2 * P), o1 = halves(r + 2 * P + 2 * LANES);
        float *w = out + b * QK * P;
        for (int j = 0; j < QK / 2; j++) {
            const vi u0 = bytes_u(qs + j * P), u1 = bytes_u(qs + j * P + LANES);
            const vf v[4] = {__builtin_convertvector(u0 & low, vf) * d0 + o0,
                             __builtin_convertvector(u1 & low, vf) * d1 + o1,
                             __builtin_convertvector(u0 >> 4, vf) * d0 + o0,
                             __builtin_convertvector(u1 >> 4, vf) * d1 + o1};
            memcpy(w + j * P, v, 2 * sizeof(vf));
            memcpy(w + (j + QK / 2) * P, v + 2, 2 * sizeof(vf));
        }
    }
}

static void q8_unpack(const uint8_t *panel, float *out, int64_t K) {
    const int64_t rec = record_bytes(Q8);
    for (int64_t b = 0; b < K / QK; b++) {
        const uint8_t *r = panel + b * rec, *qs = r + 2 * P;
        const vf d0 = halves(r), d1 = halves(r + 2 * LANES);
        float *w = out + b * QK * P;
        for (int j = 0; j < QK; j++) {
            const vf v[2] = {__builtin_convertvector(bytes_s(qs + j * P), vf) * d0,
                             __builtin_convertvector(bytes_s(qs + j * P + LANES), vf) * d1};
            memcpy(w + j * P, v, sizeof v);
        }
    }
}

KERNEL_INLINE vf load_floats(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

FLOAT_TILE(f32_tile, float, load_floats)
PANEL_ROWS(f32_panel_rows, f32_tile, float)

/* x [M, K] float32, packed w (header + panels, above), bias [N] float32 or NULL, y [M, N]
   float32. Returns 2 where the header does not describe an [N, K] weight of this build's panel
   (nothing is computed). */
int linear_q(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N,
             int64_t K, int num_threads) {
    QHeader h;
    memcpy(&h, w, sizeof h);
    if (h.magic != Q_MAGIC || h.n != N || h.k != K || K % QK || h.panel != PANEL_MIXED
        || (h.qtype != Q4 && h.qtype != Q8))
        return 2;
    const float *xs = x, *bs = bias;
    const uint8_t *ws = (const uint8_t *)w + Q_HEADER;
    float *ys = y;
    const int64_t panels = (N + P - 1) / P, panel_size = K / QK * record_bytes(h.qtype);
    const int q4 = h.qtype == Q4;
#pragma omp parallel num_threads(num_threads)
    {
        /* NULL (one tile of rows, or no memory): every tile unpacks in registers */
        float *unpacked = M > MIXED_ROWS ? malloc((size_t)K * P * sizeof(float)) : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < panels; t++) {
                const uint8_t *panel = ws + t * panel_size;
                if (unpacked != NULL && m1 - m0 > MIXED_ROWS) {
                    if (q4) q4_unpack(panel, unpacked, K);
                    else q8_unpack(panel, unpacked, K);
                    f32_panel_rows(xs, unpacked, bs, ys, m0, m1, N, K, t * P);
                } else if (q4) {
                    q4_panel_rows(xs, panel, bs, ys, m0, m1, N, K, t * P);
                } else {
                    q8_panel_rows(xs, panel, bs, ys, m0, m1, N, K, t * P);
                }
            }
        }
        free(unpacked);
    }
    return 0;
}
