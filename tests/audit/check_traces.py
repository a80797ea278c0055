#!/usr/bin/env python3
"""Runs `fp8mla audit` on recorded traces and checks what it finds against the profiler's own
figures recorded beside each trace (scripts/record_traces.py writes NAME.expected.json next to
NAME.trace.json.gz). Python's standard library only.

  python3 tests/audit/check_traces.py FP8MLA_BINARY TRACE_DIR [TRACE_DIR ...]

For each trace:
  - the steps audit finds are the profiler's steps (their count; on the CPU their times
    within 0.5%);
  - cast and gather traces: a KV cast is found, of that kind ("pool" / "gather"), once per layer
    in every step; its time a step (with the gathers) within 2% + 0.05 ms of the profiler's
    own total of those ops; its share of the step within 1 percentage point; with shapes, its
    bytes exactly what the cast reads and writes; without, no bytes claimed;
  - native traces: nothing flagged.
Exit status 0 when every check passes; prints one line per trace and every failure.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

TIME_REL_TOL = 0.02   # audit's KV cast time against the profiler's event list
TIME_ABS_TOL = 0.05   # ms: timestamps are rounded to ns in the trace
SHARE_TOL = 0.01      # share of the step, absolute
STEP_REL_TOL = 0.005  # CPU step times: the same ProfilerStep events


def expected_kind(strategy):
    return {"cast": "pool", "gather": "gather"}.get(strategy)


def check_trace(binary, trace, expected):
    failures = []

    def need(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "audit.json")
        run = subprocess.run([binary, "audit", trace, "--json", out], capture_output=True,
                             text=True)
        if run.returncode != 0:
            return [f"fp8mla audit exited {run.returncode}: {run.stderr.strip()}"]
        with open(out) as f:
            got = json.load(f)

    exp_steps = expected["steps"]
    steps = got["steps"]
    need(len(steps) == len(exp_steps), f"{len(steps)} steps found, the profiler has "
                                       f"{len(exp_steps)}")
    cuda = expected["device"] == "cuda"
    need(got["measured_on"] == ("gpu" if cuda else "cpu"), f"measured on {got['measured_on']}")
    need(got["step_source"] == "ProfilerStep markers", f"steps from {got['step_source']}")
    need(got["record_shapes"] == expected["record_shapes"],
         f"record_shapes {got['record_shapes']}, recorded {expected['record_shapes']}")
    kind = expected_kind(expected["strategy"])
    kv = got["kv_cast"]
    if kind is None:
        need(not kv["found"], f"a KV cast flagged in a {expected['strategy']} trace: {kv}")
        return failures
    need(kv["found"], "no KV cast found")
    if not kv["found"]:
        return failures
    need(kv["kind"] == kind, f"kind {kv['kind']}, expected {kind}")
    need(kv["per_step"] == expected["layers"], f"{kv['per_step']} casts a step, expected "
                                               f"{expected['layers']} (one a layer)")
    suffix = "device_us" if cuda else "cpu_us"
    for i, (s, e) in enumerate(zip(steps, exp_steps)):
        wall = (e["end_us"] - e["start_us"]) / 1e3
        if not cuda:
            need(abs(s["wall_ms"] - wall) <= STEP_REL_TOL * wall,
                 f"step {i}: {s['wall_ms']:.3f} ms, the profiler's {wall:.3f} ms")
        need(s["kv_casts"] == e["kv_casts"], f"step {i}: {s['kv_casts']} KV casts, the "
                                             f"profiler's event list has {e['kv_casts']}")
        want = (e["kv_cast_" + suffix] + e["kv_gather_" + suffix]) / 1e3
        have = s["kv_cast_ms"] + s["kv_gather_ms"]
        need(abs(have - want) <= TIME_REL_TOL * want + TIME_ABS_TOL,
             f"step {i}: KV cast {have:.3f} ms, the profiler's {want:.3f} ms")
        if not cuda:
            need(abs(s["kv_share"] - want / wall) <= SHARE_TOL,
                 f"step {i}: share {s['kv_share']:.4f}, the profiler's {want / wall:.4f}")
        if expected["record_shapes"]:
            want_bytes = e["kv_casts"] * e["kv_cast_bytes_each"]
            need(s["kv_cast_bytes"] == want_bytes,
                 f"step {i}: {s['kv_cast_bytes']} bytes cast, expected {want_bytes}")
        else:
            need(s["kv_cast_bytes"] == 0, f"step {i}: bytes claimed without shapes")
    if not expected["record_shapes"]:
        need(kv["bytes_each"] < 0, "bytes_each claimed without shapes")
    return failures


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    binary, dirs = argv[1], argv[2:]
    checked, failed = 0, 0
    for d in dirs:
        for trace in sorted(glob.glob(os.path.join(d, "*.trace.json.gz")) +
                            glob.glob(os.path.join(d, "*.trace.json"))):
            stem = trace[: trace.index(".trace.json")]
            exp_path = stem + ".expected.json"
            if not os.path.exists(exp_path):
                print(f"SKIP {trace}: no {os.path.basename(exp_path)}")
                continue
            with open(exp_path) as f:
                expected = json.load(f)
            failures = check_trace(binary, trace, expected)
            checked += 1
            if failures:
                failed += 1
                print(f"FAIL {trace}")
                for what in failures:
                    print(f"     {what}")
            else:
                print(f"ok   {trace} ({expected['strategy']}, {expected['device']}, "
                      f"shapes {expected['record_shapes']})")
    if checked == 0:
        print("no traces with expected figures found")
        return 1
    print(f"{checked - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
