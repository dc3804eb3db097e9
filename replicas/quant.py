"""Block-quantized weights: the GGML block formats shardserve multiplies natively (Q4_0, Q4_1,
Q8_0; Q4_K repacked into Q4_1 blocks, Q6_K into 32-weight 6-bit blocks), their dequantization, weight-only int8 quantization of
float weights, and the packing the native kernel reads (`kernels/quant_linear.c`: panels of
output columns, one record per 32-weight block, behind a 64-byte header that names the type and
shape).

Raw weights are GGUF's own rows: a [rows, blocks * block_bytes] uint8 tensor, each block a
float16 scale d (Q4_1: then a float16 offset m) and its quants: Q4 packs element j in the low
nibble and element j + 16 in the high nibble of byte j; Q8_0 is 32 int8. Weight = d * q (Q8_0),
d * (q - 8) (Q4_0), d * q + m (Q4_1). Q6 (`q6_k_to_q6`, 28 bytes) is float16 d0 and d1 (the
scales of elements 0..15 and 16..31), the quants' low nibbles as Q4's 16 bytes, then their top
two bits in 8 bytes: byte 4h + i holds element 16h + 4g + i's at bit 2g; weight = d (q - 32)."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, in every native format


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # GGMLQuantizationType's value
    block_bytes: int


Q4_0 = BlockFormat("Q4_0", 2, 18)
Q4_1 = BlockFormat("Q4_1", 3, 20)
Q8_0 = BlockFormat("Q8_0", 8, 34)
NATIVE: dict[int, BlockFormat] = {f.ggml_type: f for f in (Q4_0, Q4_1, Q8_0)}
# Q4_K (most published GGUFs: Q4_K_M, Q4_K_S) is Q4_1 with a two-level scale: repacked at load
Q4_K_TYPE, Q4_K_BYTES = 12, 144  # a super-block of 256 weights: 8 Q4_1-like blocks
# Q6_K (Q4_K_M's output, attn_v and half its ffn_down; Q6_K files): a super-block of 256 6-bit
# weights with 16 int8 scales under a float16 d, repacked at load into eight Q6 blocks
Q6_K_TYPE, Q6_K_BYTES = 14, 210
Q6 = BlockFormat("Q6_K", Q6_K_TYPE, 28)

# the kernel's record types and header (quant_linear.c)
_KERNEL_Q4, _KERNEL_Q8, _KERNEL_Q6 = 0, 1, 2
_MAGIC = 0x51535353
HEADER_BYTES = 64


def _blocks(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """[rows, row_bytes] -> [rows, blocks, block_bytes], checking the row is whole blocks."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % fmt.block_bytes:
        raise ValueError(f"{fmt.name} rows must be uint8 [rows, k/{BLOCK} * {fmt.block_bytes}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    return raw.view(raw.shape[0], -1, fmt.block_bytes)


def _halves(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] float32 (little-endian float16)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _q4(b: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, ...]:
    """4-bit blocks [rows, blocks, bytes] -> (d, m [rows, blocks], q [rows, blocks, 32] in
    0..15): weight = d q + m (Q4_0: m = -8 d, exact in float32)."""
    d = _halves(b[..., 0:2])
    m = _halves(b[..., 2:4]) if fmt is Q4_1 else d * -8
    qs = b[..., 4:] if fmt is Q4_1 else b[..., 2:]
    return d, m, torch.cat([qs & 15, qs >> 4], dim=-1).float()  # element j, then j + 16


def q4_k_to_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_K rows -> Q4_1 rows of the same weights, for the Q4_1 kernel. A Q4_K super-block holds
    float16 d and dmin, eight 6-bit (scale, min) pairs packed in 12 bytes (llama.cpp's
    `get_scale_min_k4`) and 128 bytes of quants: bytes 32i..32i+31 hold sub-block 2i in their low
    nibbles and 2i + 1 in their high ones. Sub-block j's weight d sc_j q - dmin m_j is Q4_1's
    d' q + m' with d' = d sc_j and m' = -dmin m_j, rounded to float16 (2^-11 of the scale: far
    below a 4-bit step); the quants move exactly. 5 bits a weight instead of 4.5."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % Q4_K_BYTES:
        raise ValueError(f"Q4_K rows must be uint8 [rows, k/256 * {Q4_K_BYTES}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    b = raw.view(raw.shape[0], -1, Q4_K_BYTES)
    d, dmin = _halves(b[..., 0:2]), _halves(b[..., 2:4])
    s = b[..., 4:16].int()
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)  # [rows, supers, 8]
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    scale = (d.unsqueeze(-1) * sc).half()
    offset = (-(dmin.unsqueeze(-1) * mn)).half()
    if not (scale.isfinite().all() and offset.isfinite().all()):
        raise ValueError("a Q4_K scale overflows float16")
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 32)
    v = torch.stack([qs & 15, qs >> 4], dim=3).reshape(*b.shape[:2], 8, 32)  # sub-block order
    quants = v[..., :16] | (v[..., 16:] << 4)  # Q4_1: element j low, j + 16 high
    out = torch.cat([scale.unsqueeze(-1).view(torch.uint8), offset.unsqueeze(-1).view(torch.uint8),
                     quants], dim=-1)
    return out.reshape(raw.shape[0], -1)


def q6_k_to_q6(raw: torch.Tensor) -> torch.Tensor:
    """Q6_K rows -> Q6 rows of the same weights, for the 6-bit kernel. A Q6_K super-block is
    ql[128] (low nibbles), qh[64] (top two bits), 16 int8 scales and a float16 d; element
    128n + 32j + l (n, j < 2 or 4, l < 32) is ql[64n + l + 32 (j % 2)]'s nibble j // 2 with
    qh[32n + l]'s bits 2j, 2j + 1 on top (llama.cpp's `dequantize_row_q6_K`), scaled by
    d sc[element // 16]. Each 16 elements' d sc is rounded to float16 (2^-11 of the scale: far
    below a 6-bit step); the quants move exactly. 7 bits a weight instead of 6.56."""
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % Q6_K_BYTES:
        raise ValueError(f"Q6_K rows must be uint8 [rows, k/256 * {Q6_K_BYTES}], "
                         f"got {raw.dtype} {tuple(raw.shape)}")
    b = raw.view(raw.shape[0], -1, Q6_K_BYTES)
    rows, supers = b.shape[:2]
    ql = b[..., :128].reshape(rows, supers, 2, 2, 32)  # [n][j % 2][l]
    qh = b[..., 128:192].reshape(rows, supers, 2, 1, 32)  # [n][l]
    low = torch.stack([ql & 15, ql >> 4], dim=3)  # [n][j // 2][j % 2][l]
    top = torch.stack([(qh >> (2 * j)) & 3 for j in range(4)], dim=3).view(
        rows, supers, 2, 2, 2, 32)  # [n][j // 2][j % 2][l]
    q = (low | (top << 4)).reshape(rows, supers * 8, 32)  # element order, 32 a block
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    scale = (_halves(b[..., 208:210]).unsqueeze(-1) * sc).half()  # [rows, supers, 16]
    if not scale.isfinite().all():
        raise ValueError("a Q6_K scale overflows float16")
    scales = scale.view(torch.uint8).reshape(rows, supers * 8, 4)  # d0, d1 per block
    nibbles = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    bits = (q >> 4).reshape(rows, supers * 8, 2, 4, 4)  # [half][g][i]
    highs = (bits << torch.tensor([0, 2, 4, 6]).view(4, 1)).sum(3, dtype=torch.uint8)
    out = torch.cat([scales, nibbles, highs.reshape(rows, supers * 8, 8)], dim=-1)
    return out.reshape(rows, -1)


# GGML types repacked at load into a native format: (repacker of raw GGUF rows, the format)
REPACKED = {Q4_K_TYPE: (q4_k_to_q4_1, Q4_1), Q6_K_TYPE: (q6_k_to_q6, Q6)}


def _head_bytes(fmt: BlockFormat) -> int:
    """Bytes of float16 scales leading a block: d (Q8_0); d and m (4-bit); d0 and d1 (Q6)."""
    return 2 if fmt is Q8_0 else 4


def dequantize(raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Raw rows -> float32 [rows, k]: the reference every kernel is tested against."""
    b = _blocks(raw, fmt)
    if fmt is Q8_0:
        w = _halves(b[..., 0:2]).unsqueeze(-1) * b[..., 2:].contiguous().view(torch.int8).float()
    elif fmt is Q6:
        d = _halves(b[..., 0:4].reshape(*b.shape[:2], 2, 2))  # [rows, blocks, 2]: d0, d1
        nibbles, bits = b[..., 4:20], b[..., 20:28].reshape(*b.shape[:2], 2, 1, 4)
        top = torch.stack([(bits >> (2 * g)) & 3 for g in range(4)], dim=3)  # [half][g][i]
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1) | (top.reshape(*b.shape[:2], 32) << 4)
        w = d.repeat_interleave(16, dim=-1) * (q.float() - 32)
    else:
        d, m, q = _q4(b, fmt)
        w = d.unsqueeze(-1) * q + m.unsqueeze(-1)
    return w.reshape(raw.shape[0], -1)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """float weight [n, k] (k a multiple of 32) -> Q8_0 raw rows, as llama.cpp rounds them:
    d = max|w| / 127 per block, q = round(w / d)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"int8 quantization needs input features divisible by {BLOCK}, got {k}")
    w = weight.float().reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(d > 0, w / torch.where(d > 0, d, 1.0), 0.0).round().clamp(-127, 127)
    scale = d.to(torch.float16).view(torch.uint8).reshape(n, k // BLOCK, 2)
    quants = q.to(torch.int8).view(torch.uint8)
    return torch.cat([scale, quants], dim=-1).reshape(n, -1)


def dot_reference(x: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """What `linear_q` computes for 4-bit weights with 8-bit activations (as llama.cpp's Q8_1
    activations): each row's block of 32 x rounded to int8 with dx = max|x| / 127, then
    sum(x w) = d dx sum(qx q) + m sum(x) per block (Q4_0: m = -8 d). x [rows, k] float32."""
    if fmt is Q8_0 or fmt is Q6:
        raise ValueError("8-bit activations are used with 4-bit weights only")
    d, m, q = _q4(_blocks(raw, fmt), fmt)
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    dx = xb.abs().amax(-1) / 127
    qx = torch.round(xb / torch.where(dx > 0, dx, 1.0).unsqueeze(-1))
    integer = torch.einsum("rbk,nbk->rnb", qx, q)
    return (integer * d.unsqueeze(0) * dx.unsqueeze(1)).sum(-1) + torch.einsum(
        "rb,nb->rn", xb.sum(-1), m)


def embedding(ids: torch.Tensor, raw: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The float32 rows `ids` of a quantized embedding table, dequantized as gathered: from
    GGUF's rows, or (a 1-d `raw`) from `pack`'s panels, which a tied LM head shares."""
    flat = ids.reshape(-1)
    if raw.dim() == 1:  # a prefill's ids a few hundred at a time: each gathers whole records
        parts = [packed_rows(raw, flat[i:i + 256]) for i in range(0, flat.numel(), 256)]
        rows, fmt = torch.cat([r for r, _ in parts]), parts[0][1]
    else:
        rows = raw[flat]
    return dequantize(rows, fmt).view(*ids.shape, -1)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, BlockFormat]:
    """Rows `ids` of a `pack`ed weight back as raw block rows: Q8_0's, or Q4_1's for both 4-bit
    formats (the panels hold Q4_0 as Q4_1 with m = -8 d, the same weights)."""
    magic, kernel_type, n, k, panel = struct.unpack_from("<IIqqI", packed[:HEADER_BYTES].numpy())
    if magic != _MAGIC:
        raise ValueError("not a packed quantized weight")
    fmt = {_KERNEL_Q8: Q8_0, _KERNEL_Q4: Q4_1, _KERNEL_Q6: Q6}[kernel_type]
    scales, blocks = _head_bytes(fmt), k // BLOCK
    records = packed[HEADER_BYTES:].view(-1, blocks, panel * fmt.block_bytes)
    rec = records[ids // panel]  # [rows, blocks, record]: each row's panel
    # a record: the panel's d (then its m), float16 each, then [groups of 4 quants][panel][4]
    heads = rec[..., :panel * scales].reshape(*rec.shape[:2], scales // 2, panel, 2)
    quants = rec[..., panel * scales:].reshape(*rec.shape[:2], -1, panel, 4)
    pick = (ids % panel).view(-1, 1, 1, 1, 1)
    head = heads.gather(3, pick.expand(-1, blocks, scales // 2, 1, 2))
    q = quants.gather(3, pick.expand(-1, blocks, quants.shape[2], 1, 4))
    block_rows = torch.cat([head.reshape(*rec.shape[:2], -1), q.reshape(*rec.shape[:2], -1)],
                           dim=-1)
    return block_rows.reshape(ids.shape[0], -1), fmt


def pack(raw: torch.Tensor, fmt: BlockFormat, panel: int) -> torch.Tensor:
    """Raw rows [n, ...] of an [n, k] weight -> the 1-d uint8 buffer `kernels.linear_q` reads:
    the header, then ceil(n / panel) panels of k / 32 records (quant_linear.c): the panel's
    scales (and offsets), then its quants in groups of four positions, each output's four bytes
    together (GGUF's 4-bit byte j holds weights j and j + 16: it moves whole); rows past n are
    zero (d = m = 0: they compute zeros)."""
    b = _blocks(raw, fmt)
    n, blocks = b.shape[0], b.shape[1]
    k = blocks * BLOCK
    if fmt is Q4_0:  # d * (q - 8) = d * q + m with m = -8 d: one 4-bit kernel for both
        d = b[..., 0:2].contiguous().view(torch.float16)
        m = (d * -8).view(torch.uint8)
        b = torch.cat([b[..., 0:2], m, b[..., 2:]], dim=-1)
    padded_n = -(-n // panel) * panel
    if padded_n != n:
        b = torch.cat([b, b.new_zeros(padded_n - n, *b.shape[1:])])
    # [panels, panel, blocks, bytes] -> [panels, blocks, panel, bytes]
    r = b.view(padded_n // panel, panel, blocks, -1).transpose(1, 2)
    scales = _head_bytes(fmt)
    # the quants as [groups of 4 positions][panel][4]: four consecutive bytes per output
    q = r[..., scales:]
    q = q.reshape(*q.shape[:3], -1, 4).permute(0, 1, 3, 2, 4)
    parts = [r[..., 0:2], q] if fmt is Q8_0 else [r[..., 0:2], r[..., 2:4], q]
    kernel_type = {Q8_0: _KERNEL_Q8, Q6: _KERNEL_Q6}.get(fmt, _KERNEL_Q4)
    records = torch.cat([part.reshape(part.shape[0], blocks, -1) for part in parts], dim=-1)
    header = bytearray(HEADER_BYTES)
    struct.pack_into("<IIqqI", header, 0, _MAGIC, kernel_type, n, k, panel)
    return torch.cat([torch.frombuffer(header, dtype=torch.uint8), records.reshape(-1)])
