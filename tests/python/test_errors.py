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
