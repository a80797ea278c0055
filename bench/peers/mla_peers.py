#!/usr/bin/env python3
"""MLA decode over FP8 latent caches: fp8mla beside FlashInfer's fa3 backend and FlashMLA's sparse
FP8 decode, on the same inputs with the same timing method, each checked against a float64
reference first.

Cases (peers_cases.py): the dense grid of `fp8mla bench` (bs/heads/ctx, pages of 64 and 1) and
the sparse top-k grid (k 2048 and 512, heads 8/16/64/128, 1-128 query tokens, slots drawn over
the whole pool with some -1 entries). Inputs (peers_inputs.py): one pool of 576-byte FP8 tokens
(default 8 GiB, far larger than L2) with per-tensor ckv/kpe scales; when a peer reads it, a
block pool of as many 656-byte block-scaled tokens (DeepSeek V3.2's layout, so the same page
tables and slots index both); bf16 queries, and per case several calls, each over its own pages
(dense) or its own random slots (sparse). Peers:

  fp8mla        576-byte pool: its FlashInfer-style wrapper (dense) and its sparse mode, -1
                entries in place
  fp8mla_block  656-byte pool (kv_format "fp8_e4m3_block"), the same two paths
  flashmla      656-byte pool: FlashMLA's sparse FP8 decode (vLLM's prebuilt FlashMLA), as
                vLLM's FLASHMLA_SPARSE backend calls it, heads below 64 padded to 64; sparse
                cases only
  flashinfer    576-byte pool: BatchMLAPagedAttentionWrapper(backend="fa3"),
                kv_data_type=float8_e4m3fn; sparse as vLLM's FLASHINFER_MLA_SPARSE_SM90 runs
                it: pages of one token, the top-k slots as the page table, kv_len = the valid
                slots (-1 entries dropped)

Each (case, peer): call 0 runs on a NaN-poisoned output and is compared with the float64
reference over the pool the peer reads on three requests (rel. L2 <= 2e-2, and every output
element written); then all calls are captured in one CUDA graph and replayed, L2 flushed between
replays (peers_timing.py). GB/s counts the cache bytes of the tokens listed (dense: bs x ctx;
sparse: the valid slots; 576 bytes a token, 656 for the block pool's peers); %read is that over
the run's own read ceiling (max of a 2 GiB device copy, read + write bytes, and a streaming sum
over 2 GiB).

A peer that does not import is reported "not importable: <reason>" in every row; a case a peer
rejects or fails is reported "error: <reason>"; nothing is skipped silently.

    python3 bench/peers/mla_peers.py [--quick] [--cases PATTERNS]
        [--peers fp8mla,fp8mla_block,flashmla,flashinfer] [--json PATH] [--time-limit SECONDS]
        [--list]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers_cases as pc  # noqa: E402
import peers_reference as ref  # noqa: E402
import peers_report as report  # noqa: E402

PEERS = ("fp8mla", "fp8mla_block", "flashmla", "flashinfer")

# The summary's pairs (a, b): lines "b/a" for the cases both checked and timed. fp8mla_block and
# flashmla read the same 656-byte tokens; fp8mla and flashinfer the same 576-byte ones.
PAIRS = (("fp8mla", "flashinfer"), ("fp8mla_block", "flashmla"), ("fp8mla", "flashmla"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller grid and fewer repeats")
    p.add_argument("--cases", default="", help="comma-separated fnmatch patterns over case "
                   "names (dense/BS/HEADS/CTX/pPAGE, sparse/BS/HEADS/kTOPK/pPAGE), or "
                   "'dense' / 'sparse'; default all")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated, some of {','.join(PEERS)} (default all)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--pool-gib", type=float, default=8.0,
                   help="576-byte FP8 pool size (default 8); the block pool, made when a peer "
                        "reads it, has as many tokens (656 bytes each)")
    p.add_argument("--calls", type=int, default=8, help="timed calls a graph (default 8)")
    p.add_argument("--reps", type=int, default=0, help="graph replays (default 20, quick 7)")
    p.add_argument("--invalid-frac", type=float, default=0.05,
                   help="share of -1 entries in sparse rows (default 0.05)")
    p.add_argument("--sparse-pages", default="1",
                   help="page sizes fp8mla sees the pool with on sparse cases (default 1; "
                        "FlashInfer always uses 1)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="start no case after this many seconds (0: no limit); the rest are "
                        "reported 'not run'")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--list", action="store_true", help="print the selected cases and exit")
    args = p.parse_args(argv)
    args.peer_list = [s.strip() for s in args.peers.split(",") if s.strip()]
    bad = [s for s in args.peer_list if s not in PEERS]
    if bad or not args.peer_list:
        p.error(f"--peers: expected some of {','.join(PEERS)}, got {args.peers!r}")
    try:
        args.sparse_page_list = tuple(int(s) for s in args.sparse_pages.split(","))
    except ValueError:
        p.error(f"--sparse-pages: expected comma-separated integers, got {args.sparse_pages!r}")
    try:
        args.selected = pc.select_cases(pc.all_cases(args.quick, args.sparse_page_list),
                                        args.cases)
    except ValueError as e:
        p.error(str(e))
    if args.reps <= 0:
        args.reps = 7 if args.quick else 20
    return args


def load_peers(names):
    """{name: (peer object or None, description or 'not importable: reason')}."""
    import peer_flashinfer
    import peer_flashmla
    import peer_fp8mla

    loaders = {"fp8mla": (peer_fp8mla.load, peer_fp8mla.Fp8mlaPeer),
               "fp8mla_block": (peer_fp8mla.load, peer_fp8mla.Fp8mlaBlockPeer),
               "flashmla": (peer_flashmla.load, peer_flashmla.FlashmlaPeer),
               "flashinfer": (peer_flashinfer.load, peer_flashinfer.FlashinferPeer)}
    peers = {}
    for name in names:
        load, cls = loaders[name]
        try:
            module, desc = load()
            peers[name] = (cls(module), desc)
        except Exception as e:  # ImportError, or a broken install failing at import
            peers[name] = (None, f"not importable: {type(e).__name__}: {first_line(e)}")
    return peers


def reads_block_pool(peers):
    """Whether a loaded peer reads the 656-byte block pool (its `pool` attribute "block")."""
    return any(p is not None and getattr(p, "pool", "fp8") == "block" for p, _ in peers.values())


def first_line(e):
    text = str(e).strip()
    return (text.splitlines()[0] if text else repr(e))[:300]


def run_case(torch, case, pool, peers, args, ceilings, timer, sync, block_pool=None):
    """The rows of one case, one a requested peer. timer(runs) -> microseconds a call (the
    CUDA-graph timing on the device); sync() waits for the device. block_pool: the 656-byte
    pool the peers with pool = "block" read (None when none is selected).

    A peer may define publish(inputs): called after the check's call, outside the timed calls,
    it copies what the peer wrote into its own buffers (e.g. a head-padded output) into
    inputs.out for the check."""
    import peers_inputs

    rows = []
    try:
        inputs = peers_inputs.CaseInputs(torch, case, pool, args.calls,
                                         args.seed + hash_case(case), args.invalid_frac,
                                         block_pool=block_pool)
        requests = pc.check_requests(case.bs)
    except Exception as e:  # the case's inputs (e.g. a pool too small for one call)
        why = f"error: inputs: {type(e).__name__}: {first_line(e)}"
        return [report.row(case, name, why) for name in args.peer_list]
    refs = {}  # the float64 reference over each pool, made when a peer first needs it
    for name in args.peer_list:
        peer, desc = peers[name]
        if peer is None:
            rows.append(report.row(case, name, desc))
            continue
        runs = None
        try:
            kind = getattr(peer, "pool", "fp8")
            if kind not in refs:
                refs[kind] = inputs.reference(requests, kind)[0]
            t0 = time.time()
            runs = peer.prepare(inputs)
            prep_s = time.time() - t0
            inputs.poison_out()
            runs[0]()
            sync()
            if hasattr(peer, "publish"):
                peer.publish(inputs)
                sync()
            got, finite = inputs.output_rows(requests)
            err = ref.rel_l2(got, refs[kind])
            notes = [f"kernel {peer.kernel_name}"] if getattr(peer, "kernel_name", None) else []
            if getattr(peer, "note", None):
                notes.append(peer.note)
            if prep_s >= 1.0:
                notes.append(f"plan {prep_s:.1f} s")
            note = ", ".join(notes)
            if not finite or not err <= report.CHECK_REL_L2:
                why = "unwritten or NaN output elements" if not finite else \
                    f"rel_l2 {err:.2e} > {report.CHECK_REL_L2}"
                rows.append(report.row(case, name, f"wrong: {why}; not timed", inputs.calls,
                                       rel_l2=err, note=note))
                continue
            us = timer(runs)
            rows.append(report.row(case, name, "ok", inputs.calls, us, inputs.bytes_for(kind),
                                   ceilings["read_ceiling_gbs"], err, note))
        except Exception as e:
            rows.append(report.row(case, name, f"error: {type(e).__name__}: {first_line(e)}",
                                   inputs.calls))
        finally:
            del runs
    return rows


def hash_case(case):
    return sum(ord(ch) * (i + 1) for i, ch in enumerate(case.name)) % 100003


def speedups(rows):
    """Lines 'case: A X us, B Y us, B/A Y/X' for each pair of PAIRS both checked and timed on a
    case, grouped by pair."""
    by = {}
    for r in rows:
        if r["status"] == "ok":
            by.setdefault(r["case"], {})[r["peer"]] = r["us"]
    lines = []
    for a, b in PAIRS:
        for case, us in by.items():
            if a in us and b in us:
                lines.append(f"  {case:<28} {a} {us[a]:8.1f} us  {b} {us[b]:8.1f} us  "
                             f"{b}/{a} {us[b] / us[a]:.2f}")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        for c in args.selected:
            print(c.name)
        return 0
    start = time.time()
    import torch

    if not torch.cuda.is_available():
        print("mla_peers: no CUDA device is visible (the peers are timed on a GPU)",
              file=sys.stderr)
        return 2
    import peers_inputs
    import peers_timing

    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    peers = load_peers(args.peer_list)
    for name in args.peer_list:
        print(f"peer {name}: {peers[name][1]}")
    ceilings = peers_timing.measure_ceilings(torch, device)
    print(f"ceilings: device copy {ceilings['copy_gbs']:.0f} GB/s (read + write), streaming "
          f"sum {ceilings['sum_read_gbs']:.0f} GB/s -> read ceiling "
          f"{ceilings['read_ceiling_gbs']:.0f} GB/s")
    tokens = int(args.pool_gib * (1 << 30)) // pc.TOKEN_BYTES // 64 * 64
    t0 = time.time()
    pool = peers_inputs.make_pool(torch, device, tokens, args.seed)
    torch.cuda.synchronize()
    print(f"pool: {tokens} tokens x {pc.TOKEN_BYTES} B = {tokens * pc.TOKEN_BYTES / 2**30:.2f} "
          f"GiB of e4m3 codes, ckv_scale {peers_inputs.CKV_SCALE}, kpe_scale "
          f"{peers_inputs.KPE_SCALE} (filled in {time.time() - t0:.1f} s)")
    block_pool = None
    if reads_block_pool(peers):
        t0 = time.time()
        block_pool = peers_inputs.make_block_pool(torch, device, tokens, args.seed + 1)
        torch.cuda.synchronize()
        print(f"block pool: {tokens} tokens x {pc.BLOCK_TOKEN_BYTES} B = "
              f"{tokens * pc.BLOCK_TOKEN_BYTES / 2**30:.2f} GiB (512 e4m3, 4 float32 power-of-two "
              f"scales, 64 bf16 a token; filled in {time.time() - t0:.1f} s)")
    flush = torch.empty(peers_timing.l2_flush_bytes(torch, device), dtype=torch.uint8,
                        device=device)

    rows = []
    for i, case in enumerate(args.selected):
        if args.time_limit and time.time() - start > args.time_limit:
            for name in args.peer_list:
                rows.append(report.row(case, name, f"not run: --time-limit {args.time_limit:g} s"))
            continue
        t = time.time()
        case_rows = run_case(torch, case, pool, peers, args, ceilings,
                             lambda runs: peers_timing.time_calls(torch, runs, args.reps, flush),
                             torch.cuda.synchronize, block_pool)
        rows.extend(case_rows)
        brief = ", ".join(f"{r['peer']} " + (f"{r['us']:.1f} us" if r["status"] == "ok"
                                             else r["status"][:60]) for r in case_rows)
        print(f"[{i + 1}/{len(args.selected)}] {case.name}: {brief} ({time.time() - t:.1f} s)",
              file=sys.stderr, flush=True)
        torch.cuda.empty_cache()

    print()
    print(report.table(rows))
    lines = speedups(rows)
    if lines:
        print("\nsame cases, both checked and timed (fp8mla_block and flashmla read the same "
              "656-byte tokens, fp8mla and flashinfer the same 576-byte ones):")
        print("\n".join(lines))
    meta = {
        "device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "cuda": torch.version.cuda, "argv": sys.argv[1:] if argv is None else list(argv),
        "pool_tokens": tokens, "pool_bytes": tokens * pc.TOKEN_BYTES,
        "block_pool_bytes": tokens * pc.BLOCK_TOKEN_BYTES if block_pool is not None else 0,
        "ckv_scale": peers_inputs.CKV_SCALE, "kpe_scale": peers_inputs.KPE_SCALE,
        "sm_scale": peers_inputs.SM_SCALE, "calls": args.calls, "reps": args.reps,
        "invalid_frac": args.invalid_frac, "check_rel_l2": report.CHECK_REL_L2,
        "l2_flush_bytes": flush.numel(), "seconds": time.time() - start,
        "timing": "CUDA graph of the calls, median replay / calls, L2 flushed between replays",
    }
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.document(meta, ceilings,
                                    {n: peers[n][1] for n in args.peer_list}, rows))
        print(f"\nwrote {args.json}")
    print(f"total {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
