#!/usr/bin/env python3
"""One SGLang decode step of a DSA model (DeepSeek sparse attention: DeepSeek-V3.2, GLM-5), two
ways, in CUDA graphs (the GPU device's bench):

  plugin    what ``--attention-backend fp8mla`` runs for a DSA model (fp8mla.sglang.dsa): the
            batch's sparse plan looked up by its token count (SparsePlans.prepare, the host work
            of a step: the "plan" column), then every layer's SparsePlans.run over its pool as
            stored, with that layer's queries and global top-k slots;
  flashmla  SGLang's way on Hopper for an FP8 DSA pool (dsa_backend's flashmla_kv decode): every
            layer pads its queries to 64 heads (128 above 64; a zero fill and a copy), runs
            FlashMLA's sparse FP8 decode (flash_mla_with_kvcache over the pool viewed as 64-token
            pages [pool / 64, 64, 1, 656], q [bs, 1, 64, 576], indices [bs, 1, topk]) and keeps
            the real heads as a view of its padded output (SGLang slices, it does not copy: each
            layer writes its own padded output here); one FlashMLASchedMeta a step, filled by the
            first layer's call (FlashMLA's schedule kernel, captured with the layers, so every
            replay runs it), then re-used by the others. The queries come concatenated
            [bs, H, 576], as the kernel takes them (the concat SGLang makes first when q_rope
            comes separately is not timed; the plugin takes the two parts as views). It runs
            where `import flashmla_vllm` works (the package scripts/device/carry_flashmla.sh
            builds, on PYTHONPATH) on a CUDA device and the pool is the 656-byte format;
            otherwise its columns are absent (null in the JSON), never an error.

What a step includes: the core sparse MLA attention of L layers of one query token a request
(decode) and the plan host work. What it excludes: the indexer (its scores and top-k selection,
and SGLang's transform of the top-k into global slots), which both ways share; the KV writes of
the new tokens; everything outside attention.

Each layer has its own pool (as SGLang's per-layer KV buffers), of --pool-tokens tokens (default
max(262144, 2 x the largest batch x topk), a multiple of 64: far larger than L2, and every
request's rows are disjoint), filled with random latents stored the way SGLang stores them
(fp8_e4m3_block: 512 e4m3 codes of 128-value blocks scaled by amax / 448, 4 float32 scales, 64
bf16 rope values), never zeros. When L pools do not fit in memory (MEMORY_BUDGET bytes, less on a
smaller card) layers cycle over as many as fit (the row's distinct_pools). Every layer has its own
queries and its own top-k rows: distinct slots of its pool with about INVALID_FRAC of the entries
-1 (each row keeps its first). Each way's L layers are captured in one CUDA graph; a step is the
plugin's plan host time plus one graph replay (CUDA events, median of --iters; sglang_step.py's
timing). Before timing, outputs are poisoned (NaN) and both ways run once: the plugin's output
against FlashMLA's over every layer (relative L2) and both against a float64 reference on a few
rows of the first and last layers (all rows on the CPU).

Usage on the device (the carried fp8mla package and FlashMLA on PYTHONPATH):
    PYTHONPATH=.device_carry/fp8mla_py:.device_carry/flashmla python bench/sglang_dsa_step.py \\
        --layers 61 --heads 8 16 --batch 1 16 64 128 --topk 2048 \\
        --json bench/results/h100_sglang_dsa_step.json
Extend chunks (SGLang's DSA extend on Hopper over an FP8 pool runs the same FlashMLA decode
kernel, each query token a row): --layers 1 --batch 1024 4096 --context 32768, the chunk's
tokens selecting from one request's 32K tokens.
On a CPU (the smoke test, tests/python/test_bench_sglang_dsa_step.py): --device cpu --no-graph
with tiny sizes checks the plugin against the float64 reference and writes the JSON.
"""

import argparse
import json
import math
import os
import sys

import torch

import fp8mla
from fp8mla.sglang.sparse import SparsePlans, decode_rows, encode_rows
from sglang_step import host_us, rel_l2, timed

SM_SCALE = 1.0 / math.sqrt(192)  # DeepSeek's 1 / sqrt(qk_nope 128 + qk_rope 64)
PAGE = 64  # FlashMLA's sparse FP8 decode takes pages of 64 tokens only
MIN_POOL_TOKENS = 262144
MEMORY_BUDGET = 70e9  # bytes of pools at most (an 80 GB card, room left for the rest)
HEADROOM = 8 << 30  # bytes kept free beside the pools on the device
INVALID_FRAC = 0.02
TOLERANCE = 2e-2  # relative L2 between the ways and against the reference (bf16 outputs)
ROW_BYTES = {"fp8_e4m3_block": 656, "fp8_e4m3": 576, "bf16": 1152}


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[61],
                   help="layers a step (61: DeepSeek-V3.2; 78: GLM-5)")
    p.add_argument("--heads", type=int, nargs="+", default=[8, 16],
                   help="query heads a GPU (8: GLM-5, 16: DeepSeek-V3.2, at TP8)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128])
    p.add_argument("--topk", type=int, nargs="+", default=[2048])
    p.add_argument("--context", type=int, default=0,
                   help="draw every row's slots from one window of this many pool tokens (one "
                        "request's context: an extend chunk's query tokens, --batch of them, "
                        "select from the same tokens); 0: the whole pool, rows disjoint where it "
                        "holds them")
    p.add_argument("--pool-tokens", type=int, default=0,
                   help="tokens of each layer's pool (rounded up to a multiple of 64); default "
                        f"max({MIN_POOL_TOKENS}, 2 x the largest batch x topk)")
    p.add_argument("--kv-format", default="fp8_e4m3_block", choices=sorted(ROW_BYTES),
                   help="the pool's rows: fp8_e4m3_block (SGLang's DSA FP8 pool, FlashMLA's "
                        "656 bytes), fp8_e4m3 (raw 576-byte e4m3) or bf16; FlashMLA reads the "
                        "first only")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--no-graph", action="store_true", help="run eagerly (the CPU smoke test)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def load_flashmla(dev):
    """(module, description) of the carried FlashMLA, or (None, why it is absent)."""
    if dev.type != "cuda":
        return None, "device is not CUDA"
    try:
        import flashmla_vllm

        for name in ("get_mla_metadata", "flash_mla_with_kvcache"):
            getattr(flashmla_vllm, name)
    except Exception as e:  # not on PYTHONPATH, or its extension does not load here
        return None, f"import flashmla_vllm: {type(e).__name__}: {e}"
    where = os.path.dirname(os.path.abspath(flashmla_vllm.__file__))
    origin = ""
    try:
        with open(os.path.join(os.path.dirname(where), "CARRY.txt")) as f:
            origin = "; " + f.readline().strip()
    except OSError:
        pass
    return flashmla_vllm, f"FlashMLA sparse FP8 decode ({where}{origin})"


def fill_rows(dst, fmt, x):
    """Writes float32 latents x [n, 576] into pool rows dst [n, 1, row] as SGLang stores them."""
    rows = dst[:, 0]
    rows.view(torch.bfloat16 if fmt == "bf16" else torch.uint8).copy_(encode_rows(x, fmt))


class Pools:
    """The layers' KV pools [tokens, 1, row] (uint8 656-byte rows, float8_e4m3fn or bf16 x
    576), filled on the device a chunk at a time; layer l reads pools[l % distinct]."""

    def __init__(self, a, dev, layers, tokens):
        self.fmt, self.tokens = a.kv_format, tokens
        row = ROW_BYTES[self.fmt]
        budget = MEMORY_BUDGET
        if dev.type == "cuda":
            budget = min(budget, torch.cuda.mem_get_info(dev)[0] - HEADROOM)
        self.distinct = max(1, min(layers, int(budget // (tokens * row))))
        if self.distinct < layers:
            print(f"  {layers} pools of {tokens} tokens x {row} B do not fit in "
                  f"{budget / 1e9:.1f} GB: the layers cycle over {self.distinct}", flush=True)
        dtype, width = {"fp8_e4m3_block": (torch.uint8, 656),
                        "fp8_e4m3": (torch.float8_e4m3fn, 576),
                        "bf16": (torch.bfloat16, 576)}[self.fmt]
        gen = torch.Generator(device=dev).manual_seed(a.seed)
        self.pools = []
        for _ in range(self.distinct):
            pool = torch.empty(tokens, 1, width, dtype=dtype, device=dev)
            for start in range(0, tokens, 1 << 18):
                n = min(1 << 18, tokens - start)
                x = torch.randn(n, 576, generator=gen, device=dev).mul_(0.5)
                fill_rows(pool[start:start + n], self.fmt, x)
            self.pools.append(pool)

    def __getitem__(self, layer):
        return self.pools[layer % self.distinct]

    def cache(self, layer):
        """(ckv, kpe) as the plugin's DSA backend hands a layer's pool to SparsePlans.run."""
        pool = self[layer]
        if self.fmt == "fp8_e4m3_block":
            return pool, None
        return pool[..., :512], pool[..., 512:]


def top_k_rows(gen, dev, batch, topk, tokens, context=0):
    """int32 [batch, topk] global slots: distinct within a row (disjoint rows when the pool
    holds batch x topk tokens, as requests own their tokens; with `context`, all from one
    window of that many tokens at a random place), about INVALID_FRAC of them -1."""
    if context:
        base = int(torch.randint(0, tokens - context + 1, (1,), generator=gen, device=dev))
        rows = torch.rand(batch, context, generator=gen, device=dev).topk(topk, 1).indices + base
    elif batch * topk <= tokens:
        rows = torch.randperm(tokens, generator=gen, device=dev)[:batch * topk].view(batch, topk)
    else:
        rows = torch.rand(batch, tokens, generator=gen, device=dev).argsort(1)[:, :topk]
    drop = torch.rand(batch, topk, generator=gen, device=dev) < INVALID_FRAC
    drop[:, 0] = False
    return rows.masked_fill(drop, -1).to(torch.int32).contiguous()


class Case:
    """One (layers, heads, batch, topk) step: per-layer queries and top-k rows, outputs."""

    def __init__(self, a, dev, pools, layers, heads, batch, topk):
        self.dev, self.pools, self.layers = dev, pools, layers
        self.heads, self.batch, self.topk = heads, batch, topk
        gen = torch.Generator(device=dev).manual_seed(a.seed + 7919 * batch + 104729 * heads)
        self.q = torch.randn(layers, batch, heads, 576, generator=gen,
                             device=dev).to(torch.bfloat16)
        self.slots = torch.stack([top_k_rows(gen, dev, batch, topk, pools.tokens, a.context)
                                  for _ in range(layers)])
        self.out = torch.empty(layers, batch, heads, 512, dtype=torch.bfloat16, device=dev)
        self.out_fm = torch.empty_like(self.out)


def plugin_way(case):
    """The plugin's step: plan(), the host work of a step (SparsePlans.prepare, as the DSA
    backend's metadata step runs it; the first call makes the plan), and layers()."""
    pools = case.pools
    plans = SparsePlans(case.dev, pools.tokens, pools.fmt, torch.bfloat16)
    scales = {"ckv_scale": 1.0, "kpe_scale": 1.0} if pools.fmt == "fp8_e4m3" else {}

    def plan():
        plans.prepare(case.batch, case.heads, case.topk, SM_SCALE, pin=True)

    def layers():
        for layer in range(case.layers):
            ckv, kpe = pools.cache(layer)
            q = case.q[layer]
            plans.run(q[..., :512], q[..., 512:], ckv, kpe, case.out[layer], case.slots[layer],
                      SM_SCALE, **scales)

    return plan, layers


def padded_heads(heads):
    return 64 if heads <= 64 else 128


def flashmla_way(case, fm):
    """SGLang's flashmla_kv decode of every layer (module docstring): (layers(), the padded
    outputs [layers, bs, 1, padded heads, 512], the cache dtype), or RuntimeError naming why
    this case cannot run; case.out_fm becomes the view of the real heads. The
    cache's dtype (uint8 as FlashMLA's quantizer stores it, else the float8_e4m3fn view) is the
    first one a trial call takes."""
    bs, heads, topk = case.batch, case.heads, case.topk
    hp = padded_heads(heads)
    pools = case.pools
    out_pad = torch.empty(case.layers, bs, 1, hp, 512, dtype=torch.bfloat16, device=case.dev)

    def kernel(q_in, cache, meta, layer, out):
        fm.flash_mla_with_kvcache(q_in, cache, None, None, 512, meta, None,
                                  softmax_scale=SM_SCALE, is_fp8_kvcache=True,
                                  indices=case.slots[layer].view(bs, 1, topk), out=out)

    def view(layer, dtype):
        return pools[layer].view(dtype).view(pools.tokens // PAGE, PAGE, 1, 656)

    dtype, errors = None, []
    for candidate in (torch.uint8, torch.float8_e4m3fn):
        try:
            q_in = torch.zeros(bs, 1, hp, 576, dtype=torch.bfloat16, device=case.dev)
            kernel(q_in, view(0, candidate), fm.get_mla_metadata()[0], 0, out_pad[0])
            torch.cuda.synchronize()
            dtype = candidate
            break
        except Exception as e:  # noqa: BLE001 -- the row reports why FlashMLA did not run
            errors.append(f"{candidate}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    if dtype is None:
        raise RuntimeError("; ".join(errors))
    caches = [view(layer, dtype) for layer in range(pools.distinct)]
    case.out_fm = out_pad[:, :, 0, :heads]  # SGLang's o[:, :, :num_q_heads]: a view

    def layers():
        meta = fm.get_mla_metadata()[0]  # one a step; the first layer's call fills it
        for layer in range(case.layers):
            q = case.q[layer].view(bs, 1, heads, 576)
            if hp != heads:
                q_in = q.new_zeros(bs, 1, hp, 576)  # SGLang pads in every call
                q_in[:, :, :heads] = q
                q = q_in
            kernel(q, caches[layer % pools.distinct], meta, layer, out_pad[layer])

    return layers, out_pad, str(dtype).replace("torch.", "")


def reference_rel_l2(case, out, layers, tokens):
    """Relative L2 of out's rows (layer, token) against float64 attention over the rows the
    pool holds at the token's slots (-1 skipped)."""
    got, want = [], []
    for layer in layers:
        pool = case.pools[layer]
        raw = pool if pool.dtype == torch.bfloat16 else pool.view(torch.uint8)
        for t in tokens:
            idx = case.slots[layer, t]
            idx = idx[idx >= 0].long()
            rows = raw.index_select(0, idx)[:, 0].cpu()
            if case.pools.fmt == "fp8_e4m3":
                rows = rows.view(torch.float8_e4m3fn)
            keys = decode_rows(rows, case.pools.fmt)
            q = case.q[layer, t].cpu().double()
            p = torch.softmax(q @ keys.T * SM_SCALE, -1)
            want.append(p @ keys[:, :512])
            got.append(out[layer, t].cpu().double())
    return rel_l2(torch.stack(got), torch.stack(want))


def slot_span(slots):
    """The widest range of pool tokens one layer's slots span (-1 entries left out)."""
    spans = [int(v.max() - v.min()) + 1 for v in (layer[layer >= 0] for layer in slots)]
    return max(spans)


def synced(dev, fn):
    """fn, then a device synchronize where eager CUDA timing needs one."""
    if dev.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def run_case(a, dev, pools, fm, fm_desc, layers, heads, batch, topk):
    case = Case(a, dev, pools, layers, heads, batch, topk)
    plan, plugin_layers = plugin_way(case)
    plan()  # makes the plan (once for a batch size, before capture); not timed
    fm_layers, fm_absent, out_pad, cache_dtype = None, None, None, None
    if fm is None:
        fm_absent = fm_desc
    elif pools.fmt != "fp8_e4m3_block":
        fm_absent = f"FlashMLA's sparse FP8 decode reads the 656-byte rows only, not {pools.fmt}"
    elif heads > 128:
        fm_absent = f"{heads} heads: FlashMLA's sparse FP8 decode takes at most 128"
    else:
        try:
            fm_layers, out_pad, cache_dtype = flashmla_way(case, fm)
        except RuntimeError as e:
            fm_absent = f"flash_mla_with_kvcache failed: {e}"
    case.out.fill_(float("nan"))
    case.out_fm.fill_(float("nan"))
    if out_pad is not None:
        out_pad.fill_(float("nan"))
    plugin_layers()
    if fm_layers is not None:
        fm_layers()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    what = f"dsa layers={layers} heads={heads} bs={batch} topk={topk}"
    if not torch.isfinite(case.out).all():
        raise SystemExit(f"{what}: the plugin left unwritten (NaN) or non-finite outputs")
    if dev.type == "cuda":
        picks = torch.randperm(batch, generator=torch.Generator().manual_seed(a.seed))[:2]
        check_tokens = sorted({0, batch - 1, *picks.tolist()})
        check_layers = sorted({0, layers - 1})
    else:
        check_tokens, check_layers = list(range(batch)), list(range(layers))
    ref_err = reference_rel_l2(case, case.out, check_layers, check_tokens)
    err = fm_ref_err = None
    if fm_layers is not None:
        if not torch.isfinite(case.out_fm).all():
            raise SystemExit(f"{what}: FlashMLA left unwritten (NaN) or non-finite outputs")
        err = rel_l2(case.out, case.out_fm)
        fm_ref_err = reference_rel_l2(case, case.out_fm, check_layers, check_tokens)
    if not ref_err < TOLERANCE:
        raise SystemExit(f"{what}: the plugin's output is off (relative L2 {ref_err:.2e} "
                         "against the float64 reference)")
    if fm_layers is not None and not (err < TOLERANCE and fm_ref_err < TOLERANCE):
        raise SystemExit(f"{what}: FlashMLA's output is off (relative L2 {fm_ref_err:.2e} "
                         f"against the float64 reference, {err:.2e} against the plugin's)")
    eager_cuda = dev.type == "cuda" and a.no_graph
    plan_us = host_us(plan, max(3, a.iters))
    plugin_ms = timed(a, case, synced(dev, plugin_layers) if eager_cuda else plugin_layers)
    step = plugin_ms + plan_us / 1e3
    fm_ms = None
    if fm_layers is not None:
        fm_ms = timed(a, case, synced(dev, fm_layers) if eager_cuda else fm_layers)
    hp = padded_heads(heads) if fm_layers is not None else None
    row = dict(kind="dsa", layers=layers, heads=heads, batch=batch, topk=topk, qo_len=1,
               context=a.context, slot_span=slot_span(case.slots),
               kv_format=pools.fmt, pool_tokens=pools.tokens, distinct_pools=pools.distinct,
               invalid_frac=INVALID_FRAC, graph=dev.type == "cuda" and not a.no_graph,
               iters=a.iters, plan_host_us=round(plan_us, 1),
               plugin_layers_ms=round(plugin_ms, 3), plugin_step_ms=round(step, 3),
               flashmla_step_ms=None if fm_ms is None else round(fm_ms, 3),
               flashmla_heads=hp, speedup=None if fm_ms is None else round(fm_ms / step, 3),
               rel_l2=err, ref_rel_l2=ref_err, flashmla_ref_rel_l2=fm_ref_err,
               ref_rows=len(check_layers) * len(check_tokens),
               flashmla=fm_desc if fm_layers is not None else None, flashmla_absent=fm_absent,
               flashmla_cache_dtype=cache_dtype)
    if fm_ms is None:
        fm_text = "flashmla absent" + (f" ({fm_absent})" if fm is not None else "")
        errs = f"(rel L2 {ref_err:.1e} vs f64 ref)"
    else:
        label = f"flashmla(pad {hp})" if hp != heads else "flashmla"
        fm_text = f"{label} {fm_ms:9.3f} ms  {fm_ms / step:6.3f}x"
        errs = (f"(rel L2 {err:.1e} vs flashmla; vs f64 ref: plugin {ref_err:.1e}, "
                f"flashmla {fm_ref_err:.1e})")
    ctx = f" ctx={a.context:6d}" if a.context else ""
    print(f"dsa  L={layers:3d} heads={heads:3d} bs={batch:4d} topk={topk:5d}{ctx}  plan "
          f"{plan_us:7.1f} us  plugin {step:9.3f} ms  {fm_text}  {errs}", flush=True)
    return row


def pool_tokens(a):
    rows = a.context if a.context else max(a.batch) * max(a.topk)
    tokens = a.pool_tokens or max(MIN_POOL_TOKENS, 2 * rows)
    tokens = -(-tokens // PAGE) * PAGE
    if a.context and not max(a.topk) <= a.context <= tokens:
        raise SystemExit(f"--context {a.context}: expected topk {max(a.topk)} to the pool's "
                         f"{tokens} tokens")
    if tokens < max(a.topk):
        raise SystemExit(f"--pool-tokens {tokens}: fewer than topk {max(a.topk)} (a row's "
                         "slots are distinct)")
    return tokens


def main():
    a = parse()
    dev = torch.device(a.device)
    if dev.type == "cuda" and not (torch.cuda.is_available() and fp8mla.cuda_available()):
        raise SystemExit("--device cuda: no CUDA device, or fp8mla without its CUDA backend "
                         "(use --device cpu --no-graph)")
    fm, fm_desc = load_flashmla(dev)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    tokens = pool_tokens(a)
    print(f"fp8mla {fp8mla.version()}, torch {torch.__version__}, device {name}, kv format "
          f"{a.kv_format}, pool {tokens} tokens a layer, flashmla: "
          f"{fm_desc if fm else 'absent (' + fm_desc + ')'}", flush=True)
    rows = []
    for layers in a.layers:
        pools = Pools(a, dev, layers, tokens)
        for heads in a.heads:
            for batch in a.batch:
                for topk in a.topk:
                    rows.append(run_case(a, dev, pools, fm, fm_desc, layers, heads, batch, topk))
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
        del pools
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(command=" ".join(sys.argv), device=name,
                           fp8mla=fp8mla.version(), torch=torch.__version__,
                           flashmla=fm_desc if fm else None,
                           flashmla_absent=None if fm else fm_desc, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
