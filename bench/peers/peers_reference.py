"""The peer benchmark's float64 reference (numpy): e4m3 codes to values, bf16 bits to values, the
two token formats (576 e4m3 bytes with per-tensor scales; 656-byte block-scaled tokens), MLA
attention of one query token over its keys, and the relative L2 error the peers are judged by.

Absorbed MLA: q [H, 576] (512 latent + 64 rotary), keys [n, 576] (ckv + kpe, decoded), values =
the keys' 512 latent dims; o = softmax(sm_scale q k^T) v, lse natural log.
"""

import numpy as np

DIM_CKV, DIM_QK = 512, 576
BLOCK_TOKEN_BYTES = 656  # 512 e4m3 codes | 4 float32 scales | 64 bf16 rope values
BLOCK_GROUP = 128  # latent values a block scale covers


def _e4m3_table():
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(exp == 15) & (man == 7)] = np.nan  # 0x7f, 0xff
    return val


E4M3 = _e4m3_table()  # float64 [256]: the exact value of every e4m3fn code


def decode_tokens(codes, ckv_scale, kpe_scale):
    """FP8 token bytes uint8 [..., 576] -> float64 [..., 576]: code value x the half's scale."""
    v = E4M3[np.asarray(codes, dtype=np.uint8)]
    v[..., :DIM_CKV] *= float(ckv_scale)
    v[..., DIM_CKV:] *= float(kpe_scale)
    return v


def decode_block_tokens(data):
    """656-byte block-scaled tokens (DeepSeek V3.2 / FlashMLA's FP8 sparse layout) uint8
    [..., 656] -> float64 [..., 576]: latent value i = code i x float32 scale i // 128 (the four
    little-endian float32 at bytes 512..527), the rope part the 64 little-endian bf16 at bytes
    528..655."""
    b = np.ascontiguousarray(np.asarray(data, dtype=np.uint8))
    if b.shape[-1] != BLOCK_TOKEN_BYTES:
        raise ValueError(f"expected [..., {BLOCK_TOKEN_BYTES}] bytes, got shape {b.shape}")
    out = np.empty(b.shape[:-1] + (DIM_QK,), dtype=np.float64)
    scales = b[..., DIM_CKV:DIM_CKV + 16].copy().view("<f4").astype(np.float64)  # [..., 4]
    out[..., :DIM_CKV] = E4M3[b[..., :DIM_CKV]] * np.repeat(scales, BLOCK_GROUP, axis=-1)
    out[..., DIM_CKV:] = bf16_to_f64(b[..., DIM_CKV + 16:].copy().view("<u2"))
    return out


def bf16_to_f64(bits):
    """bf16 bit patterns (uint16 or int16) -> float64."""
    b = np.asarray(bits)
    if b.dtype == np.int16:
        b = b.view(np.uint16)
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def attention(q, keys, sm_scale):
    """One query token: q float64 [H, 576], keys float64 [n, 576] -> (o [H, 512], lse [H]).
    No keys: o = 0, lse = -inf."""
    heads = q.shape[0]
    if keys.shape[0] == 0:
        return np.zeros((heads, DIM_CKV)), np.full(heads, -np.inf)
    s = float(sm_scale) * (q @ keys.T)  # [H, n]
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    denom = p.sum(axis=1, keepdims=True)
    o = (p @ keys[:, :DIM_CKV]) / denom
    return o, (m + np.log(denom))[:, 0]


def rel_l2(got, ref):
    """||got - ref|| / ||ref|| in float64 (inf when ref is all zeros and got is not; NaN in got
    gives NaN, which fails every bound)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    num = float(np.sum((got - ref) ** 2))
    den = float(np.sum(ref**2))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(np.sqrt(num / den))
