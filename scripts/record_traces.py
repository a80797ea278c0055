#!/usr/bin/env python3
"""Records torch.profiler traces of a small MLA decode loop, done three ways.

Each strategy runs the same decode steps of a DeepSeek-shaped MLA stack (per layer: a query
GEMM, a latent-KV GEMM, the new token appended to the layer's FP8 pool, attention, an output
GEMM) and differs only in how attention reads the FP8 pool:

  cast    casts the layer's whole FP8 pool to bf16, then attends on the bf16 copy (the bug:
          SGLang's `k_buffer.to(q.dtype)` before a bf16-only kernel)
  gather  gathers the batch's pages (aten::index), casts those to bf16, then attends
  native  attends on the FP8 pool directly through fp8mla (torch op fp8mla::mla_decode)

Attention itself is fp8mla in all three (its bf16 path for cast and gather), so the traces
differ only by the cast. For each strategy it writes
  OUT/<strategy>.trace.json.gz     the Chrome trace (torch.profiler export_chrome_trace)
  OUT/<strategy>.expected.json     the profiler's own numbers for the same run, read from
                                   torch.profiler's event list (not from the trace file):
                                   steps, their times, and the time of the pool/gather casts,
                                   which tests compare with `fp8mla audit`'s findings.

  python scripts/record_traces.py --out traces                      # CPU, all three
  python scripts/record_traces.py --device cuda --out traces_cuda   # a CUDA trace

Needs torch and the fp8mla package (built with the CUDA backend for --device cuda).
"""

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

STRATEGIES = ("cast", "gather", "native")
DIM_CKV, DIM_KPE = 512, 64
DIM_QK = DIM_CKV + DIM_KPE


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    p.add_argument("--out", default="traces", help="output folder (default: traces)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="comma-separated subset of cast,gather,native (default: all three)")
    p.add_argument("--layers", type=int, default=4, help="layers a step (default: 4)")
    p.add_argument("--steps", type=int, default=3,
                   help="profiled decode steps, after one warm-up step (default: 3)")
    p.add_argument("--batch", type=int, default=4, help="decode requests (default: 4)")
    p.add_argument("--context", type=int, default=256,
                   help="tokens each request starts with; every step adds one (default: 256)")
    p.add_argument("--pool", type=int, default=8192,
                   help="tokens in each layer's FP8 pool, page size 1 (default: 8192)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: 8, TP8 DeepSeek)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default: 256)")
    p.add_argument("--no-shapes", action="store_true",
                   help="record without record_shapes (traces then carry times only)")
    p.add_argument("--seed", type=int, default=1, help="default: 1")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads, 0 for torch's choice (default: 1: on a busy 2-core "
                        "machine more threads made the small GEMMs 20x slower)")
    args = p.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    for s in args.strategies:
        if s not in STRATEGIES:
            p.error(f"--strategies: expected a subset of {','.join(STRATEGIES)}, got {s!r}")
    if args.batch * (args.context + args.steps + 1) > args.pool:
        p.error(f"--pool: {args.pool} tokens cannot hold {args.batch} requests of "
                f"{args.context + args.steps + 1} tokens")
    return args


class Model:
    """The weights and pools of a small MLA decode stack on one device."""

    def __init__(self, torch, args, device):
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        bf16 = torch.bfloat16

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(bf16).to(device)

        d, h = args.hidden, args.heads
        self.layers = []
        for _ in range(args.layers):
            pool = (torch.randn(args.pool, 1, DIM_QK, generator=g) * 0.5)
            self.layers.append(dict(
                wq=rand(d, h * DIM_QK, scale=d ** -0.5),
                wkv=rand(d, DIM_QK, scale=d ** -0.5),
                wo=rand(h * DIM_CKV, d, scale=(h * DIM_CKV) ** -0.5),
                pool=pool.to(torch.float8_e4m3fn).to(device),
            ))
        self.x0 = rand(args.batch, d)


def decode_step(torch, fp8mla, args, model, wrapper, strategy, state):
    """One decode step through every layer; returns the last layer's output."""
    b, h = args.batch, args.heads
    device = model.x0.device
    # The batch's pages (page size 1): request r owns tokens [r * stride, r * stride + len).
    lens = state["lens"]
    stride = args.pool // b
    kv_indices = torch.cat([torch.arange(r * stride, r * stride + lens[r], dtype=torch.int32)
                            for r in range(b)])
    slots = torch.tensor([r * stride + lens[r] - 1 for r in range(b)], dtype=torch.int64)
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    qo_indptr = torch.arange(b + 1, dtype=torch.int32)
    kv_len = torch.tensor(lens, dtype=torch.int32)
    kv_dtype = torch.float8_e4m3fn if strategy == "native" else torch.bfloat16
    with torch.profiler.record_function("plan"):
        if strategy == "gather":
            # The gathered buffer holds the batch's pages in order: identity page ids.
            n = int(kv_indices.numel())
            wrapper.plan(qo_indptr, kv_indptr, torch.arange(n, dtype=torch.int32), kv_len, h,
                         DIM_CKV, DIM_KPE, 1, True, 0.0625, torch.bfloat16, kv_dtype,
                         num_pages=n)
        else:
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, h, DIM_CKV, DIM_KPE, 1,
                         True, 0.0625, torch.bfloat16, kv_dtype, num_pages=args.pool)
    gather_ids = kv_indices.to(device=device, dtype=torch.int64)
    slots = slots.to(device)
    x = model.x0
    for layer in model.layers:
        q = torch.matmul(x, layer["wq"]).view(b, h, DIM_QK)
        kv_new = torch.matmul(x, layer["wkv"])
        pool = layer["pool"]
        pool[slots, 0] = kv_new.to(torch.float8_e4m3fn)  # append this step's token
        if strategy == "cast":
            kv = pool.to(torch.bfloat16)
        elif strategy == "gather":
            kv = pool[gather_ids].to(torch.bfloat16)
        else:
            kv = pool
        # An FP8 cache takes its scales as FlashInfer's does: this pool is unscaled (SGLang's).
        scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if strategy == "native" else {}
        out = wrapper.run(q[:, :, :DIM_CKV], q[:, :, DIM_CKV:], kv[:, :, :DIM_CKV],
                          kv[:, :, DIM_CKV:], **scales)
        x = torch.matmul(out.reshape(b, h * DIM_CKV), layer["wo"])
    state["lens"] = [n + 1 for n in lens]
    return x


def profiler_numbers(torch, prof, args, strategy):
    """The profiler's own figures, from its event list: per step the step's time and the time
    of the casts that feed attention (the pool cast, or the gather's cast)."""
    events = prof.events()
    cuda = args.device == "cuda"
    steps = []
    cpu_type = torch.autograd.DeviceType.CPU
    for e in events:
        # "ProfilerStep*" in the event list; on CUDA the GPU timeline repeats it.
        if e.name.startswith("ProfilerStep") and getattr(e, "device_type", cpu_type) == cpu_type:
            steps.append(dict(start_us=e.time_range.start,
                              end_us=e.time_range.end, cpu_us=e.cpu_time_total))
    steps.sort(key=lambda s: s["start_us"])

    # Without record_shapes the event list has no shapes either: the KV casts are then told by
    # their order (the cast before each attention call), as the script made them.
    def top_level(e):
        return e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep")

    def kv_ops(step_events):
        casts, gathers = [], []
        ordered = sorted((e for e in step_events if top_level(e)),
                         key=lambda e: e.time_range.start)
        # Every aten::index of the step, at any depth: on CUDA the event list may give the
        # gather a parent other than the step.
        indexes = sorted((e for e in step_events if e.name == "aten::index"),
                         key=lambda e: e.time_range.start)
        for i, e in enumerate(ordered):
            if e.name != "fp8mla::mla_decode" or strategy == "native":
                continue
            # The last aten::to before the call made the cache it reads (the append's cast of
            # the new token comes before it).
            j = max((k for k in range(i) if ordered[k].name == "aten::to"), default=-1)
            if j < 0:
                continue
            casts.append(ordered[j])
            if strategy == "gather":
                # The gather: the last aten::index that ended before that cast began.
                before = [x for x in indexes if x.time_range.end <= ordered[j].time_range.start]
                if before:
                    gathers.append(before[-1])
        return casts, gathers

    def device_time(e):
        return getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)

    for s in steps:
        inside = [e for e in events if s["start_us"] <= e.time_range.start < s["end_us"]
                  and not e.name.startswith("ProfilerStep")]
        casts, gathers = kv_ops(inside)
        # aten::to's time includes its children (aten::_to_copy, aten::copy_).
        s["kv_casts"] = len(casts)
        s["kv_cast_cpu_us"] = sum(e.cpu_time_total for e in casts)
        s["kv_gather_cpu_us"] = sum(e.cpu_time_total for e in gathers)
        if cuda:
            s["kv_cast_device_us"] = sum(device_time(e) for e in casts)
            s["kv_gather_device_us"] = sum(device_time(e) for e in gathers)
        if casts and casts[0].input_shapes and casts[0].input_shapes[0]:
            elems = 1
            for n in casts[0].input_shapes[0]:
                elems *= n
            s["kv_cast_bytes_each"] = elems * (1 + 2)  # read fp8, write bf16
    return dict(strategy=strategy, device=args.device, torch=torch.__version__,
                record_shapes=not args.no_shapes, layers=args.layers, batch=args.batch,
                heads=args.heads, pool_tokens=args.pool, context=args.context,
                steps=steps)


def record(torch, fp8mla, args, strategy, out_dir):
    device = torch.device(args.device)
    model = Model(torch, args, device)
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    wrapper = fp8mla.BatchMLAPagedAttentionWrapper(workspace)
    state = {"lens": [args.context] * args.batch}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=args.steps, repeat=1)
    trace_path = os.path.join(out_dir, f"{strategy}.trace.json")
    result = {}

    def on_ready(prof):  # the active steps are done: the event list holds them until the next
        prof.export_chrome_trace(trace_path)
        result.update(profiler_numbers(torch, prof, args, strategy))

    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_ready,
                                record_shapes=not args.no_shapes) as prof:
        for _ in range(1 + args.steps):
            decode_step(torch, fp8mla, args, model, wrapper, strategy, state)
            if args.device == "cuda":
                torch.cuda.synchronize()
            prof.step()
    expected = result
    with open(trace_path, "rb") as f_in, gzip.open(trace_path + ".gz", "wb", 9) as f_out:
        shutil.copyfileobj(f_in, f_out)
    os.remove(trace_path)
    with open(os.path.join(out_dir, f"{strategy}.expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    return expected


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    import fp8mla

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("record_traces.py: --device cuda: torch sees no CUDA device")
    if args.device == "cuda" and not fp8mla.cuda_available():
        sys.exit("record_traces.py: --device cuda: this fp8mla has no CUDA backend (build it "
                 "with FP8MLA_PY_CUDA=ON, or carry scripts/device/carry_fp8mla_py.sh's build)")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    for strategy in args.strategies:
        start = time.time()
        e = record(torch, fp8mla, args, strategy, args.out)
        steps = e["steps"]
        step_ms = sum(s["end_us"] - s["start_us"] for s in steps) / max(len(steps), 1) / 1e3
        cast_ms = sum(s["kv_cast_cpu_us"] for s in steps) / max(len(steps), 1) / 1e3
        size = os.path.getsize(os.path.join(args.out, f"{strategy}.trace.json.gz"))
        print(f"{strategy:7s} {len(steps)} steps, {step_ms:8.2f} ms a step, kv casts "
              f"{cast_ms:8.2f} ms a step (cpu time); trace {size / 1e3:.0f} kB gz; "
              f"{time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
