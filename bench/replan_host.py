"""Host time of BatchMLAPagedAttentionWrapper.replan_step (the SGLang plugin's per-step re-plan)
on a CUDA device, whole and in parts, per case: min / median / p90 over 300 calls ("general":
replan_step with the address path for host torch tensors turned off, in the same process). The parts
read the wrapper's internals (its last Problem tuple, the native module), so this is a
diagnostic of this tree, not an API example. Last, per case, the host time of the SGLang
backend's page-table fill (fp8mla.sglang.backend.PageTable.fill), the step's other host work.

    PYTHONPATH=<fp8mla package> python bench/replan_host.py
"""
import cProfile
import pstats
import statistics
import time

import torch

import fp8mla
from fp8mla import _tensors as T
from fp8mla import wrapper as W
from fp8mla.sglang.backend import PageTable

dev = torch.device("cuda")


def stats(f, n=300):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t0) * 1e6)
    ts.sort()
    return f"min {ts[0]:6.1f} med {statistics.median(ts):6.1f} p90 {ts[int(0.9*n)]:6.1f} us"


for bs, ctx, ps in [(1, 4096, 1), (64, 32768, 1), (128, 32768, 1), (128, 4096, 64), (64, 4096, 64)]:
    pages_per = (ctx + ps - 1) // ps
    n_pages = bs * pages_per
    table = torch.arange(n_pages + 1, dtype=torch.int32, device=dev)
    qo = torch.arange(bs + 1, dtype=torch.int32)
    kvp = torch.arange(0, (bs + 1) * pages_per, pages_per, dtype=torch.int32)
    kvl = torch.full((bs,), ctx, dtype=torch.int32)
    w = fp8mla.BatchMLAPagedAttentionWrapper(torch.empty(1, device=dev), use_cuda_graph=True,
        kv_indices=table, num_pages=n_pages + 1, max_batch=bs, max_total_q=bs, max_qo_len=1)
    w.plan(metadata=fp8mla.MLAPlanMetadata.csr(qo, kvp, table[:n_pages], kvl), num_heads=16,
           head_dim_ckv=512, head_dim_kpe=64, page_size=ps, causal=False, sm_scale=0.1,
           q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn, query_layout="split",
           kv_cache_layout="split")
    print(f"bs {bs} ctx {ctx} page {ps}")
    print("  replan_step        ", stats(lambda: w.replan_step(qo, kvp, kvl)))
    R = getattr(fp8mla, "_replan_step", None)  # absent from packages before 6093f01 (A/B runs)
    if R is not None:  # the same calls on the general path (host_i32 copies)
        R.host_i32_address = lambda x: None
        print("  replan_step general", stats(lambda: w.replan_step(qo, kvp, kvl)))
        R.host_i32_address = T.host_i32_address
    print("  host_i32 x3        ", stats(lambda: (T.host_i32(qo, 'a'), T.host_i32(kvp, 'b'), T.host_i32(kvl, 'c'))))
    if hasattr(T, "host_i32_address"):  # absent from packages before f7460cf (A/B runs)
        print("  host_i32_address x3", stats(lambda: (T.host_i32_address(qo), T.host_i32_address(kvp), T.host_i32_address(kvl))))
    p = w._problem
    print("  for_ext(borrowed)  ", stats(lambda: T.for_ext(p["borrowed"])))
    print("  current_stream     ", stats(lambda: w._plan_stream(p)))
    q2, k2, l2 = T.host_i32(qo, 'a'), T.host_i32(kvp, 'b'), T.host_i32(kvl, 'c')
    last = w._args
    stream = w._plan_stream(p)
    def ext_only():
        args = (q2, k2, None, l2) + last[4:-1] + (T.for_ext(p["borrowed"]),)
        W._ext.replan_on_stream(w._plan, args, stream)
    print("  ext.replan_on_stream", stats(ext_only))
    if hasattr(W._ext, "replan_step_host"):
        addr = [T.host_i32_address(x) for x in (qo, kvp, kvl)]
        print("  ext.replan_step_host", stats(lambda: W._ext.replan_step_host(
            w._plan, w._step, addr[0][0], addr[1][0], addr[2][0], bs, stream or 0,
            stream is not None)))
    # The plugin's other per-step host work: its page table, built on the device from SGLang's
    # req_to_token rows (int32) and req_pool_indices (int64), from the host lengths.
    max_ctx = pages_per * ps + ps
    req_to_token = torch.arange(bs * max_ctx, dtype=torch.int32, device=dev).view(bs, max_ctx)
    rows = torch.arange(bs, dtype=torch.int64, device=dev)
    pt = PageTable(n_pages + bs, ps, dev)
    lens = torch.full((bs,), ctx, dtype=torch.int32)
    print("  PageTable.fill     ", stats(lambda: pt.fill(req_to_token, rows, lens)))
    torch.cuda.synchronize()
cProfile.run("for _ in range(2000): w.replan_step(qo, kvp, kvl)", "/tmp/prof")
pstats.Stats("/tmp/prof").sort_stats("tottime").print_stats(12)
