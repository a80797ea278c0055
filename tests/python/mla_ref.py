"""numpy float64 references for the fp8mla Python tests, written from the definitions
(DESIGN.md, include/fp8mla/format.h), independent of the library's own codecs.

Also the test-data builders: random pools in every format, ragged paged batches, and the
comparison helpers (values and inf/NaN positions).
"""

import math

import numpy as np

DIM_CKV, DIM_KPE, DIM_QK = 512, 64, 576
FORMATS = ("bf16", "fp8_e4m3", "fp8_e4m3_block")
TOKEN_BYTES = {"bf16": 1152, "fp8_e4m3": 576, "fp8_e4m3_block": 656}
LOG2E = 1.0 / math.log(2.0)


# ---- scalar codecs from the definitions ----


def _e4m3_table():
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val = sign * val
    val[(exp == 15) & (man == 7)] = np.nan  # 0x7f, 0xff
    return val


E4M3 = _e4m3_table()  # float64 [256]: exact value of every e4m3fn code
_POS = E4M3[:127]  # codes 0x00..0x7e: 0 .. 448, increasing


def e4m3_decode(codes):
    """uint8 codes -> float64 values."""
    return E4M3[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x):
    """float -> e4m3fn code: round to nearest, ties to even code; saturate to +-448; NaN ->
    0x7f | sign; -0.0 -> 0x80."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 448.0)
    hi = np.clip(np.searchsorted(_POS, a, side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    dlo = np.abs(a - _POS[lo])
    dhi = np.abs(_POS[hi] - a)
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    code = np.where(np.isnan(x), (0x7F | np.where(np.signbit(x), 0x80, 0)), code)
    return code.astype(np.uint8)


def bf16_to_f64(bits):
    """bf16 bits (uint16) -> float64."""
    bits = np.asarray(bits).view(np.uint16) if np.asarray(bits).dtype != np.uint16 else bits
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def f32_to_bf16(x):
    """float32 -> bf16 bits, round to nearest even; NaN -> quiet NaN with the sign."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = ((u >> 16) & 0x8000).astype(np.uint16) | np.uint16(0x7FC0)
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


def bf16_round(x):
    """float -> float64 value of its bf16 rounding."""
    return bf16_to_f64(f32_to_bf16(np.asarray(x, dtype=np.float32)))


# ---- token formats ----


def decode_tokens(data, fmt, scale=1.0):
    """Token bytes uint8 [..., token_bytes] -> float64 [..., 576] from the layouts."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if fmt == "bf16":
        return bf16_to_f64(data.view(np.uint16))
    if fmt == "fp8_e4m3":
        return (e4m3_decode(data).astype(np.float32) * np.float32(scale)).astype(np.float64)
    assert fmt == "fp8_e4m3_block"
    codes = e4m3_decode(data[..., :512]).reshape(data.shape[:-1] + (4, 128))
    scales = data[..., 512:528].copy().view("<f4").astype(np.float64)
    ckv = (codes * scales[..., None]).reshape(data.shape[:-1] + (512,))
    kpe = bf16_to_f64(data[..., 528:656].copy().view("<u2"))
    return np.concatenate([ckv, kpe], axis=-1)


def encode_block_token(values):
    """DeepSeek's writer for the 656-byte format, from its definition: per 128 values
    scale = 2^ceil(log2(max(amax / 448, 1e-4))), codes = RNE(x / scale); rope bf16 RNE."""
    v = np.asarray(values, dtype=np.float32).reshape(-1, DIM_QK)
    out = np.zeros((v.shape[0], 656), dtype=np.uint8)
    for t in range(v.shape[0]):
        for g in range(4):
            x = v[t, g * 128:(g + 1) * 128]
            amax = float(np.max(np.abs(x)))
            s = np.float32(2.0 ** math.ceil(math.log2(max(amax / 448.0, 1e-4))))
            out[t, g * 128:(g + 1) * 128] = e4m3_encode(x / s)
            out[t, 512 + 4 * g:512 + 4 * g + 4] = np.frombuffer(
                np.array([s], dtype="<f4").tobytes(), dtype=np.uint8
            )
        out[t, 528:656] = f32_to_bf16(v[t, 512:]).astype("<u2").view(np.uint8)
    return out.reshape(np.asarray(values).shape[:-1] + (656,))


# ---- attention from the definition ----


def attention(q, pool, qo_indptr, kv_indptr, kv_indices, kv_len, page_size, causal, sm_scale,
              sparse_indices=None):
    """Reference MLA attention in float64.

    q: float64 [total_q, H, 576]; pool: float64 [num_pages, page_size, 576] (decoded cache).
    Dense: request r's token j lives at page kv_indices[kv_indptr[r] + j // page_size], offset
    j % page_size; causal query token i of a request with qo_len tokens sees j <=
    kv_len - qo_len + i. Sparse: query token t sees the slots sparse_indices[t] != -1.
    Returns (o [total_q, H, 512], lse [total_q, H] natural log); rows seeing nothing give
    o = 0 and lse = -inf.
    """
    total_q, heads, _ = q.shape
    o = np.zeros((total_q, heads, DIM_CKV))
    lse = np.full((total_q, heads), -np.inf)
    flat = pool.reshape(-1, DIM_QK)

    def attend(t, keys):
        if keys.shape[0] == 0:
            return
        s = sm_scale * (q[t] @ keys.T)  # [H, n]
        m = s.max(axis=1, keepdims=True)
        p = np.exp(s - m)
        denom = p.sum(axis=1, keepdims=True)
        o[t] = (p @ keys[:, :DIM_CKV]) / denom
        lse[t] = (m + np.log(denom))[:, 0]

    if sparse_indices is not None:
        for t in range(total_q):
            idx = np.asarray(sparse_indices[t])
            attend(t, flat[idx[idx >= 0]])
        return o, lse
    batch = len(qo_indptr) - 1
    for r in range(batch):
        pages = np.asarray(kv_indices[kv_indptr[r]:kv_indptr[r + 1]])
        L = int(kv_len[r])
        toks = pool[pages].reshape(-1, DIM_QK)[:L]
        qo_len = int(qo_indptr[r + 1] - qo_indptr[r])
        for i in range(qo_len):
            visible = L - qo_len + i + 1 if causal else L
            attend(int(qo_indptr[r]) + i, toks[: max(visible, 0)])
    return o, lse


# ---- test data ----


def random_tokens(rng, shape, fmt, scale=1.0):
    """float32 tokens [..., 576] spread like real latents (fp8_e4m3: around +-scale * 8)."""
    x = rng.standard_normal(tuple(shape) + (DIM_QK,)).astype(np.float32)
    if fmt == "fp8_e4m3":
        x *= np.float32(scale * 4.0)
    return x


class Batch:
    """A ragged paged batch: request r has kv_len[r] tokens on random pages of the pool."""

    def __init__(self, rng, kv_lens, qo_lens, page_size, num_pages=None, spare_pages=3):
        self.page_size = page_size
        need = [max(1, -(-L // page_size)) if L > 0 else int(rng.integers(0, 2)) for L in kv_lens]
        self.num_pages = num_pages or sum(need) + spare_pages
        perm = rng.permutation(self.num_pages)
        self.kv_indptr = np.concatenate([[0], np.cumsum(need)]).astype(np.int32)
        self.kv_indices = perm[: self.kv_indptr[-1]].astype(np.int32)
        self.kv_len = np.asarray(kv_lens, dtype=np.int32)
        self.qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
        self.total_q = int(self.qo_indptr[-1])
        self.batch = len(kv_lens)


def make_pool(rng, fmt, num_pages, page_size, scale=1.0):
    """(bytes uint8 [P, S, token_bytes], decoded float64 [P, S, 576]) of random tokens encoded
    with the library's encoder (the decoded values come from this module's decoder)."""
    import fp8mla

    vals = random_tokens(rng, (num_pages, page_size), fmt, scale)
    data = fp8mla.encode_tokens(vals, fmt, scale)
    return data, decode_tokens(data, fmt, scale)


def cache_views(data, fmt):
    """(ckv, kpe) numpy views of a pool's bytes as run() takes them."""
    if fmt == "fp8_e4m3_block":
        return data, None
    if fmt == "bf16":
        words = data.view(np.uint16)
        return words[:, :, :DIM_CKV], words[:, :, DIM_CKV:]
    return data[:, :, :DIM_CKV], data[:, :, DIM_CKV:]


def random_q(rng, total_q, heads):
    """(bf16 bits [total_q, H, 576], their float64 values)."""
    bits = f32_to_bf16(rng.standard_normal((total_q, heads, DIM_QK)).astype(np.float32))
    return bits, bf16_to_f64(bits)


def poison_bf16(shape):
    """bf16 NaN bits everywhere: anything the kernel forgets to write stays NaN."""
    return np.full(shape, 0x7FC1, dtype=np.uint16)


def poison_f32(shape):
    return np.full(shape, np.nan, dtype=np.float32)


def assert_close(got, ref, rtol, atol, what):
    """Values within rtol/atol and the same inf/NaN positions (and signs)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(ref)), f"{what}: NaN positions differ"
    inf = np.isinf(ref)
    assert np.array_equal(np.isinf(got), inf), f"{what}: inf positions differ"
    assert np.array_equal(got[inf], ref[inf]), f"{what}: inf signs differ"
    fin = np.isfinite(ref)
    err = np.abs(got[fin] - ref[fin])
    bound = atol + rtol * np.abs(ref[fin])
    if err.size:
        worst = int(np.argmax(err - bound))
        assert np.all(err <= bound), (
            f"{what}: max error {err.max():.3g} (worst {got[fin][worst]:.6g} vs "
            f"{ref[fin][worst]:.6g}, bound {bound[worst]:.3g})"
        )


# bf16 output: half an ulp is at most 2^-8 relative; fp32 accumulation adds little on these sizes.
OUT_RTOL, OUT_ATOL = 8e-3, 2e-3
LSE_RTOL, LSE_ATOL = 2e-5, 2e-4
# The CUDA kernels multiply P (and merge partial states) in bf16 on tensor cores, as FlashInfer
# and FlashMLA do: the output error scales with the largest |V| (measured on an H200: up to
# 2.3e-3 * max|V|; FlashInfer's own FP8 test allows 1.5e-2 on values of order 1). These suites
# test the integration; the kernels' own accuracy is judged by tests/cuda.
GPU_OUT_RTOL, GPU_OUT_ATOL_PER_V = 2e-2, 6e-3
GPU_LSE_RTOL, GPU_LSE_ATOL = 1e-4, 4e-3
# fp8_e4m3 scores on fp8 tensor cores (<= 16 rows, pages >= 8, exact_scores off): Hopper's fp8
# accumulator keeps 13 mantissa bits, so the lse carries ~2e-4 of its magnitude (measured
# 1.9-2.2e-4, and 1.9e-4 at lse ~195 in test_exact_scores_option); tests/cuda bounds it at 6e-4.
# A small lse (a short row that one token dominates) carries that token's score error instead,
# set by the size of the score's partial sums: fp8_score_lse_atol.
GPU_FP8_SCORES_LSE_RTOL = 6e-4


def tolerances(device, pool, fp8_scores=None):
    """(out_rtol, out_atol, lse_rtol, lse_atol) for results computed on ``device`` ("cpu" or
    "cuda", or a torch.device) over the decoded cache ``pool`` [..., 576]. fp8_scores: (q,
    sm_scale) for an fp8_e4m3 cache, whose default GPU score path (<= 16 rows, pages >= 8) may
    move a row's lse by fp8_score_lse_atol more (log2 units; for a base-e lse, a looser bound)."""
    if str(device).startswith("cuda"):
        vmax = float(np.max(np.abs(pool[..., :DIM_CKV]))) if pool is not None else 1.0
        lse_atol = GPU_LSE_ATOL
        if fp8_scores is not None:
            lse_atol += fp8_score_lse_atol(fp8_scores[0], pool, fp8_scores[1])
        return GPU_OUT_RTOL, GPU_OUT_ATOL_PER_V * max(vmax, 1.0), GPU_LSE_RTOL, lse_atol
    return OUT_RTOL, OUT_ATOL, LSE_RTOL, LSE_ATOL


def fp8_score_lse_atol(q, pool, sm_scale):
    """Extra lse tolerance (log2 units) for the GPU's default fp8_e4m3 score path (tiles of <= 16
    rows on pages of >= 8 tokens). Hopper's fp8 MMA keeps 13 mantissa bits of its accumulator and
    truncates the rest at each step (README, Numerics), so a score carries an error of order 2^-13
    of what its partial sums can reach, |q| |k| (Cauchy-Schwarz), however small the score itself.
    A row that one token dominates (a short row) carries that token's score error into its lse
    whole: measured 4.2e-3 (log2) at sm_scale 0.1, |q| ~24, |k| ~100, where this gives ~0.05."""
    qn = float(np.linalg.norm(q, axis=-1).max())
    kn = float(np.linalg.norm(np.asarray(pool).reshape(-1, DIM_QK), axis=-1).max())
    return LOG2E * float(sm_scale) * 2.0**-13 * qn * kn


def check_attention(out_bits, lse, ref_o, ref_lse, what, device="cpu", pool=None, lse_rtol=None,
                    fp8_scores=None):
    """Output (bf16 bits) and LSE against the reference, with ``device``'s tolerances (lse_rtol:
    a looser relative lse bound for a path documented as less precise; fp8_scores: as for
    tolerances)."""
    out_rtol, out_atol, dev_lse_rtol, lse_atol = tolerances(device, pool, fp8_scores)
    lse_rtol = dev_lse_rtol if lse_rtol is None else lse_rtol
    assert_close(bf16_to_f64(out_bits), ref_o, out_rtol, out_atol, f"{what} out")
    if lse is not None:
        assert_close(lse, ref_lse, lse_rtol, lse_atol, f"{what} lse")
