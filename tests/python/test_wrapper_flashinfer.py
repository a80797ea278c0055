"""fp8mla.BatchMLAPagedAttentionWrapper against FlashInfer's semantics (flashinfer-python 0.6.18
and 0.7.4), on the CPU backend, each against the float64 reference (mla_ref):

  * the three answers that were silently wrong: graph mode reads the kv_indices buffer given to
    the constructor (an in-place rewrite before the run is seen), run(kv_len=, page_table=) is
    refused, an FP8 cache without ckv_scale / kpe_scale is refused;
  * index arrays read as FlashInfer reads them (batch = len(kv_len_arr); longer qo_indptr /
    kv_indptr buffers; an all-empty batch over an empty pool);
  * 0.7's call forms (metadata=, query= / kv_cache=, lse_mode and the run contract) and 0.6's,
    fp16 queries and outputs, FlashInfer's attribute names, messages naming Python arguments;
  * FlashInfer 0.6.18's documented example, unchanged but for the import (and the device).
"""

import math
import warnings

import numpy as np
import pytest

import fp8mla
import fp8mla.mla
import mla_ref as ref

UNIT = dict(ckv_scale=1.0, kpe_scale=1.0)


def plan_flat(w, b, heads=4, causal=False, sm_scale=0.1, q="bfloat16", kv="float8_e4m3fn", **kw):
    w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, heads, 512, 64, b.page_size, causal,
           sm_scale, q, kv, **kw)


def packed(data, fmt):
    """The pool as one [P, S, 576] array of its element type (bf16 bits as uint16)."""
    return data.view(np.uint16) if fmt == "bf16" else data


def reference(b, q, pool, causal=False, sm_scale=0.1):
    return ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, b.page_size,
                         causal, np.float32(sm_scale))


# ---- the three silent wrong answers ----

@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_graph_mode_reads_the_constructor_kv_indices_buffer_at_run_time(rng, framework):
    """FlashInfer's graph-mode kernels read the kv_indices buffer given to the constructor: a
    caller that rewrites it in place between plan() and the run (as engines do before a CUDA
    graph replay) gets the new pages. The pool here holds every page twice; after the ids are
    moved to the second copies the first ones are overwritten with NaN, so a run that still read
    the planned ids would return NaN."""
    b = ref.Batch(rng, [37, 5, 60], [1, 1, 1], 4)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    doubled = np.concatenate([data, data])
    buffers = dict(qo_indptr=np.zeros(4, np.int32), kv_indptr=np.zeros(4, np.int32),
                   kv_indices=np.zeros(64, np.int32), kv_len_arr=np.zeros(3, np.int32))
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    qn, qp = q_bits[:, :, :512], q_bits[:, :, 512:]
    cache = doubled
    if framework == "torch":
        torch = pytest.importorskip("torch")
        buffers = {k: torch.from_numpy(v) for k, v in buffers.items()}
        qt = torch.from_numpy(q_bits.view(np.int16)).view(torch.bfloat16)
        qn, qp = qt[:, :, :512], qt[:, :, 512:]
        cache = torch.from_numpy(doubled).view(torch.float8_e4m3fn)

    def bits(o):
        return o if framework == "numpy" else o.view(torch.int16).numpy().view(np.uint16)

    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, **buffers)
    plan_flat(w, b, num_pages=2 * b.num_pages)
    ro, _ = reference(b, q, pool)
    first = w.run(qn, qp, cache[:, :, :512], cache[:, :, 512:], **UNIT)
    ref.check_attention(bits(first), None, ro, None, "planned pages")
    # The engine moves the pages and rewrites the ids in the buffer, in place.
    moved = (b.kv_indices + b.num_pages).astype(np.int32)
    if framework == "numpy":
        buffers["kv_indices"][: len(moved)] = moved
        doubled[: b.num_pages] = 0xff  # e4m3 NaN in every byte of the first copies
    else:
        buffers["kv_indices"][: len(moved)] = torch.from_numpy(moved)
        cache.view(torch.uint8)[: b.num_pages] = 0xff
    second = w.run(qn, qp, cache[:, :, :512], cache[:, :, 512:], **UNIT)
    ref.check_attention(bits(second), None, ro, None, "ids rewritten in the constructor buffer")


def test_graph_mode_plan_copies_into_the_constructor_buffers(rng):
    """plan() fills the reserved buffers (FlashInfer copies into them at plan time)."""
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    bufs = dict(qo_indptr=np.full(3, -7, np.int32), kv_indptr=np.full(3, -7, np.int32),
                kv_indices=np.full(32, -7, np.int32), kv_len_arr=np.full(2, -7, np.int32))
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, **bufs)
    plan_flat(w, b)
    assert np.array_equal(bufs["qo_indptr"], b.qo_indptr)
    assert np.array_equal(bufs["kv_indptr"], b.kv_indptr)
    assert np.array_equal(bufs["kv_indices"][: len(b.kv_indices)], b.kv_indices)
    assert np.array_equal(bufs["kv_len_arr"], b.kv_len)
    assert w._kv_indices_buf is bufs["kv_indices"] and w._use_cuda_graph


def test_graph_mode_id_outside_the_pool_written_after_plan_is_an_error(rng):
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    kvi = np.zeros(32, np.int32)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, kv_indices=kvi)
    plan_flat(w, b, num_pages=b.num_pages)
    kvi[1] = b.num_pages + 3
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    with pytest.raises(ValueError, match=r"kv_indices\[1\]"):
        w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:], **UNIT)


@pytest.mark.parametrize("name", ["kv_len", "page_table"])
def test_run_refuses_kv_len_and_page_table(rng, name):
    """FlashInfer's fa2 / fa3 refuse them (they are its cutlass backend's live inputs): fp8mla
    used to ignore them silently and compute the planned lengths and pages."""
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    plan_flat(w, b)
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    value = b.kv_len if name == "kv_len" else np.zeros((2, 5), np.int32)
    with pytest.raises(ValueError, match=name):
        w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:],
              **{name: value}, **UNIT)


@pytest.mark.parametrize("missing", ["both", "ckv_scale", "kpe_scale"])
def test_fp8_cache_needs_its_scales(rng, missing):
    """FlashInfer requires ckv_scale (or ckv_scale_arr) and kpe_scale for an FP8 cache; fp8mla
    used to take a missing scale as 1.0."""
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4, 0.25)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    plan_flat(w, b)
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    scales = {} if missing == "both" else {k: 0.25 for k in UNIT if k != missing}
    with pytest.raises(ValueError, match="ckv_scale" if missing != "kpe_scale" else "kpe_scale"):
        w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:],
              **scales)


# ---- index arrays as FlashInfer reads them ----

def test_indptr_buffers_longer_than_the_batch(rng):
    """batch = len(kv_len_arr): only the first batch + 1 entries of qo_indptr and kv_indptr are
    read (engines pass over-allocated graph buffers; the tail holds stale values)."""
    b = ref.Batch(rng, [30, 7, 64], [2, 1, 3], 8)
    data, pool = ref.make_pool(rng, "bf16", b.num_pages, 8)
    data = packed(data, "bf16")
    junk = np.array([10**6, -5, 3], np.int32)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    w.plan(np.concatenate([b.qo_indptr, junk]), np.concatenate([b.kv_indptr, junk]),
           np.concatenate([b.kv_indices, junk]), b.kv_len, 4, 512, 64, 8, True, 0.1,
           "bfloat16", "bfloat16")
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    o = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:])
    ro, _ = reference(b, q, pool, causal=True)
    ref.check_attention(o, None, ro, None, "long indptr buffers")


def test_all_empty_batch_over_an_empty_pool():
    """Every request has kv_len 0 and no pages; the pool has no pages (FlashInfer's tests build
    that for kv_len = 0): out is 0 and the LSE -inf."""
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    w.plan(np.array([0, 2, 3], np.int32), np.zeros(3, np.int32), np.zeros(0, np.int32),
           np.zeros(2, np.int32), 4, 512, 64, 16, False, 0.1, "bfloat16", "bfloat16")
    pool = np.zeros((0, 16, 576), np.uint16)
    q = np.ones((3, 4, 576), np.uint16)
    out = ref.poison_bf16((3, 4, 512))
    o, lse = w.run(q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:], out=out,
                   return_lse=True)
    assert o is out and np.all(o == 0) and np.all(np.isneginf(lse))


# ---- FlashInfer 0.7 forms ----

def metadata_wrapper(rng, fmt="bf16", page_size=8, **plan_kw):
    b = ref.Batch(rng, [40, 5, 17], [1, 2, 1], page_size, spare_pages=0)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, page_size)
    data = packed(data, fmt)
    w = fp8mla.mla.BatchMLAPagedAttentionWrapper(None)
    md = fp8mla.mla.MLAPlanMetadata.csr(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len)
    w.plan(metadata=md, num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=page_size,
           causal=False, sm_scale=0.1, q_data_type="bfloat16",
           kv_data_type="bfloat16" if fmt == "bf16" else "float8_e4m3fn", **plan_kw)
    return w, b, data, pool


def test_metadata_form_with_packed_and_split_inputs(rng):
    w, b, data, pool = metadata_wrapper(rng, lse_mode="base2")
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    ro, rl = reference(b, q, pool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the 0.7 form is not deprecated
        o, lse = w.run(query=q_bits, kv_cache=data, return_lse=True)
        ref.check_attention(o, lse, ro, rl * ref.LOG2E, "packed query and cache")
        # Adjacent views of one buffer are the packed value (zero copy, as FlashInfer takes).
        o2, _ = w.run(query=(q_bits[..., :512], q_bits[..., 512:]),
                      kv_cache=(data[..., :512], data[..., 512:]), return_lse=True)
    assert np.array_equal(o, o2)
    # Independent buffers under a packed plan: FlashInfer refuses them (no zero-copy packing).
    with pytest.raises(ValueError, match="query_layout"):
        w.run(query=(q_bits[..., :512].copy(), q_bits[..., 512:].copy()), kv_cache=data,
              return_lse=True)


def test_lse_contract(rng):
    """0.7: run() must ask for the LSE plan() declared; flat CSR plans keep 0.6's run-time
    choice (with a DeprecationWarning)."""
    w, b, data, pool = metadata_wrapper(rng)  # lse_mode "none"
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    with pytest.raises(ValueError, match="lse_mode"):
        w.run(query=q_bits, kv_cache=data, return_lse=True)
    o = w.run(query=q_bits, kv_cache=data)
    ro, rl = reference(b, q, pool)
    ref.check_attention(o, None, ro, None, "no lse")
    we, *_ = metadata_wrapper(rng, lse_mode="basee")
    with pytest.raises(ValueError, match="lse_mode"):
        we.run(query=q_bits, kv_cache=data, return_lse=True)  # base 2 asked
    flat = fp8mla.BatchMLAPagedAttentionWrapper(None)
    plan_flat(flat, b, kv="bfloat16")
    with pytest.warns(DeprecationWarning):
        flat.run(q_bits[..., :512], q_bits[..., 512:], data[..., :512], data[..., 512:],
                 return_lse=True)


def test_metadata_is_checked_strictly(rng):
    """metadata= is checked as FlashInfer 0.7 checks it: one batch size, and kv_indptr listing
    exactly ceil(kv_len / page_size) pages a request."""
    b = ref.Batch(rng, [40, 17], [1, 1], 8, spare_pages=0)
    w = fp8mla.mla.BatchMLAPagedAttentionWrapper(None)
    kw = dict(num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=8, causal=False,
              sm_scale=0.1, q_data_type="bfloat16", kv_data_type="bfloat16")
    longer = np.concatenate([b.qo_indptr, [9]]).astype(np.int32)
    with pytest.raises(ValueError, match="qo_indptr"):
        w.plan(metadata=fp8mla.MLAPlanMetadata.csr(longer, b.kv_indptr, b.kv_indices, b.kv_len),
               **kw)
    short = b.kv_len.copy()
    short[0] -= 8  # one page fewer than listed
    with pytest.raises(ValueError, match="page counts"):
        w.plan(metadata=fp8mla.MLAPlanMetadata.csr(b.qo_indptr, b.kv_indptr, b.kv_indices,
                                                   short), **kw)
    with pytest.raises(ValueError, match="metadata"):
        w.plan(b.qo_indptr, metadata=fp8mla.MLAPlanMetadata.csr(
            b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len), **kw)


def test_dense_metadata(rng):
    """MLAPlanMetadata.dense (block tables) and flat dense arrays plan the same batch as CSR."""
    b = ref.Batch(rng, [40, 3, 17], [1, 1, 2], 8, spare_pages=0)
    data, pool = ref.make_pool(rng, "bf16", b.num_pages, 8)
    data = packed(data, "bf16")
    width = max(b.kv_indptr[1:] - b.kv_indptr[:-1]) + 2
    table = np.full((3, width), 10**6, np.int32)  # entries past a request's pages are not read
    for r in range(3):
        pages = b.kv_indices[b.kv_indptr[r]:b.kv_indptr[r + 1]]
        table[r, : len(pages)] = pages
    kw = dict(num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=8, causal=True,
              sm_scale=0.1, q_data_type="bfloat16", kv_data_type="bfloat16")
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    ro, _ = reference(b, q, pool, causal=True)
    for how in ("metadata", "flat"):
        w = fp8mla.mla.BatchMLAPagedAttentionWrapper(None)
        if how == "metadata":
            w.plan(metadata=fp8mla.MLAPlanMetadata.dense(b.qo_indptr, table, b.kv_len, 2), **kw)
        else:
            w.plan(cum_seq_lens_q=b.qo_indptr, block_tables=table, seq_lens=b.kv_len, **kw)
        o = w.run(query=q_bits, kv_cache=data) if how == "metadata" else w.run(
            query=(q_bits[..., :512], q_bits[..., 512:]), kv_cache=(data[..., :512],
                                                                    data[..., 512:]))
        ref.check_attention(o, None, ro, None, f"dense {how}")


def test_deprecated_forms_warn_and_work(rng):
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    with pytest.warns(DeprecationWarning, match="Positional"):
        plan_flat(w, b)
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    with pytest.warns(DeprecationWarning):
        o = w.run(q_nope=q_bits[..., :512], q_pe=q_bits[..., 512:], ckv_cache=data[..., :512],
                  kpe_cache=data[..., 512:], **UNIT)
    ro, _ = reference(b, q, pool)
    ref.check_attention(o, None, ro, None, "0.6 form")


@pytest.mark.parametrize("kw,name,exc", [
    (dict(output_scale="per-tensor"), "output_scale", NotImplementedError),
    (dict(scale_mode="bmm-scalar"), "scale_mode", NotImplementedError),
    (dict(skip_softmax=True), "skip_softmax", NotImplementedError),
    (dict(use_sinks=True), "use_sinks", NotImplementedError),
    (dict(enable_pdl=False), "enable_pdl", NotImplementedError),
    (dict(use_profiler=True), "use_profiler", NotImplementedError),
    (dict(lse_mode="base10"), "lse_mode", ValueError),
    (dict(query_layout="interleaved"), "query_layout", ValueError),
    (dict(output_dtype="float16"), "output_dtype", ValueError),
])
def test_plan_options_refused_by_name(rng, kw, name, exc):
    with pytest.raises(exc, match=name):
        metadata_wrapper(rng, **kw)


def test_plan_options_honoured(rng):
    w, b, data, pool = metadata_wrapper(rng, "fp8_e4m3", enable_pdl=True,
                                        scale_mode="kv-per-tensor", output_dtype="bfloat16")
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    ro, _ = reference(b, q, pool)
    ref.check_attention(w.run(query=q_bits, kv_cache=data, **UNIT), None, ro, None, "options")


# ---- fp16, attributes, names ----

@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_fp16_queries_and_outputs_on_the_cpu(rng, fmt):
    b = ref.Batch(rng, [50, 0, 9], [2, 1, 1], 4)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, 4)
    data = packed(data, fmt)
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    # fp16 holds these bf16 values exactly except the smallest (below fp16's normal range,
    # 2^-14, it keeps fewer bits): the reference takes the fp16 values the wrapper was given.
    q16 = ref.bf16_to_f64(q_bits).astype(np.float16)
    q = q16.astype(np.float64)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    plan_flat(w, b, causal=True, q="float16", kv="bfloat16" if fmt == "bf16" else "float8_e4m3fn")
    o, lse = w.run(q16[..., :512], q16[..., 512:], data[..., :512], data[..., 512:],
                   return_lse=True, **({} if fmt == "bf16" else UNIT))
    assert o.dtype == np.float16
    ro, rl = reference(b, q, pool, causal=True)
    err = np.abs(o.astype(np.float64) - ro)
    assert np.all(err <= 2e-3 * np.abs(ro) + 1e-4), float(err.max())
    ref.assert_close(lse, rl * ref.LOG2E, ref.LSE_RTOL, ref.LSE_ATOL, "fp16 lse")


def test_attributes_engines_read(rng):
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    w = fp8mla.BatchMLAPagedAttentionWrapper(np.empty(16, np.uint8), backend="fa3")
    assert w._backend == "fa3" and w._use_cuda_graph is False and w.device == "cpu"
    assert w._float_workspace_buffer is not None
    plan_flat(w, b, causal=False, sm_scale=0.125)
    assert (w._sm_scale, w._causal, w._page_size, w._head_dim_ckv) == (0.125, False, 4, 512)
    assert w._q_data_type == "bfloat16" and w._kv_data_type == "float8_e4m3fn"
    assert w._use_profiler is False and w._plan_info is not None
    assert np.array_equal(w._kv_indices_buf, b.kv_indices)


def test_messages_name_the_python_arguments(rng):
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, num_pages=b.num_pages)
    plan_flat(w, b)
    q_bits, _ = ref.random_q(rng, b.total_q, 4)
    short = np.zeros((b.num_pages, 8, 576), np.uint8)
    for tensor, name in ((short[..., :512], "ckv_cache"), (short[..., 512:], "kpe_cache")):
        args = [q_bits[..., :512], q_bits[..., 512:], data[..., :512], data[..., 512:]]
        args[2 if name == "ckv_cache" else 3] = tensor
        with pytest.raises(ValueError) as e:
            w.run(*args, **UNIT)
        assert name in str(e.value) and "kv.ckv" not in str(e.value) and \
            "kv.kpe" not in str(e.value), str(e.value)
    bad = b.kv_len.copy()
    bad[1] = 10**6
    with pytest.raises(ValueError, match=r"kv_len_arr\[1\]"):
        w.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, bad, 4, 512, 64, 4, False, 0.1,
               "bfloat16", "float8_e4m3fn")


def test_mla_module_mirrors_flashinfer_mla():
    assert fp8mla.mla.BatchMLAPagedAttentionWrapper is fp8mla.BatchMLAPagedAttentionWrapper
    assert fp8mla.mla.MLAPlanMetadata is fp8mla.MLAPlanMetadata
    from fp8mla.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata  # noqa: F401
    with pytest.raises(AttributeError, match="trtllm_batch_decode_with_kv_cache_mla"):
        fp8mla.mla.trtllm_batch_decode_with_kv_cache_mla  # noqa: B018


@pytest.mark.parametrize("backend,exc", [("cutlass", NotImplementedError),
                                         ("trtllm-gen", NotImplementedError),
                                         ("bogus", ValueError)])
def test_backend_names(backend, exc):
    with pytest.raises(exc, match="backend"):
        fp8mla.BatchMLAPagedAttentionWrapper(None, backend=backend)


# ---- FlashInfer 0.6.18's documented example ----

def test_flashinfer_0_6_18_docstring_example():
    """BatchMLAPagedAttentionWrapper's example in flashinfer/mla/_core.py (0.6.18), unchanged but
    for the import and the device (.to(0) / "cuda" -> the CPU; tests/python/test_gpu.py runs it
    on a GPU as written). FlashInfer's example passes no lengths check beyond the shape."""
    torch = pytest.importorskip("torch")
    device = "cpu"
    num_local_heads = 128
    batch_size = 114
    head_dim_ckv = 512
    head_dim_kpe = 64
    page_size = 1
    mla_wrapper = fp8mla.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.int8).to(device),
        backend="fa2"
    )
    q_indptr = torch.arange(0, batch_size + 1).to(device).int()
    kv_lens = torch.full((batch_size,), 999, dtype=torch.int32).to(device)
    kv_indptr = torch.arange(0, batch_size + 1).to(device).int() * 999
    kv_indices = torch.arange(0, batch_size * 999).to(device).int()
    q_nope = torch.randn(
        batch_size * 1, num_local_heads, head_dim_ckv, dtype=torch.bfloat16, device=device
    )
    q_pe = torch.zeros(
        batch_size * 1, num_local_heads, head_dim_kpe, dtype=torch.bfloat16, device=device
    )
    ckv = torch.randn(
        batch_size * 999, 1, head_dim_ckv, dtype=torch.bfloat16, device=device
    )
    kpe = torch.zeros(
        batch_size * 999, 1, head_dim_kpe, dtype=torch.bfloat16, device=device
    )
    sm_scale = 1.0 / ((128 + 64) ** 0.5)
    mla_wrapper.plan(
        q_indptr,
        kv_indptr,
        kv_indices,
        kv_lens,
        num_local_heads,
        head_dim_ckv,
        head_dim_kpe,
        page_size,
        False,  # causal
        sm_scale,
        q_nope.dtype,
        ckv.dtype,
    )
    o = mla_wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=False)
    assert o.shape == torch.Size([114, 128, 512])
    # Against the float64 reference for a few requests.
    for r in (0, 57, 113):
        k = ckv[r * 999:(r + 1) * 999, 0].double()
        s = (q_nope[r].double() @ k.T) * sm_scale
        want = torch.softmax(s, dim=-1) @ k
        got = o[r].double()
        assert torch.linalg.norm(got - want) <= 1e-2 * torch.linalg.norm(want), r
    assert math.isfinite(float(o.float().abs().sum()))


# ---- replan_step (fp8mla's per-step re-plan for engines) ----

def test_replan_step_plans_new_lengths_over_the_constructor_buffer(rng):
    """A graph-mode wrapper planned once, then re-planned each step with new lengths by
    replan_step() while the page ids are rewritten in the constructor's kv_indices buffer (as
    fp8mla's SGLang backend does): every step matches the reference of its batch, and the
    constructor's other buffers are filled as plan() fills them."""
    num_pages = 40
    data, pool = ref.make_pool(rng, "fp8_e4m3", num_pages, 4)
    bufs = dict(qo_indptr=np.zeros(4, np.int32), kv_indptr=np.zeros(4, np.int32),
                kv_indices=np.zeros(36, np.int32), kv_len_arr=np.zeros(3, np.int32))
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, num_pages=num_pages,
                                             **bufs)
    with pytest.raises(RuntimeError, match="replan_step"):
        w.replan_step([0, 1], [0, 1], [1])
    for step, lens in enumerate([[37, 5, 60], [3, 44, 1], [12, 12, 40]]):
        b = ref.Batch(rng, lens, [1, 1, 1], 4, num_pages=num_pages)
        bufs["kv_indices"][: len(b.kv_indices)] = b.kv_indices
        if step == 0:
            plan_flat(w, b, heads=4)
        else:
            w.replan_step(np.asarray(b.qo_indptr, np.int32), np.asarray(b.kv_indptr, np.int32),
                          np.asarray(b.kv_len, np.int32))
        assert np.array_equal(bufs["kv_len_arr"], b.kv_len)
        assert np.array_equal(bufs["kv_indptr"], b.kv_indptr)
        q_bits, q = ref.random_q(rng, b.total_q, 4)
        out = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:],
                    **UNIT)
        ro, _ = reference(b, q, pool)
        ref.check_attention(out, None, ro, None, f"step {step}")


def test_replan_step_after_run_replanned_for_a_larger_pool(rng):
    """run() over a larger pool than the plan's re-plans for that pool; the next replan_step()
    plans for it too (the fields a step reuses are taken again after any re-plan), so page ids
    past the first pool are read, not refused as outside it."""
    small, large = 20, 40
    data, pool = ref.make_pool(rng, "fp8_e4m3", large, 4)
    kvi = np.zeros(40, np.int32)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, kv_indices=kvi,
                                             max_batch=2)
    for step, (lens, pages) in enumerate([([20, 7], small), ([11, 5], small), ([30, 9], large)]):
        b = ref.Batch(rng, lens, [1, 1], 4, num_pages=pages)
        kvi[: len(b.kv_indices)] = b.kv_indices
        if step == 0:
            plan_flat(w, b)
        else:
            w.replan_step(np.asarray(b.qo_indptr, np.int32), np.asarray(b.kv_indptr, np.int32),
                          np.asarray(b.kv_len, np.int32))
        if step == 2:
            assert b.kv_indices.max() >= small  # the case: pages the first pool did not have
        q_bits, q = ref.random_q(rng, b.total_q, 4)
        # Steps 0 and 1 run on the first pool's pages; step 1's run then on the whole pool
        # re-plans for it before step 2's replan_step.
        for view in ([data[:small]] if step == 0 else [data[:small], data] if step == 1
                     else [data]):
            out = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], view[:, :, :512],
                        view[:, :, 512:], **UNIT)
            ro, _ = reference(b, q, pool)
            ref.check_attention(out, None, ro, None, f"step {step}, {len(view)} pages")


def test_replan_step_checks_its_arrays_and_keeps_the_last_plan(rng):
    """Bad arrays raise ValueError naming the argument, and the last plan stays usable."""
    b = ref.Batch(rng, [9, 20], [1, 1], 4)
    kvi = np.zeros(16, np.int32)
    kvi[: len(b.kv_indices)] = b.kv_indices
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, kv_indices=kvi,
                                             num_pages=b.num_pages)
    plan_flat(w, b)
    qo, kvp, kvl = (np.asarray(a, np.int32) for a in (b.qo_indptr, b.kv_indptr, b.kv_len))
    with pytest.raises(ValueError, match="^kv_indptr"):
        w.replan_step(qo, kvp[:-1], kvl)
    too_long = kvl.copy()
    too_long[1] = 4 * (kvp[2] - kvp[1]) + 1  # more tokens than the request's pages hold
    with pytest.raises(ValueError, match="kv_len"):
        w.replan_step(qo, kvp, too_long)
    with pytest.raises(TypeError, match="qo_indptr"):
        w.replan_step("0, 1", kvp, kvl)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 4)
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    out = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:], **UNIT)
    ro, _ = reference(b, q, pool)
    ref.check_attention(out, None, ro, None, "the plan before the failed replan_step calls")


def test_replan_step_takes_the_last_plan_arguments_after_an_empty_batch(rng):
    """plan() with new arguments (sm_scale) but an empty batch builds nothing; the next
    replan_step() must plan with those arguments, not with the last build's."""
    num_pages = 30
    data, pool = ref.make_pool(rng, "fp8_e4m3", num_pages, 4)
    kvi = np.zeros(32, np.int32)
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, use_cuda_graph=True, kv_indices=kvi,
                                             num_pages=num_pages, max_batch=3)
    b = ref.Batch(rng, [20, 7], [1, 1], 4, num_pages=num_pages)
    kvi[: len(b.kv_indices)] = b.kv_indices
    plan_flat(w, b, sm_scale=0.1)
    empty = np.zeros(1, np.int32)
    w.plan(empty, empty, kvi, np.zeros(0, np.int32), 4, 512, 64, 4, False, 0.3, "bfloat16",
           "float8_e4m3fn")
    w.replan_step(np.asarray(b.qo_indptr, np.int32), np.asarray(b.kv_indptr, np.int32),
                  np.asarray(b.kv_len, np.int32))
    q_bits, q = ref.random_q(rng, b.total_q, 4)
    out = w.run(q_bits[:, :, :512], q_bits[:, :, 512:], data[:, :, :512], data[:, :, 512:], **UNIT)
    ro, _ = reference(b, q, pool, sm_scale=0.3)
    ref.check_attention(out, None, ro, None, "sm_scale of the last plan()")
