"""Engine-facing behaviour on a CUDA device (every test skips without one; the device run is
`FP8MLA_PY_OFFLINE=1 FP8MLA_PY_CUDA=ON PYTHON=python3 bash tests/python/run.sh`):

  * FlashInfer 0.6.18's documented example, as written but for the import;
  * graph mode as engines use it: a torch CUDA graph captured over run(), the constructor's
    kv_indices buffer rewritten in place, the replay reading the new pages;
  * a graph-mode plan() that does not synchronise: plan while a long kernel holds the stream and
    check it returns before the kernel ends, then the run after it computes the new batch.
"""

import math
import time

import pytest

torch = pytest.importorskip("torch")

import fp8mla  # noqa: E402
import fp8mla.mla  # noqa: E402

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fp8mla.cuda_available()),
                                reason="needs a CUDA device and fp8mla's CUDA backend")

SM_SCALE = 1.0 / math.sqrt(192)


def reference(q, pool, kv_indptr, kv_indices, kv_len, page_size):
    """float64 decode (one query token a request) over the pool's stored values."""
    q, pool = q.double().cpu(), pool.double().cpu()
    out = torch.zeros(q.shape[0], q.shape[1], 512, dtype=torch.float64)
    for r in range(q.shape[0]):
        pages = kv_indices[int(kv_indptr[r]):int(kv_indptr[r + 1])].cpu().long()
        k = pool[pages].reshape(-1, 576)[: int(kv_len[r])]
        s = (q[r] @ k.T) * SM_SCALE
        out[r] = torch.softmax(s, -1) @ k[:, :512]
    return out


def close(o, want, tol=1e-2):
    o = o.double().cpu()
    return float(torch.linalg.norm(o - want) / torch.linalg.norm(want)) < tol


def test_flashinfer_0_6_18_docstring_example():
    num_local_heads = 128
    batch_size = 114
    head_dim_ckv = 512
    head_dim_kpe = 64
    page_size = 1
    mla_wrapper = fp8mla.mla.BatchMLAPagedAttentionWrapper(
        torch.empty(128 * 1024 * 1024, dtype=torch.int8).to(0),
        backend="fa2"
    )
    q_indptr = torch.arange(0, batch_size + 1).to(0).int()  # for decode, each query length is 1
    kv_lens = torch.full((batch_size,), 999, dtype=torch.int32).to(0)
    kv_indptr = torch.arange(0, batch_size + 1).to(0).int() * 999
    kv_indices = torch.arange(0, batch_size * 999).to(0).int()
    q_nope = torch.randn(
        batch_size * 1, num_local_heads, head_dim_ckv, dtype=torch.bfloat16, device="cuda"
    )
    q_pe = torch.zeros(
        batch_size * 1, num_local_heads, head_dim_kpe, dtype=torch.bfloat16, device="cuda"
    )
    ckv = torch.randn(
        batch_size * 999, 1, head_dim_ckv, dtype=torch.bfloat16, device="cuda"
    )
    kpe = torch.zeros(
        batch_size * 999, 1, head_dim_kpe, dtype=torch.bfloat16, device="cuda"
    )
    sm_scale = 1.0 / ((128 + 64) ** 0.5)  # use head dimension before matrix absorption
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
    for r in (0, 113):
        k = ckv[r * 999:(r + 1) * 999, 0].double().cpu()
        want = torch.softmax((q_nope[r].double().cpu() @ k.T) * sm_scale, -1) @ k
        assert close(o[r:r + 1], want[None]), r


def graph_case(page_size=16, batch=8, heads=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages = 2 * batch * (2048 // page_size)
    pool = (torch.randn(pages, page_size, 576, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    return gen, pool.cuda(), pages


def test_replay_reads_the_kv_indices_buffer_rewritten_in_place():
    """FlashInfer's graph contract: the captured run reads the constructor's kv_indices buffer;
    the engine rewrites it in place (here: every page moved to a copy, the originals NaN) and
    replays."""
    gen, pool, pages = graph_case()
    half = pages // 2
    pool[half:] = pool[:half]  # pages [half, 2 half) copy [0, half)
    batch, heads, ps = 8, 16, 16
    kv_len = torch.randint(1, 2000, (batch,), generator=gen, dtype=torch.int32)
    counts = (kv_len + ps - 1) // ps
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(counts, 0)
    ids = torch.randperm(half, generator=gen)[: int(kv_indptr[-1])].int()
    buf = torch.zeros(pages, dtype=torch.int32, device="cuda")
    buf[: len(ids)] = ids.cuda()
    w = fp8mla.BatchMLAPagedAttentionWrapper(torch.empty(1, device="cuda"), use_cuda_graph=True,
                                             kv_indices=buf, num_pages=pages)
    w.plan(metadata=fp8mla.MLAPlanMetadata.csr(torch.arange(batch + 1, dtype=torch.int32),
                                               kv_indptr, buf[: len(ids)], kv_len),
           num_heads=heads, head_dim_ckv=512, head_dim_kpe=64, page_size=ps, causal=False,
           sm_scale=SM_SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    q = torch.randn(batch, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(batch, heads, 512, dtype=torch.bfloat16, device="cuda")

    def step():
        w.run(query=q, kv_cache=pool, out=out, ckv_scale=1.0, kpe_scale=1.0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    want = reference(q, pool.float(), kv_indptr, ids, kv_len, ps)
    g.replay()
    torch.cuda.synchronize()
    assert close(out, want)
    buf[: len(ids)] += half  # the engine moves the pages, in place
    pool[:half].view(torch.uint8).fill_(0xFF)  # e4m3 NaN
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert close(out, want)


@pytest.mark.parametrize("form", ["plan", "replan_step"])
def test_graph_mode_plan_does_not_synchronise(form):
    """A graph-mode plan() with the constructor's buffer and host lengths (what SGLang's fast
    plan passes) is stream-ordered: called while a long kernel holds the stream, it returns
    before the kernel ends, and the run queued after it computes the new batch. The same holds
    for replan_step(), what fp8mla's SGLang backend calls after its first plan()."""
    gen, pool, pages = graph_case(page_size=64, seed=1)
    batch, heads, ps = 8, 16, 64
    buf = torch.zeros(pages, dtype=torch.int32, device="cuda")
    w = fp8mla.BatchMLAPagedAttentionWrapper(torch.empty(1, device="cuda"), use_cuda_graph=True,
                                             kv_indices=buf, num_pages=pages, max_batch=batch)

    def plan(kv_len, ids):
        counts = (kv_len + ps - 1) // ps
        kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(counts, 0)
        buf[: len(ids)].copy_(ids, non_blocking=True)  # the engine's own write, on the stream
        if form == "replan_step" and w.plan_info is not None:
            w.replan_step(torch.arange(batch + 1, dtype=torch.int32), kv_indptr, kv_len)
            return kv_indptr
        w.plan(metadata=fp8mla.MLAPlanMetadata.csr(torch.arange(batch + 1, dtype=torch.int32),
                                                   kv_indptr, buf[: len(ids)], kv_len),
               num_heads=heads, head_dim_ckv=512, head_dim_kpe=64, page_size=ps, causal=False,
               sm_scale=SM_SCALE, q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
        return kv_indptr

    def draw():
        kv_len = torch.randint(1, 3000, (batch,), generator=gen, dtype=torch.int32)
        n = int(((kv_len + ps - 1) // ps).sum())
        return kv_len, torch.randperm(pages, generator=gen)[:n].int()

    kv_len, ids = draw()
    plan(kv_len, ids.cuda())
    q = torch.randn(batch, heads, 576, generator=gen).to(torch.bfloat16).cuda()
    w.run(query=q, kv_cache=pool, ckv_scale=1.0, kpe_scale=1.0)  # warm: first plan, kernels
    kv_len2, ids2 = draw()
    ids2_dev = ids2.cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the current stream
    start = time.perf_counter()
    kv_indptr2 = plan(kv_len2, ids2_dev)
    plan_s = time.perf_counter() - start
    busy = not torch.cuda.current_stream().query()
    out = w.run(query=q, kv_cache=pool, ckv_scale=1.0, kpe_scale=1.0)
    torch.cuda.synchronize()
    assert busy, "the stream finished before plan() returned: the test could not tell"
    assert plan_s < 0.1, f"{form}() took {plan_s * 1e3:.1f} ms while the stream was held"
    print(f"graph-mode {form}() host time while the stream is held: {plan_s * 1e6:.0f} us")
    assert close(out, reference(q, pool.float(), kv_indptr2, ids2, kv_len2, ps))
