#!/usr/bin/env python3
"""One SGLang decode step of an MLA model, three ways, in CUDA graphs (the GPU device's bench):

  plugin  what ``--attention-backend fp8mla`` runs (fp8mla.sglang): one plan (stream-ordered,
          into a borrowed page table), then every layer's run reading the FP8 pool natively;
  cast    what SGLang 0.5.23's flashinfer_mla backend runs: every layer casts its whole FP8 pool
          to bf16 (get_key_buffer(layer).to(q.dtype)) and runs a bf16 MLA kernel: FlashInfer's
          fa3 BatchMLAPagedAttentionWrapper when flashinfer is importable, else fp8mla's bf16
          path (the row's cast_kernel says which ran);
  gather  only the batch's listed pages gathered and cast to bf16 each layer, then fp8mla's
          bf16 kernel: the alternative where the bf16 kernel is the faster one (long extend
          chunks are compute-bound), timed without its plan.

Each way's layers are captured in one CUDA graph; a step is the host time of its plan plus one
graph replay (CUDA events, median of --iters). The pools are SGLang's layout ([tokens, 1, 576]
float8_e4m3fn, page size 1; [pages, 64, 576] at page 64) of --pool-factor x the active tokens
or --pool-tokens, whichever is larger (SGLang's pool is its whole KV memory: 857 MB a layer in
the GLM-5 story, ~1.5M tokens), cycled over --distinct-pools buffers (each far larger than L2)
so no layer reads a cached pool. Before timing, the ways' outputs are compared (relative L2
over every layer: the plugin reads the same FP8 bytes the casts produce exactly in bf16, so
they differ by accumulation only).

--extend also times extend-with-prefix chunks (query tokens x cached tokens, causal, absorbed
MLA) the three ways.

Usage on the device (the lead's run; torch and fp8mla installed there):
    python bench/sglang_step.py --layers 61 78 --page-size 1 64 --batch 1 16 64 128 \\
        --ctx 4096 32768 --extend --pool-tokens 1500000 --json bench/results/h100_sglang_step.json
On a CPU (the smoke test, tests/python/test_bench_sglang_step.py): --device cpu --no-graph with
tiny sizes checks the ways agree and the JSON is written.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch

import fp8mla

HEADS_DEFAULT = 16  # 128 heads / TP8 (DeepSeek-V3 on 8 GPUs)
SM_SCALE = 1.0 / math.sqrt(192)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[61])
    p.add_argument("--page-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--heads", type=int, default=HEADS_DEFAULT)
    p.add_argument("--pool-factor", type=float, default=1.25)
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="pool size in tokens when larger than pool-factor x the active tokens "
                        "(SGLang's pool is its whole KV memory, which its cast way casts)")
    p.add_argument("--distinct-pools", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-graph", action="store_true", help="run eagerly (the CPU smoke test)")
    p.add_argument("--extend", action="store_true", help="also time extend-with-prefix chunks")
    p.add_argument("--extend-q", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--extend-ctx", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


class Case:
    """One (layers, page size, batch, context) step: pools, q, page table, outputs."""

    def __init__(self, a, layers, page_size, batch, ctx, qo_len=1):
        dev = torch.device(a.device)
        self.dev, self.layers, self.ps, self.batch, self.ctx = dev, layers, page_size, batch, ctx
        self.qo_len, self.heads = qo_len, a.heads
        pages_per_req = -(-ctx // page_size)
        active = batch * pages_per_req
        self.num_pages = max(int(active * a.pool_factor) + 1, -(-a.pool_tokens // page_size))
        gen = torch.Generator(device="cpu").manual_seed(1)
        # The pools are drawn on the device (gigabytes each at 32K tokens x 128 requests).
        dgen = torch.Generator(device=dev).manual_seed(1)
        self.pools = []
        for _ in range(min(a.distinct_pools, layers)):
            vals = torch.randn(self.num_pages, page_size, 576, generator=dgen, device=dev)
            self.pools.append((vals * 0.5).to(torch.float8_e4m3fn))
            del vals
        perm = torch.randperm(self.num_pages - 1, generator=gen)[:active] + 1
        self.kv_indices = perm.to(torch.int32)
        self.kv_len = torch.full((batch,), ctx, dtype=torch.int32)
        self.kv_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * pages_per_req
        self.qo_indptr = torch.arange(0, batch + 1, dtype=torch.int32) * qo_len
        tq = batch * qo_len
        self.q = (torch.randn(tq, a.heads, 576, generator=gen)).to(dev).to(torch.bfloat16)
        self.out = torch.empty(tq, a.heads, 512, dtype=torch.bfloat16, device=dev)
        self.out_cast = torch.empty_like(self.out)
        self.out_gather = torch.empty_like(self.out)

    def pool(self, layer):
        return self.pools[layer % len(self.pools)]


def plugin_way(case):
    """fp8mla.sglang's step: graph-mode wrapper over a borrowed page table (the buffer is written
    on the device in the real backend; here filled once), one plan, then the layers."""
    table = torch.zeros(case.kv_indices.numel() + 1, dtype=torch.int32, device=case.dev)
    table[: case.kv_indices.numel()] = case.kv_indices.to(case.dev)
    w = fp8mla.BatchMLAPagedAttentionWrapper(
        torch.empty(1, device=case.dev), use_cuda_graph=True, kv_indices=table,
        num_pages=case.num_pages, max_batch=case.batch, max_total_q=case.batch * case.qo_len,
        max_qo_len=case.qo_len)

    def plan():  # as fp8mla.sglang's backend: plan() once, then replan_step() each step
        if w.plan_info is not None:
            w.replan_step(case.qo_indptr, case.kv_indptr, case.kv_len)
            return
        w.plan(metadata=fp8mla.MLAPlanMetadata.csr(case.qo_indptr, case.kv_indptr,
                                                   table[: case.kv_indices.numel()],
                                                   case.kv_len),
               num_heads=case.heads, head_dim_ckv=512, head_dim_kpe=64, page_size=case.ps,
               causal=case.qo_len > 1, sm_scale=SM_SCALE, q_data_type=torch.bfloat16,
               kv_data_type=torch.float8_e4m3fn, query_layout="split",
               kv_cache_layout="split")

    def layers():
        qn, qp = case.q[..., :512], case.q[..., 512:]
        for layer in range(case.layers):
            pool = case.pool(layer)
            w.run(query=(qn, qp), kv_cache=(pool[..., :512], pool[..., 512:]), out=case.out,
                  ckv_scale=1.0, kpe_scale=1.0)

    return plan, layers


def cast_way(case):
    """SGLang 0.5.23's flashinfer_mla step: per layer the whole pool .to(bf16), then a bf16 MLA
    kernel (FlashInfer fa3 when importable, else fp8mla's bf16 path)."""
    kernel = "fp8mla-bf16"
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=case.dev)
    w = None
    if case.dev.type == "cuda":
        try:
            import flashinfer.mla as fi_mla

            w = fi_mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
            kernel = "flashinfer-fa3"
        except ImportError:
            w = None
    if w is None:
        w = fp8mla.BatchMLAPagedAttentionWrapper(ws if case.dev.type == "cuda" else None,
                                                 num_pages=case.num_pages)
    idx = [t.to(case.dev) for t in (case.qo_indptr, case.kv_indptr, case.kv_indices,
                                    case.kv_len)]
    w.plan(*idx, case.heads, 512, 64, case.ps, case.qo_len > 1, SM_SCALE, torch.bfloat16,
           torch.bfloat16)
    # The cast target is allocated once, as SGLang's caching allocator reuses the block.
    bf16 = torch.empty(case.num_pages, case.ps, 576, dtype=torch.bfloat16, device=case.dev)

    def layers():
        qn, qp = case.q[..., :512], case.q[..., 512:]
        for layer in range(case.layers):
            bf16.copy_(case.pool(layer))  # get_key_buffer(layer).to(q.dtype)
            w.run(qn, qp, bf16[..., :512], bf16[..., 512:], out=case.out_cast)

    return layers, kernel


def gather_way(case):
    """Casting only the listed pages: per layer the batch's pages gathered from the FP8 pool and
    cast to bf16 into a contiguous buffer, then fp8mla's bf16 kernel over it (the alternative to
    reading FP8 natively where the bf16 kernel is the faster one, as for long extend chunks)."""
    n = case.kv_indices.numel()
    ids = case.kv_indices.to(case.dev).long()
    w = fp8mla.BatchMLAPagedAttentionWrapper(
        torch.empty(1, device=case.dev) if case.dev.type == "cuda" else None, num_pages=max(n, 1))
    idx = [t.to(case.dev) for t in (case.qo_indptr, case.kv_indptr,
                                    torch.arange(n, dtype=torch.int32), case.kv_len)]
    w.plan(*idx, case.heads, 512, 64, case.ps, case.qo_len > 1, SM_SCALE, torch.bfloat16,
           torch.bfloat16)
    bf16 = torch.empty(max(n, 1), case.ps, 576, dtype=torch.bfloat16, device=case.dev)

    def layers():
        qn, qp = case.q[..., :512], case.q[..., 512:]
        for layer in range(case.layers):
            bf16[:n].copy_(case.pool(layer).index_select(0, ids))  # the listed pages, cast
            w.run(qn, qp, bf16[..., :512], bf16[..., 512:], out=case.out_gather)

    return layers


def timed(a, case, fn):
    """Median ms of fn over a.iters: a CUDA graph replay (captured once) or eager calls."""
    if case.dev.type != "cuda" or a.no_graph:
        times = []
        for _ in range(max(1, min(a.iters, 3))):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up: re-plans for the pool, loads kernels
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(a.iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_us(fn, iters):
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def run_case(a, layers, ps, batch, ctx, qo_len=1, kind="decode"):
    case = Case(a, layers, ps, batch, ctx, qo_len)
    plan, plugin_layers = plugin_way(case)
    plan()
    cast_layers, kernel = cast_way(case)
    gather_layers = gather_way(case)
    plugin_layers()
    cast_layers()
    gather_layers()
    if case.dev.type == "cuda":
        torch.cuda.synchronize()
    err = rel_l2(case.out, case.out_cast)
    err_gather = rel_l2(case.out_gather, case.out_cast)
    if not (err < 2e-2 and err_gather < 2e-2):
        raise SystemExit(f"{kind} layers={layers} ps={ps} bs={batch} ctx={ctx}: the ways "
                         f"disagree (relative L2 plugin {err:.2e}, gather {err_gather:.2e})")
    plan_us = host_us(plan, max(3, a.iters))
    plugin_ms = timed(a, case, plugin_layers)
    cast_ms = timed(a, case, cast_layers)
    gather_ms = timed(a, case, gather_layers)
    step_plugin = plugin_ms + plan_us / 1e3
    row = dict(kind=kind, layers=layers, page_size=ps, batch=batch, ctx=ctx, qo_len=qo_len,
               heads=a.heads, plan_host_us=round(plan_us, 1),
               plugin_layers_ms=round(plugin_ms, 3), plugin_step_ms=round(step_plugin, 3),
               cast_step_ms=round(cast_ms, 3), speedup=round(cast_ms / step_plugin, 2),
               gather_step_ms=round(gather_ms, 3), pool_tokens=case.num_pages * ps,
               cast_kernel=kernel, rel_l2=err, graph=case.dev.type == "cuda" and not a.no_graph)
    print(f"{kind:7s} L={layers:3d} ps={ps:3d} bs={batch:4d} ctx={ctx:6d} q={qo_len:5d}  "
          f"plan {plan_us:7.1f} us  plugin {step_plugin:9.3f} ms  cast({kernel}) "
          f"{cast_ms:9.3f} ms  {cast_ms / step_plugin:5.2f}x  gather {gather_ms:9.3f} ms  "
          f"(rel L2 {err:.1e})", flush=True)
    return row


def release(a):
    """Hands the finished case's pools and graphs back before the next case allocates."""
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()


def main():
    a = parse()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu --no-graph)")
    print(f"fp8mla {fp8mla.version()}, torch {torch.__version__}, device {a.device}, "
          f"heads {a.heads}", flush=True)
    rows = []
    for layers in a.layers:
        for ps in a.page_size:
            for batch in a.batch:
                for ctx in a.ctx:
                    rows.append(run_case(a, layers, ps, batch, ctx))
                    release(a)
    if a.extend:
        for ps in a.page_size:
            for q in a.extend_q:
                for ctx in a.extend_ctx:
                    rows.append(run_case(a, 1, ps, 1, ctx + q, qo_len=q, kind="extend"))
                    release(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
