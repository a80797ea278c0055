#!/usr/bin/env python3
"""Writes a large Chrome trace by repeating the profiled steps of a real one, for measuring how
fast `fp8mla audit` reads (a real server's trace of hundreds of MB is not something to commit).

The events of every ProfilerStep of TEMPLATE (with the step markers) are copied again and again,
each copy shifted in time past the last and given fresh External ids, until the JSON reaches
--size MB. The layout follows torch.profiler's export_chrome_trace (one key a line).

  python scripts/synthetic_trace.py tests/audit/traces/cpu_cast.trace.json.gz /tmp/big.json --size 500
  python scripts/synthetic_trace.py TEMPLATE OUT.json.gz --size 500      # gzip by the name
"""

import argparse
import copy
import gzip
import json
import sys


def load(path):
    opener = gzip.open if open(path, "rb").read(2) == b"\x1f\x8b" else open
    with opener(path, "rt") as f:
        return json.load(f)


def dump_event(e):
    # torch writes each event as an indented object, one field a line.
    return "  " + json.dumps(e, indent=4).replace("\n", "\n  ")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("template", help="a Chrome trace with ProfilerStep#N markers (.json or .gz)")
    p.add_argument("out", help="the trace to write (.gz: gzip-compressed)")
    p.add_argument("--size", type=float, default=500, help="MB of JSON to write (default 500)")
    args = p.parse_args(argv)

    trace = load(args.template)
    events = trace["traceEvents"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    if not steps:
        sys.exit(f"{args.template}: no ProfilerStep#N markers to repeat")
    first, last = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    body = [e for e in events if e.get("ph") == "X" and first <= e["ts"] < last]
    head = [e for e in events if e.get("ph") != "X"]
    period = last - first
    ext_span = 1 + max((e.get("args", {}).get("External id", 0) for e in body), default=0)
    top = {k: v for k, v in trace.items() if k != "traceEvents"}

    target = int(args.size * 1e6)
    opener = gzip.open if args.out.endswith(".gz") else open
    with opener(args.out, "wt") as f:
        text = json.dumps(top, indent=2)[:-2]  # drop the closing "\n}"
        f.write(text + ',\n  "traceEvents": [\n')
        written = len(text)
        first_event = True
        for e in head:
            f.write(("" if first_event else ",\n") + dump_event(e))
            first_event = False
        copies, step_no = 0, 0
        while written < target:
            for e in body:
                c = copy.deepcopy(e)
                c["ts"] = e["ts"] + copies * period
                a = c.get("args")
                if a and "External id" in a:
                    a["External id"] += copies * ext_span
                if c["name"].startswith("ProfilerStep#"):
                    step_no += 1
                    c["name"] = f"ProfilerStep#{step_no}"
                s = ",\n" + dump_event(c)
                f.write(s)
                written += len(s)
            copies += 1
        f.write('\n  ]\n}\n')
    print(f"{args.out}: {written / 1e6:.0f} MB of JSON, {copies} copies of {len(body)} events "
          f"({step_no} steps)")


if __name__ == "__main__":
    main()
