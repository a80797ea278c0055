"""fp8mla.BatchMLAPagedAttentionWrapper with FlashInfer's call sequence, on the CPU backend.

The SGLang test copies what python/sglang/srt/layers/attention/flashinfer_mla_backend.py does:
one wrapper, plan() once per batch (page_size 1, causal False for decode, the pool dtype as
both q_data_type and kv_data_type), then run() once per layer with q split into q_nope / q_pe
and the layer's k_buffer [tokens, 1, 576] passed as two strided views.
"""

import inspect
import math

import numpy as np
import pytest

import fp8mla
import mla_ref as ref


# run()'s scales for an fp8_e4m3 cache: FlashInfer requires both (unit: SGLang's pool).
UNIT = dict(ckv_scale=1.0, kpe_scale=1.0)


def scales(fmt):
    return UNIT if fmt == "fp8_e4m3" else {}


def flashinfer_plan(w, b, heads, causal, sm_scale, q_dtype, kv_dtype, **kw):
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, heads, 512, 64, b.page_size, causal,
           sm_scale, q_dtype, kv_dtype, **kw)


def test_sglang_decode_sequence_fp8_pool(rng):
    """One plan per batch, run per layer over that layer's 576-wide FP8 pool (uint8 bytes)."""
    heads, layers, pool_tokens = 16, 3, 900
    sm_scale = 0.13523
    w = fp8mla.BatchMLAPagedAttentionWrapper(np.empty(1 << 10, np.uint8), backend="auto")
    for step in range(2):  # two decode steps: the batch (and its lengths) change
        kv_lens = rng.integers(1, 120, size=int(rng.integers(2, 6)))
        # SGLang: page_size 1, kv_indptr = cumsum(seq_lens), kv_indices = req_to_token slots.
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
        kv_indices = rng.permutation(pool_tokens)[: kv_indptr[-1]].astype(np.int32)
        bs = len(kv_lens)
        q_indptr = np.arange(bs + 1, dtype=np.int32)
        w.plan(q_indptr, kv_indptr, kv_indices, kv_lens.astype(np.int32), heads, 512, 64, 1,
               False, sm_scale, "bfloat16", "float8_e4m3fn")
        for layer in range(layers):
            vals = ref.random_tokens(rng, (pool_tokens,), "fp8_e4m3")
            k_buffer = fp8mla.encode_tokens(vals, "fp8_e4m3")[:, None, :]  # [tokens, 1, 576]
            pool = ref.decode_tokens(k_buffer, "fp8_e4m3")  # [tokens, 1, 576] = [P, S=1, 576]
            q_bits, q = ref.random_q(rng, bs, heads)  # reshaped_q [bs, heads, 576]
            o = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], k_buffer[:, :, :512],
                      k_buffer[:, :, 512:], **UNIT)
            ro, _ = ref.attention(q, pool, q_indptr, kv_indptr, kv_indices, kv_lens, 1, False,
                                  np.float32(sm_scale))
            ref.check_attention(o, None, ro, None, f"step {step} layer {layer}")


def test_sglang_verify_sequence_bf16_pool(rng):
    """Target verify: causal multi-token plan (q dtype bf16, kv bf16), run per layer."""
    heads, pool_tokens, draft = 8, 400, 3
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    kv_lens = np.array([30, 7, 64], dtype=np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    kv_indices = rng.permutation(pool_tokens)[: kv_indptr[-1]].astype(np.int32)
    qo_indptr = np.arange(0, 3 * draft + 1, draft, dtype=np.int32)
    w.plan(qo_indptr, kv_indptr, kv_indices, kv_indptr[1:] - kv_indptr[:-1], heads, 512, 64, 1,
           True, 0.1, "bfloat16", "bfloat16")
    for _ in range(2):
        vals = ref.random_tokens(rng, (pool_tokens,), "bf16")
        k_buffer = ref.f32_to_bf16(vals)[:, None, :]  # bf16 bits [tokens, 1, 576]
        q_bits, q = ref.random_q(rng, 3 * draft, heads)
        out = ref.poison_bf16((3 * draft, heads, 512))
        o, lse = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], k_buffer[:, :, :512],
                       k_buffer[:, :, 512:], out=out, return_lse=True)
        assert o is out
        ro, rl = ref.attention(q, ref.bf16_to_f64(k_buffer), qo_indptr, kv_indptr, kv_indices,
                               kv_lens, 1, True, np.float32(0.1))
        ref.check_attention(o, lse, ro, rl * ref.LOG2E, "verify")


@pytest.mark.parametrize("fmt", ref.FORMATS)
@pytest.mark.parametrize("layout", ["two_buffers", "one_buffer", "head_dim_1"])
def test_cache_layouts(rng, fmt, layout):
    """FlashInfer's two buffers, SGLang's two views of one buffer, and [P, S, 1, D] views."""
    page_size, heads = 16, 4
    b = ref.Batch(rng, [70, 16, 1], [1, 1, 1], page_size)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, page_size)
    ckv, kpe = ref.cache_views(data, fmt)
    if layout == "two_buffers" and kpe is not None:
        ckv, kpe = ckv.copy(), kpe.copy()
    elif layout == "head_dim_1":
        ckv = ckv[:, :, None, :]
        kpe = kpe[:, :, None, :] if kpe is not None else None
    kv_dtype = "bfloat16" if fmt == "bf16" else "uint8"
    kw = {"kv_format": fmt} if fmt == "fp8_e4m3_block" else {}
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    flashinfer_plan(w, b, heads, False, 0.07, "bfloat16", kv_dtype, **kw)
    q_bits, q = ref.random_q(rng, b.total_q, heads)
    o = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, **scales(fmt))
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, page_size,
                          False, np.float32(0.07))
    ref.check_attention(o, None, ro, None, f"{fmt} {layout}")


def test_lse_base_2_and_base_e(rng):
    b = ref.Batch(rng, [50, 0, 9], [1, 1, 1], 4)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    q_bits, q = ref.random_q(rng, b.total_q, 2)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    flashinfer_plan(w, b, 2, False, 0.1, "bfloat16", "float8_e4m3fn")
    args = (q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:])
    o2, lse2 = w.run(*args, return_lse=True, **UNIT)
    oe, lsee = w.run(*args, return_lse=True, return_lse_base_on_e=True, **UNIT)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 4, False,
                           np.float32(0.1))
    ref.check_attention(oe, lsee, ro, rl, "base e")
    ref.check_attention(o2, lse2, ro, rl / math.log(2.0), "base 2")
    assert np.array_equal(o2, oe)
    assert np.all(np.isneginf(lse2[1])) and np.all(ref.bf16_to_f64(o2[1]) == 0.0)
    # A caller's lse buffer is filled (base 2) even without return_lse, as FlashInfer does.
    lse = ref.poison_f32((b.total_q, 2))
    w.run(*args, lse=lse, **UNIT)
    ref.assert_close(lse, rl / math.log(2.0), ref.LSE_RTOL, ref.LSE_ATOL, "lse buffer")


def test_k_scale(rng):
    scale = 0.0625
    b = ref.Batch(rng, [33, 64], [1, 1], 8)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 8, scale)
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    flashinfer_plan(w, b, 4, False, 0.1, "bfloat16", "float8_e4m3fn")
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 8, False,
                          np.float32(0.1))
    args = (q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:])
    ref.check_attention(w.run(*args, k_scale=scale), None, ro, None, "k_scale")
    ref.check_attention(w.run(*args, ckv_scale=scale, kpe_scale=scale), None, ro, None,
                        "ckv_scale/kpe_scale")
    ref.check_attention(w.run(*args, k_scale=1.0, ckv_scale=scale, kpe_scale=np.float32(scale)),
                        None, ro, None, "override")


def test_num_pages_learned_from_the_cache_and_given(rng):
    """FlashInfer's plan() has no pool size: the wrapper learns it from run()'s cache (or takes
    num_pages=); indices past the pool are caught either way."""
    b = ref.Batch(rng, [20, 20], [1, 1], 4, spare_pages=10)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    q_bits, q = ref.random_q(rng, b.total_q, 2)
    args = (q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:])
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 4, False,
                          np.float32(0.1))
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    flashinfer_plan(w, b, 2, False, 0.1, "bfloat16", "uint8")
    ref.check_attention(w.run(*args, **UNIT), None, ro, None, "learned")
    ref.check_attention(w.run(*args, **UNIT), None, ro, None, "learned, again")
    flashinfer_plan(w, b, 2, False, 0.1, "bfloat16", "uint8")  # now planned with the real size
    ref.check_attention(w.run(*args, **UNIT), None, ro, None, "replanned")
    bad = b.kv_indices.copy()
    bad[0] = b.num_pages
    with pytest.raises(ValueError, match="kv_indices"):
        w.plan(b.qo_indptr, b.kv_indptr, bad, b.kv_len, 2, 512, 64, 4, False, 0.1, "bfloat16",
               "uint8")
    w2 = fp8mla.BatchMLAPagedAttentionWrapper(None, num_pages=b.num_pages)
    flashinfer_plan(w2, b, 2, False, 0.1, "bfloat16", "uint8")
    ref.check_attention(w2.run(*args, **UNIT), None, ro, None, "num_pages given")
    assert w2.plan_info.batch == 2


def test_kv_indices_longer_than_used_and_device_style_buffers(rng):
    """SGLang passes whole preallocated index buffers: only kv_indptr[-1] entries count."""
    b = ref.Batch(rng, [5, 9], [1, 1], 1)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 1)
    long_indices = np.concatenate([b.kv_indices, np.full(100, 10**6, np.int32)])
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    w.plan(b.qo_indptr, b.kv_indptr, long_indices, b.kv_len, 2, 512, 64, 1, False, 0.1,
           "bfloat16", "float8_e4m3fn")
    q_bits, q = ref.random_q(rng, b.total_q, 2)
    o = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:], **UNIT)
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 1, False,
                          np.float32(0.1))
    ref.check_attention(o, None, ro, None, "long kv_indices")


def test_empty_batch():
    """SGLang's idle step plans a batch of 0 requests."""
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    z = np.zeros(1, np.int32)
    w.plan(z, z, np.zeros(0, np.int32), np.zeros(0, np.int32), 8, 512, 64, 1, False, 0.1,
           "bfloat16", "uint8")
    pool = np.zeros((4, 1, 576), np.uint8)
    q = np.zeros((0, 8, 576), np.uint16)
    o, lse = w.run(q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:],
                   return_lse=True, **UNIT)
    assert o.shape == (0, 8, 512) and lse.shape == (0, 8)
    o = w.run(q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:], **UNIT)
    assert o.shape == (0, 8, 512)


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_reference_backend_agrees(rng, fmt):
    b = ref.Batch(rng, [300, 45], [2, 1], 32)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, 32)
    ckv, kpe = ref.cache_views(data, fmt)
    q_bits, q = ref.random_q(rng, b.total_q, 16)
    kv_dtype = "bfloat16" if fmt == "bf16" else "uint8"
    kw = {"kv_format": fmt}
    outs = []
    for backend in ("cpu", "cpu_reference"):
        w = fp8mla.BatchMLAPagedAttentionWrapper(None, backend=backend)
        flashinfer_plan(w, b, 16, True, 0.05, "bfloat16", kv_dtype, **kw)
        outs.append(w.run(q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, return_lse=True,
                          **scales(fmt)))
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 32, True,
                           np.float32(0.05))
    for (o, lse), name in zip(outs, ("fast", "reference")):
        ref.check_attention(o, lse, ro, rl * ref.LOG2E, f"{fmt} {name}")


def test_ml_dtypes_arrays_if_available(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    b = ref.Batch(rng, [17], [1], 8)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 8)
    q_bits, q = ref.random_q(rng, 1, 2)
    qb = q_bits.view(ml_dtypes.bfloat16)
    d8 = data.view(ml_dtypes.float8_e4m3fn)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    flashinfer_plan(w, b, 2, False, 0.1, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn)
    o = w.run(qb[:, :, :512], qb[:, :, 512:], d8[:, :, :512], d8[:, :, 512:], **UNIT)
    assert o.dtype == ml_dtypes.bfloat16
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 8, False,
                          np.float32(0.1))
    ref.check_attention(o.view(np.uint16), None, ro, None, "ml_dtypes")


def test_failed_plan_keeps_the_last_plan(rng):
    b = ref.Batch(rng, [25, 8], [1, 1], 4)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    q_bits, q = ref.random_q(rng, b.total_q, 2)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, num_pages=b.num_pages)
    flashinfer_plan(w, b, 2, False, 0.1, "bfloat16", "uint8")
    bad = b.kv_len.copy()
    bad[1] = 10**6
    with pytest.raises(ValueError, match="kv_len"):
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, bad, 2, 512, 64, 4, False, 0.1,
               "bfloat16", "uint8")
    o = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:], **UNIT)
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 4, False,
                          np.float32(0.1))
    ref.check_attention(o, None, ro, None, "after a failed plan")


def test_exact_scores_changes_nothing_on_the_cpu(rng):
    """exact_scores picks a CUDA kernel for fp8_e4m3; the CPU backend computes exactly either
    way, so both wrappers (and fp8mla.plan with the option) give identical bits."""
    b = ref.Batch(rng, [300, 65], [1, 2], 64)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 64)
    ckv, kpe = ref.cache_views(data, "fp8_e4m3")
    q_bits, q = ref.random_q(rng, b.total_q, 8)
    outs = []
    for exact in (False, True):
        w = fp8mla.BatchMLAPagedAttentionWrapper(None, exact_scores=exact)
        flashinfer_plan(w, b, 8, True, 0.3, "bfloat16", "float8_e4m3fn")
        outs.append(w.run(q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe, return_lse=True,
                          **UNIT))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 64, True,
                           np.float32(0.3))
    ref.check_attention(outs[1][0], outs[1][1], ro, rl * ref.LOG2E, "exact_scores")
    p = fp8mla.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, num_heads=8, page_size=64,
                    num_pages=b.num_pages, sm_scale=0.3, exact_scores=True)
    assert p.batch == 2 and len(p.tiles) >= 2


def test_python_defaults_are_the_cpp_plan_options():
    """fp8mla.plan's keyword defaults and the wrapper's are fp8mla::PlanOptions' own (read from
    the extension), so the Python layer plans what the C++ planner is tuned and benchmarked
    with (a stale copy here once cost 1/8/4096 3.7 us on the H200)."""
    cpp = fp8mla._fp8mla.plan_defaults()
    assert set(cpp) == {"sm_count", "ctas_per_sm", "min_chunk_tokens", "num_threads",
                        "cpu_reference", "exact_scores", "max_tile_rows"}
    plan_params = inspect.signature(fp8mla.plan).parameters
    option_params = inspect.signature(fp8mla.api._plan_options).parameters  # the wrapper's
    for name, value in cpp.items():
        assert plan_params[name].default == value, f"fp8mla.plan {name}"
        assert option_params[name].default == value, f"_plan_options {name}"
    wrapper_params = inspect.signature(fp8mla.BatchMLAPagedAttentionWrapper).parameters
    for name in ("num_threads", "exact_scores", "max_tile_rows"):
        assert wrapper_params[name].default == cpp[name], f"wrapper {name}"
