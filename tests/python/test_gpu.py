"""GPU tests: torch CUDA tensors on the CUDA backend. Skipped unless torch is installed, a CUDA
device is visible to torch, and this fp8mla build has the CUDA backend (fp8mla.cuda_available()).

The same comparisons as the CPU suite (float64 reference, poisoned outputs, all formats), plus
GPU against the CPU backend on identical inputs, the custom op (opcheck), torch.compile, and a
CUDA-graph capture / re-plan / replay test.
"""

import numpy as np
import pytest

import fp8mla

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)
if not fp8mla.cuda_available():
    pytest.skip("this fp8mla build has no CUDA backend (or sees no device)",
                allow_module_level=True)

import mla_ref as ref  # noqa: E402
import torch_cases as cases  # noqa: E402

DEVICE = "cuda"

# (format, page_size, heads, kv_lens, qo_lens, causal)
GRID = [
    ("fp8_e4m3", 1, 16, [1, 37, 500, 4096], [1, 1, 1, 1], False),
    ("fp8_e4m3", 64, 8, [5000, 64, 1], [1, 1, 1], False),
    ("fp8_e4m3", 16, 128, [700, 33], [1, 1], False),
    ("fp8_e4m3", 32, 64, [300, 200, 2], [4, 2, 1], True),
    ("bf16", 1, 16, [900, 2], [1, 1], False),
    ("bf16", 64, 128, [1000], [2], True),
    ("fp8_e4m3_block", 64, 64, [2048, 100], [1, 1], False),
    ("fp8_e4m3_block", 128, 8, [333, 7], [3, 1], True),
    ("fp8_e4m3", 8, 16, [0, 40, 0], [1, 1, 2], True),  # empty requests: o = 0, lse = -inf
]


@pytest.mark.parametrize("fmt,page_size,heads,kv_lens,qo_lens,causal", GRID)
def test_wrapper_matches_reference(rng, fmt, page_size, heads, kv_lens, qo_lens, causal):
    cases.case_wrapper_formats(rng, DEVICE, fmt, page_size, heads, kv_lens, qo_lens, causal)


@pytest.mark.parametrize("fmt", ref.FORMATS)
def test_gpu_matches_cpu_backend(rng, fmt):
    """Identical inputs through the CUDA backend (torch) and the CPU backend (numpy)."""
    b = ref.Batch(rng, [1500, 260, 3], [1, 2, 1], 16)
    data, pool = ref.make_pool(rng, fmt, b.num_pages, 16)
    q_bits, q = ref.random_q(rng, b.total_q, 32)
    kw = {"kv_format": fmt}
    kv_dtype = "bfloat16" if fmt == "bf16" else "uint8"
    w_cpu = fp8mla.BatchMLAPagedAttentionWrapper(None)
    w_cpu.plan(b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 32, 512, 64, 16, True, 0.07,
               "bfloat16", kv_dtype, **kw)
    ckv, kpe = ref.cache_views(data, fmt)
    o_cpu, lse_cpu = w_cpu.run(q_bits[:, :, :512], q_bits[:, :, 512:], ckv, kpe,
                               return_lse=True, **cases.scales(fmt))
    w_gpu = cases.make_wrapper(DEVICE)
    cases.plan_batch(w_gpu, b, 32, True, 0.07, fmt, DEVICE)
    tckv, tkpe = cases.torch_cache(data, fmt, DEVICE)
    qt = cases.bf16(q_bits, DEVICE)
    o_gpu, lse_gpu = w_gpu.run(qt[:, :, :512], qt[:, :, 512:], tckv, tkpe, return_lse=True,
                               **cases.scales(fmt))
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 16, True,
                           np.float32(0.07))
    ref.check_attention(cases.bits(o_gpu), lse_gpu.cpu().numpy(), ro, rl * ref.LOG2E, "gpu",
                        DEVICE, pool)
    ref.check_attention(o_cpu, lse_cpu, ro, rl * ref.LOG2E, "cpu")
    out_rtol, out_atol, _, _ = ref.tolerances(DEVICE, pool)
    ref.assert_close(ref.bf16_to_f64(cases.bits(o_gpu)), ref.bf16_to_f64(o_cpu), out_rtol,
                     out_atol, "gpu vs cpu")


def test_sglang_sequence(rng):
    cases.case_sglang_sequence(rng, DEVICE, layers=4)


def test_custom_op_opcheck(rng):
    cases.case_opcheck(rng, DEVICE)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(rng, backend):
    cases.case_compile(rng, DEVICE, backend)


def test_low_level_and_merge(rng):
    cases.case_low_level(rng, DEVICE)


def test_cuda_cache(rng):
    cases.case_cache(rng, DEVICE)


def test_runs_on_the_current_stream(rng):
    """run() on a side stream: results are ready once that stream is synchronised."""
    b = ref.Batch(rng, [3000, 100], [1, 1], 64)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 64)
    ckv, kpe = cases.torch_cache(data, "fp8_e4m3", DEVICE)
    q_bits, q = ref.random_q(rng, b.total_q, 16)
    qt = cases.bf16(q_bits, DEVICE)
    w = cases.make_wrapper(DEVICE, num_pages=b.num_pages)
    cases.plan_batch(w, b, 16, False, 0.1, "fp8_e4m3", DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = cases.nan_bf16((b.total_q, 16, 512), DEVICE)
        w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, out=out, **cases.scales("fp8_e4m3"))
    side.synchronize()
    ro, _ = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 64, False,
                          np.float32(0.1))
    ref.check_attention(cases.bits(out), None, ro, None, "side stream", DEVICE, pool)


@pytest.mark.parametrize("fmt,page_size,qo_len", [("fp8_e4m3", 1, 1), ("fp8_e4m3", 64, 2),
                                                  ("fp8_e4m3_block", 64, 1), ("bf16", 16, 1)])
def test_cuda_graph_capture_replan_replay(rng, fmt, page_size, qo_len):
    """FlashInfer's graph mode as SGLang uses it: fixed buffers, plan outside capture, capture
    run() once, then re-plan with new lengths (same batch size) and replay."""
    bs, heads, max_ctx = 6, 16, 1200
    max_pages = bs * (-(-max_ctx // page_size))
    num_pages = max_pages + 8
    data, pool = ref.make_pool(rng, fmt, num_pages, page_size)
    ckv, kpe = cases.torch_cache(data, fmt, DEVICE)
    qo_buf = torch.arange(0, (bs + 1) * qo_len, qo_len, dtype=torch.int32, device=DEVICE)
    kv_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE)
    kv_indices_buf = torch.zeros(max_pages, dtype=torch.int32, device=DEVICE)
    kv_len_buf = torch.ones(bs, dtype=torch.int32, device=DEVICE)
    w = cases.make_wrapper(DEVICE, use_cuda_graph=True, qo_indptr=qo_buf,
                           kv_indptr=kv_indptr_buf, kv_indices=kv_indices_buf,
                           kv_len_arr=kv_len_buf, max_total_q=bs * qo_len)

    def new_batch(lo, hi):
        lens = rng.integers(max(lo, qo_len), hi, size=bs)
        return ref.Batch(rng, lens, [qo_len] * bs, page_size, num_pages=num_pages)

    total_q = bs * qo_len
    q_static = torch.empty(total_q, heads, 576, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(total_q, heads, 512, dtype=torch.bfloat16, device=DEVICE)
    lse = torch.empty(total_q, heads, dtype=torch.float32, device=DEVICE)

    def run():
        w.run(q_static[:, :, :512], q_static[:, :, 512:], ckv, kpe, out=out, lse=lse,
              return_lse=True, **cases.scales(fmt))

    def check(b, q, what):
        ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len,
                               page_size, True, np.float32(0.0625))
        ref.check_attention(cases.bits(out), lse.cpu().numpy(), ro, rl * ref.LOG2E, what,
                            DEVICE, pool)

    b1 = new_batch(1, 300)
    cases.plan_batch(w, b1, heads, True, 0.0625, fmt, DEVICE)
    q_bits, q = ref.random_q(rng, total_q, heads)
    q_static.copy_(cases.bf16(q_bits, DEVICE))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, as SGLang does
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    check(b1, q, "eager warm-up")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(b1, q, "replay 1")

    for step, (lo, hi) in enumerate([(200, max_ctx), (1, 20), (1, max_ctx)]):
        b2 = new_batch(lo, hi)
        cases.plan_batch(w, b2, heads, True, 0.0625, fmt, DEVICE)  # outside capture
        q_bits, q = ref.random_q(rng, total_q, heads)
        q_static.copy_(cases.bf16(q_bits, DEVICE))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(b2, q, f"replay after re-plan {step}")

    # A batch beyond the graph-mode capacities is refused at plan(), not silently truncated.
    with pytest.raises(ValueError):
        big = ref.Batch(rng, [10] * (bs + 1), [qo_len] * (bs + 1), page_size,
                        num_pages=num_pages)
        cases.plan_batch(w, big, heads, True, 0.0625, fmt, DEVICE)


@pytest.mark.parametrize("exact", [False, True])
def test_exact_scores_option(rng, exact):
    """fp8_e4m3 on pages of 64 with large scores (sm_scale 0.4; lse 30-200 in log2 units, by
    seed): the default path computes the scores on fp8 tensor cores (13-bit accumulator) and
    meets the GPU output tolerance and its documented lse accuracy (~2e-4 relative, bounded at
    6e-4 as in tests/cuda); exact_scores=True keeps them off (fp16 products, fp32 sums) and its
    lse meets the CPU backend's tolerance too."""
    b = ref.Batch(rng, [1500, 700, 1100], [1, 1, 1], 64)
    data, pool = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 64)
    q_bits, q = ref.random_q(rng, b.total_q, 16)
    w = cases.make_wrapper(DEVICE, exact_scores=exact)
    cases.plan_batch(w, b, 16, False, 0.4, "fp8_e4m3", DEVICE)
    ckv, kpe = cases.torch_cache(data, "fp8_e4m3", DEVICE)
    qt = cases.bf16(q_bits, DEVICE)
    o, lse = w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, return_lse=True,
                   **cases.scales("fp8_e4m3"))
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 64, False,
                           np.float32(0.4))
    lse = lse.cpu().numpy()
    assert float(np.max(rl)) * ref.LOG2E > 30.0  # the case does reach large scores
    ref.check_attention(cases.bits(o), lse, ro, rl * ref.LOG2E, "gpu", DEVICE, pool,
                        lse_rtol=None if exact else ref.GPU_FP8_SCORES_LSE_RTOL)
    if exact:
        ref.assert_close(lse, rl * ref.LOG2E, ref.LSE_RTOL, ref.LSE_ATOL, "exact_scores lse")


def test_device_page_table(rng):
    """kv_indices as a CUDA tensor (int32 or int64) stays on the GPU (Problem::device_kv_indices:
    checked and copied there): the same bits as a host page table, and an entry outside the
    pool named as device_kv_indices[i]."""
    b = ref.Batch(rng, [3000, 17, 640], [1, 1, 1], 1)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 1)
    q_bits, _ = ref.random_q(rng, b.total_q, 16)
    tckv, tkpe = cases.torch_cache(data, "fp8_e4m3", DEVICE)
    qt = cases.bf16(q_bits, DEVICE)
    outs = []
    for table in (np.asarray(b.kv_indices, np.int32),
                  torch.from_numpy(np.asarray(b.kv_indices, np.int64)).to(DEVICE)):
        w = cases.make_wrapper(DEVICE)
        w.plan(b.qo_indptr, b.kv_indptr, table, b.kv_len, 16, 512, 64, 1, False, 0.1,
               torch.bfloat16, torch.float8_e4m3fn, num_pages=b.num_pages)
        outs.append(w.run(qt[:, :, :512], qt[:, :, 512:], tckv, tkpe, return_lse=True,
                          **cases.scales("fp8_e4m3")))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    bad = torch.from_numpy(np.asarray(b.kv_indices, np.int32)).to(DEVICE)
    bad[1234] = b.num_pages
    w = cases.make_wrapper(DEVICE)
    with pytest.raises(ValueError, match=r"^kv_indices\[1234\]"):
        w.plan(b.qo_indptr, b.kv_indptr, bad, b.kv_len, 16, 512, 64, 1, False, 0.1,
               torch.bfloat16, torch.float8_e4m3fn, num_pages=b.num_pages)


def test_any_scale_ratio(rng):
    """FlashInfer takes any kpe_scale / ckv_scale. fp8mla's fastest kernels fold a power of two
    into q_pe, so an eager wrapper re-plans at the first run() with another ratio (kernels that
    take any) and keeps that for later plans; a graph-mode wrapper refuses it, naming kpe_scale,
    unless it was made with any_scale_ratio=True."""
    b = ref.Batch(rng, [700, 33], [1, 1], 64)
    data, _ = ref.make_pool(rng, "fp8_e4m3", b.num_pages, 64)
    cs, ks = 0.011, 0.0037
    pool = ref.decode_tokens(data, "fp8_e4m3")
    pool[..., :512] *= np.float64(np.float32(cs))
    pool[..., 512:] *= np.float64(np.float32(ks))
    q_bits, q = ref.random_q(rng, b.total_q, 16)
    ckv, kpe = cases.torch_cache(data, "fp8_e4m3", DEVICE)
    qt = cases.bf16(q_bits, DEVICE)
    ro, rl = ref.attention(q, pool, b.qo_indptr, b.kv_indptr, b.kv_indices, b.kv_len, 64, False,
                           np.float32(2.5))

    def run(w):
        out = cases.nan_bf16((b.total_q, 16, 512), DEVICE)
        o, lse = w.run(qt[:, :, :512], qt[:, :, 512:], ckv, kpe, out=out, return_lse=True,
                       ckv_scale=cs, kpe_scale=ks)
        ref.check_attention(cases.bits(o), lse.cpu().numpy(), ro, rl * ref.LOG2E, "any ratio",
                            DEVICE, pool)

    eager = cases.make_wrapper(DEVICE)
    for _ in range(2):  # the re-plan, then a plan() that keeps any_scale_ratio
        cases.plan_batch(eager, b, 16, False, 2.5, "fp8_e4m3", DEVICE)
        run(eager)
    graph_kw = dict(use_cuda_graph=True, max_batch=2, max_total_q=2,
                    max_kv_indices=len(b.kv_indices))
    fixed = cases.make_wrapper(DEVICE, **graph_kw)
    cases.plan_batch(fixed, b, 16, False, 2.5, "fp8_e4m3", DEVICE)
    with pytest.raises(ValueError, match=r"^kpe_scale: .*any_scale_ratio=True"):
        run(fixed)
    anyr = cases.make_wrapper(DEVICE, any_scale_ratio=True, **graph_kw)
    cases.plan_batch(anyr, b, 16, False, 2.5, "fp8_e4m3", DEVICE)
    run(anyr)


def test_replan_step_host_tensors(rng):
    cases.case_replan_step_host_tensors(rng, DEVICE)
