"""The peer benchmark's rows: one a (case, peer), with its status, time, bandwidth and check
error; the stdout table and the JSON document."""

import json
import math

# A peer passes its check when its output's relative L2 error against the float64 reference
# over the checked requests is at most this (bf16 outputs and bf16 P.V products: ~4e-3 is
# typical).
CHECK_REL_L2 = 2e-2


def row(case, peer, status, calls=0, us=None, bytes_per_call=None, read_ceiling_gbs=None,
        rel_l2=None, note=""):
    """One result. status: "ok", "wrong" (checked and over the bound: not timed), "error: ...",
    "not importable: ...", "not run: ..."."""
    gbs = pct = None
    if us is not None and bytes_per_call is not None and us > 0:
        gbs = bytes_per_call / (us * 1e3)
        if read_ceiling_gbs:
            pct = 100.0 * gbs / read_ceiling_gbs
    return {
        "case": case.name, "kind": case.kind, "batch": case.bs, "heads": case.heads,
        ("context" if case.kind == "dense" else "topk"): case.ctx, "page_size": case.page,
        "peer": peer, "status": status, "calls": calls, "us": us, "gbs": gbs,
        "read_pct": pct, "bytes_per_call": bytes_per_call, "check_rel_l2": rel_l2,
        "note": note,
    }


def _num(v, fmt):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, fmt)


def table(rows):
    """The rows as a text table (one line a row; a status other than ok in the last column)."""
    head = (f"{'kind':<6} {'bs':>4} {'heads':>5} {'ctx/k':>7} {'page':>4} {'peer':<10} "
            f"{'us':>9} {'GB/s':>7} {'%read':>6} {'rel_l2':>8} {'calls':>5}  status")
    lines = [head]
    for r in rows:
        ctx = r.get("context", r.get("topk"))
        lines.append(
            f"{r['kind']:<6} {r['batch']:>4} {r['heads']:>5} {ctx:>7} {r['page_size']:>4} "
            f"{r['peer']:<10} {_num(r['us'], '9.1f')} {_num(r['gbs'], '7.0f')} "
            f"{_num(r['read_pct'], '5.1f')}% {_num(r['check_rel_l2'], '8.1e')} "
            f"{r['calls']:>5}  {r['status']}{(' (' + r['note'] + ')') if r['note'] else ''}")
    return "\n".join(lines)


def document(meta, ceilings, peers, rows):
    """The JSON document (strict: NaN / inf become null): run metadata, the ceilings, each
    peer's description or load failure, the rows."""
    rows = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in r.items()} for r in rows]
    return json.dumps({"meta": meta, "ceilings": ceilings, "peers": peers, "cases": rows},
                      indent=1, allow_nan=False)
