"""Bad input raises ValueError whose message names the argument; other failures RuntimeError."""

import numpy as np
import pytest

import fp8mla
import mla_ref as ref

PAGE, HEADS, PAGES = 4, 2, 10


def good():
    """A valid decode batch: 2 requests of 5 and 8 tokens on pages [0, 1] and [2, 3]."""
    return dict(
        qo_indptr=np.array([0, 1, 2], np.int32),
        kv_indptr=np.array([0, 2, 4], np.int32),
        kv_indices=np.array([0, 1, 2, 3], np.int32),
        kv_len_arr=np.array([5, 8], np.int32),
        num_heads=HEADS, head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE, causal=False,
        sm_scale=0.1, q_data_type="bfloat16", kv_data_type="float8_e4m3fn",
    )


def planned(**kw):
    w = fp8mla.BatchMLAPagedAttentionWrapper(None, num_pages=PAGES)
    w.plan(**{**good(), **kw})
    return w


# A valid FlashInfer request fp8mla does not implement: NotImplementedError naming the argument.
UNSUPPORTED = NotImplementedError

# (plan() override, expected argument name in the message[, the exception when not ValueError])
PLAN_ERRORS = [
    (dict(head_dim_ckv=128), "head_dim_ckv", UNSUPPORTED),
    (dict(head_dim_kpe=32), "head_dim_kpe", UNSUPPORTED),
    (dict(head_dim_kpe=0), "head_dim_kpe", UNSUPPORTED),  # NoPE
    (dict(head_dim_ckv=-1), "head_dim_ckv"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=129), "num_heads"),
    (dict(page_size=3), "page_size"),
    (dict(page_size=256), "page_size"),
    (dict(sm_scale=0.0), "sm_scale"),
    (dict(sm_scale=float("nan")), "sm_scale"),
    (dict(q_data_type="float32"), "q_data_type"),
    (dict(q_data_type="float8_e4m3fn"), "q_data_type", UNSUPPORTED),
    (dict(kv_data_type="float16"), "kv_data_type", UNSUPPORTED),
    (dict(kv_data_type="float32"), "kv_data_type"),
    (dict(kv_data_type="bfloat16", kv_format="fp8_e4m3_block"), "kv_format"),
    (dict(use_profiler=True), "use_profiler", UNSUPPORTED),
    (dict(qo_indptr=np.array([0, 2, 1], np.int32)), "qo_indptr"),
    (dict(qo_indptr=np.array([1, 2, 3], np.int32)), "qo_indptr"),
    (dict(kv_indptr=np.array([0, 3, 2], np.int32)), "kv_indptr"),
    (dict(kv_indptr=np.array([0, 2, 6], np.int32)), "kv_indices"),  # fewer indices than listed
    (dict(kv_indices=np.array([0, 1, 2, PAGES], np.int32)), "kv_indices"),
    (dict(kv_indices=np.array([0, -1, 2, 3], np.int32)), "kv_indices"),
    (dict(kv_len_arr=np.array([5, 9], np.int32)), r"kv_len_arr\[1\]"),  # > 2 pages * 4
    (dict(kv_len_arr=np.array([-1, 8], np.int32)), r"kv_len_arr\[0\]"),
    # batch = len(kv_len_arr), as FlashInfer reads it: qo_indptr needs batch + 1 entries.
    (dict(kv_len_arr=np.array([5, 8, 3], np.int32)), "qo_indptr"),
    (dict(qo_indptr=np.array([0, 6, 7], np.int32), causal=True), "kv_len_arr"),  # qo > kv
    (dict(kv_indices=np.array([0, 1, 2, 2**40])), "kv_indices"),  # does not fit int32
    (dict(kv_indices=np.array([0.0, 1.0, 2.0, 3.0])), "kv_indices"),  # not integers
    (dict(qo_indptr=np.zeros((2, 2), np.int32)), "qo_indptr"),
]


@pytest.mark.parametrize("case", PLAN_ERRORS, ids=lambda c: c[1])
def test_plan_errors_name_the_argument(case):
    override, name, exc = (case + (ValueError,))[:3]
    with pytest.raises(exc, match=name):
        planned(**override)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        fp8mla.BatchMLAPagedAttentionWrapper(None, backend="nope")
    with pytest.raises(NotImplementedError, match="backend"):  # a FlashInfer kernel family
        fp8mla.BatchMLAPagedAttentionWrapper(None, backend="cutlass")


def run_args(total_q=2, heads=HEADS):
    q = np.zeros((total_q, heads, 576), np.uint16)
    pool = np.zeros((PAGES, PAGE, 576), np.uint8)
    return dict(q_nope=q[:, :, :512], q_pe=q[:, :, 512:], ckv_cache=pool[:, :, :512],
                kpe_cache=pool[:, :, 512:], ckv_scale=1.0, kpe_scale=1.0)


# (run() override, expected name)
RUN_ERRORS = [
    (dict(q_nope=np.zeros((2, HEADS, 512), np.float32)), "q_nope"),
    (dict(q_nope=np.zeros((3, HEADS, 512), np.uint16)), "q_nope"),  # total_q differs
    (dict(q_nope=np.zeros((2, HEADS + 1, 512), np.uint16)), "q_nope"),  # heads differ
    (dict(q_pe=np.zeros((2, HEADS, 32), np.uint16)), "q_pe"),
    (dict(q_nope=np.zeros((2, HEADS, 1024), np.uint16)[:, :, ::2]), "q_nope"),  # inner stride 2
    (dict(out=np.zeros((2, HEADS, 256), np.uint16)), "out"),
    (dict(out=np.zeros((2, HEADS, 512), np.float32)), "out"),
    (dict(lse=np.zeros((2, HEADS + 1), np.float32)), "lse"),
    (dict(ckv_cache=np.zeros((PAGES, PAGE, 512), np.float32)), "ckv_cache"),
    (dict(ckv_cache=np.zeros((PAGES, PAGE * 2, 512), np.uint8)), "ckv_cache"),  # page size
    (dict(kpe_cache=np.zeros((PAGES, PAGE, 63), np.uint8)), "kpe_cache"),
    (dict(kpe_cache=None), "kpe_cache"),
    (dict(ckv_scale=0.0), "ckv_scale"),
    (dict(kpe_scale=float("inf")), "kpe_scale"),
    (dict(ckv_scale=None), "ckv_scale"),  # an FP8 cache needs its scales, as in FlashInfer
    (dict(kpe_scale=None), "kpe_scale"),
    (dict(ckv_scale=None, ckv_scale_arr=np.ones(4, np.float32)), "ckv_scale_arr", UNSUPPORTED),
    (dict(ckv_scale_arr=np.ones(4, np.float32)), "Exactly one of ckv_scale or ckv_scale_arr"),
    (dict(profiler_buffer=np.zeros(4, np.uint8)), "profiler_buffer"),
    (dict(kv_len=np.array([5, 8], np.int32)), "kv_len"),  # FlashInfer's cutlass inputs
    (dict(page_table=np.zeros((2, 2), np.int32)), "page_table"),
    (dict(o_scale=1.0), "o_scale"),
    (dict(sinks=np.zeros(HEADS, np.float32)), "sinks"),
    (dict(bmm1_scale=1.0, bmm2_scale=1.0), "bmm1_scale"),
    (dict(skip_softmax_threshold_scale_factor=1.0), "skip_softmax_threshold_scale_factor"),
]


@pytest.mark.parametrize("case", RUN_ERRORS, ids=lambda c: c[1])
def test_run_errors_name_the_tensor(case):
    override, name, exc = (case + (ValueError,))[:3]
    w = planned()
    with pytest.raises(exc, match=name):
        w.run(**{**run_args(), **override})


def test_run_before_plan():
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(**run_args())


def test_scale_for_non_fp8_cache():
    w = planned(kv_data_type="bfloat16")
    pool = np.zeros((PAGES, PAGE, 576), np.uint16)
    a = run_args()
    for scale in ("ckv_scale", "kpe_scale", "k_scale"):
        with pytest.raises(ValueError, match="scale"):
            w.run(a["q_nope"], a["q_pe"], pool[:, :, :512], pool[:, :, 512:], **{scale: 0.5})


def test_not_an_array():
    w = planned()
    a = run_args()
    with pytest.raises(TypeError, match="q_nope"):
        w.run("q", a["q_pe"], a["ckv_cache"], a["kpe_cache"], ckv_scale=1.0, kpe_scale=1.0)


def test_low_level_errors():
    g = good()
    kw = dict(num_heads=HEADS, page_size=PAGE, num_pages=PAGES, sm_scale=0.1)
    with pytest.raises(ValueError, match="num_pages"):
        fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"],
                    **{**kw, "num_pages": 0})
    with pytest.raises(ValueError, match="sparse_indices"):
        fp8mla.plan(g["qo_indptr"], None, None, None, **kw, topk=4,
                    sparse_indices=np.zeros((2, 3), np.int32))
    with pytest.raises(ValueError, match="sparse_indices"):
        fp8mla.plan(g["qo_indptr"], None, None, None, **kw, topk=2,
                    sparse_indices=np.array([[0, PAGES * PAGE], [1, 2]], np.int32))
    with pytest.raises(ValueError, match="device"):
        fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"], **kw,
                    device="tpu")
    p = fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"], **kw)
    with pytest.raises(ValueError, match="replan|graph"):  # not a graph-mode plan
        fp8mla.replan(p, g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"], **kw)
    a = run_args()
    with pytest.raises(ValueError, match="sparse_indices"):  # dense plan
        fp8mla.run(p, a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"],
                   sparse_indices=np.zeros((2, 4), np.int32))
    with pytest.raises(ValueError, match="device"):
        fp8mla.PagedLatentCache(4, 4, device="cuda:x")


@pytest.mark.skipif(fp8mla.cuda_available(), reason="CUDA is available here")
def test_cuda_plan_without_cuda_fails_clearly():
    # A build without CUDA: RuntimeError (unsupported). A CUDA build on a machine without a
    # device: ValueError (device_id is not a visible device). Either way the message says why.
    g = good()
    with pytest.raises((RuntimeError, ValueError), match="CUDA|cuda|device"):
        fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"],
                    num_heads=HEADS, page_size=PAGE, num_pages=PAGES, sm_scale=0.1,
                    device="cuda")
    with pytest.raises((RuntimeError, ValueError), match="CUDA|cuda|device"):
        fp8mla.PagedLatentCache(4, 4, device="cuda")


def test_errors_are_not_value_errors_for_runtime_failures():
    cache = fp8mla.PagedLatentCache(4, 2)
    cache.allocate(4)
    with pytest.raises(RuntimeError) as e:  # out of memory: a RuntimeError, not a ValueError
        cache.allocate(1)
    assert not isinstance(e.value, ValueError)
    assert ref is not None


# ---- hostile input (issue 35): types, integers, bounds, error classes ----

KW = dict(num_heads=HEADS, page_size=PAGE, num_pages=PAGES, sm_scale=0.1)


def low_level_plan(**kw):
    g = good()
    return fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], g["kv_len_arr"],
                       **{**KW, **kw})


# (plan() keyword, value, exception, argument named). Before: num_heads=2.9 planned 2 heads,
# 2**40 raised "std::bad_cast", causal="False" planned causal attention.
PLAN_TYPE_ERRORS = [
    ("num_heads", 2.9, TypeError, "num_heads"),
    ("num_heads", "8", TypeError, "num_heads"),
    ("num_heads", True, TypeError, "num_heads"),
    ("num_heads", 2**40, ValueError, "num_heads"),
    ("page_size", 4.0, TypeError, "page_size"),
    ("num_pages", 10.5, TypeError, "num_pages"),
    ("num_pages", 2**70, ValueError, "num_pages"),
    ("sm_scale", "0.1", TypeError, "sm_scale"),
    ("sm_scale", None, TypeError, "sm_scale"),
    ("causal", "False", TypeError, "causal"),
    ("causal", 2, ValueError, "causal"),
    ("topk", 1.5, TypeError, "topk"),
    ("kv_format", 3, TypeError, "kv_format"),
    ("num_threads", 2.0, TypeError, "num_threads"),
    ("sm_count", 2**31, ValueError, "sm_count"),
    ("cuda_graph", "yes", TypeError, "cuda_graph"),
    ("max_kv_indices", 2**64, ValueError, "max_kv_indices"),
]


@pytest.mark.parametrize("key,value,exc,name", PLAN_TYPE_ERRORS)
def test_plan_argument_types(key, value, exc, name):
    with pytest.raises(exc, match=name):
        low_level_plan(**{key: value})


def test_integer_arguments_accept_numpy_integers():
    p = low_level_plan(num_heads=np.int64(HEADS), page_size=np.int32(PAGE),
                       num_pages=np.uint16(PAGES), sm_scale=np.float32(0.1), causal=np.bool_(0))
    assert p.num_heads == HEADS


def test_index_arrays_must_be_arrays():
    g = good()
    with pytest.raises(TypeError, match="kv_len"):
        fp8mla.plan(g["qo_indptr"], g["kv_indptr"], g["kv_indices"], 5, **KW)
    with pytest.raises(TypeError, match="qo_indptr"):
        fp8mla.plan("0, 1, 2", g["kv_indptr"], g["kv_indices"], g["kv_len_arr"], **KW)


# The bounds of include/fp8mla/limits.h reach Python as ValueError naming the argument.
# Before: qo_indptr = [0, 2**31 - 1] asked for 4 GiB of tiles; sm_scale = 3.4e38 planned and
# every output was NaN; num_threads = 100000 raised RuntimeError (std::system_error) in run().
PLAN_BOUNDS = [
    (dict(sm_scale=3.4e38), "sm_scale"),
    (dict(num_threads=100000), "num_threads"),
    (dict(sm_count=10**6), "sm_count"),
    (dict(sm_count=4096, ctas_per_sm=2), "sm_count x options.ctas_per_sm"),
]


@pytest.mark.parametrize("override,name", PLAN_BOUNDS)
def test_plan_bounds(override, name):
    with pytest.raises(ValueError, match=name):
        low_level_plan(**override)


def test_plan_rows_bound():
    g = good()
    qo = np.array([0, 2**31 - 1, 2**31 - 1], np.int32)
    with pytest.raises(ValueError, match=r"qo_indptr\[2\].*4194304"):
        fp8mla.plan(qo, g["kv_indptr"], g["kv_indices"], g["kv_len_arr"], **KW, causal=False)


def test_merge_states_argument_types_and_bounds():
    # Before: merge_states(None) raised AttributeError, a 2-D v IndexError, and 2**32 states (a
    # stride-0 view) were truncated to int: 0 / -inf instead of the merge.
    with pytest.raises(TypeError, match="v"):
        fp8mla.merge_states(None, np.zeros((1, 1), np.float32))
    with pytest.raises(TypeError, match="s"):
        fp8mla.merge_states(np.zeros((1, 1, 4), np.float32), [0.0])
    with pytest.raises(ValueError, match="v.ndim"):
        fp8mla.merge_states(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))
    one = np.zeros(1, np.float32)
    v = np.lib.stride_tricks.as_strided(one, (1, 2**32, 1), (0, 0, 4))
    s = np.lib.stride_tricks.as_strided(one, (1, 2**32), (0, 0))
    with pytest.raises(ValueError, match=r"v.shape\[1\].*4096"):
        fp8mla.merge_states(v, s)


def test_out_of_memory_is_a_memory_error():
    cache = fp8mla.PagedLatentCache(4, 2)
    cache.allocate(4)
    with pytest.raises(MemoryError, match="free") as e:
        cache.allocate(1)
    assert isinstance(e.value, RuntimeError)  # as before: code that catches RuntimeError holds
    assert isinstance(e.value, fp8mla.api.OutOfMemoryError)
    assert not isinstance(e.value, ValueError)


def test_cache_argument_types():
    with pytest.raises(TypeError, match="num_pages"):
        fp8mla.PagedLatentCache(4.7, 2)
    with pytest.raises(TypeError, match="scale"):
        fp8mla.PagedLatentCache(4, 2, scale="1")
    cache = fp8mla.PagedLatentCache(4, 2)
    with pytest.raises(TypeError, match="n"):
        cache.allocate(1.0)
    with pytest.raises(TypeError, match="nan"):
        cache.append(np.zeros(0, np.int32), np.zeros((0, 512), np.float32),
                     np.zeros((0, 64), np.float32), nan=None)
    with pytest.raises(ValueError, match="nan"):
        cache.append(np.zeros(0, np.int32), np.zeros((0, 512), np.float32),
                     np.zeros((0, 64), np.float32), nan="ignore")


def test_run_scales_and_stream_types():
    p = low_level_plan()
    a = run_args()
    with pytest.raises(TypeError, match="ckv_scale"):
        fp8mla.run(p, a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], ckv_scale="2")
    with pytest.raises(TypeError, match="stream"):
        fp8mla.run(p, a["q_nope"], a["q_pe"], a["ckv_cache"], a["kpe_cache"], stream=1.5)


def test_run_of_no_query_tokens_checks_its_tensors():
    # Before: a plan of no query tokens ran nothing and checked nothing, so run() returned the
    # (5, 7, 512) output it allocated, uninitialised, for q of 5 tokens x 7 heads.
    p = fp8mla.plan([0, 0], [0, 1], [0], [4], num_heads=7, page_size=PAGE, num_pages=PAGES,
                    sm_scale=0.1)
    q = np.zeros((5, 7, 576), np.uint16)
    pool = np.zeros((PAGES, PAGE, 576), np.uint8)
    with pytest.raises(ValueError, match=r"q_nope.shape\[0\].*expected 0.*got 5"):
        fp8mla.run(p, q[:, :, :512], q[:, :, 512:], pool[:, :, :512], pool[:, :, 512:])
    out = fp8mla.run(p, q[:0, :, :512], q[:0, :, 512:], pool[:, :, :512], pool[:, :, 512:])
    assert out.shape == (0, 7, 512)


def test_codecs_keep_zero_dimensional_shapes():
    # Before: every codec returned shape (1,) for a 0-d input.
    x = np.float32(1.5)
    code = fp8mla.fp8_e4m3_encode(x)
    assert code.shape == () and int(code) == 0x3C
    assert fp8mla.fp8_e4m3_decode(code).shape == ()
    assert float(fp8mla.fp8_e4m3_decode(code)) == 1.5
    bits = fp8mla.bf16_encode(np.float32(-2.0))
    assert bits.shape == () and int(bits) == 0xC000
    assert fp8mla.bf16_decode(bits).shape == () and float(fp8mla.bf16_decode(bits)) == -2.0
    with pytest.raises(TypeError):
        fp8mla.fp8_e4m3_encode("1.5")


def test_wrapper_pool_size_is_not_sticky_after_a_failed_run():
    # Before: a run() whose cache was too small for the batch failed, but its page count stayed
    # the pool size, so the next plan() of a valid batch failed until a run with the right cache.
    w = fp8mla.BatchMLAPagedAttentionWrapper(None)
    w.plan(**good())  # pages 0..3: planned for a pool of 4 pages
    small = np.zeros((2, PAGE, 576), np.uint8)  # pages 2 and 3 are missing
    a = run_args()
    with pytest.raises(ValueError, match="kv_indices"):
        w.run(a["q_nope"], a["q_pe"], small[:, :, :512], small[:, :, 512:], ckv_scale=1.0,
              kpe_scale=1.0)
    w.plan(**good())  # plans again
    out = w.run(**a)  # the right cache (10 pages) runs
    assert out.shape == (2, HEADS, 512)


def test_module_names_an_argument_that_is_not_an_array_or_not_writable():
    # The binding's own check (python/fp8mla/_ext_args.h, Args): a TypeError naming the argument
    # and what it is, for an input and for an output; the output is left as it was.
    from fp8mla import _fp8mla
    with pytest.raises(TypeError, match=r"^x: expected an array or tensor with DLPack support "
                                        r"\(numpy, torch, cupy\), got str$"):
        _fp8mla.fp8_e4m3_decode("abc", None)
    ro = np.full(4, 7.0, np.float32)
    ro.setflags(write=False)
    with pytest.raises(TypeError, match=r"^out: expected a writable array or tensor with DLPack "
                                        r"support \(numpy, torch, cupy\), got ndarray$"):
        _fp8mla.fp8_e4m3_decode(np.zeros(4, np.uint8), ro)
    assert (ro == 7.0).all()
    out = np.full(4, 7.0, np.float32)
    _fp8mla.fp8_e4m3_decode(np.array([0x38, 0x00, 0xB8, 0x40], np.uint8), out)
    assert out.tolist() == [1.0, 0.0, -1.0, 2.0]
