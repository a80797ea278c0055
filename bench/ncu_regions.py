#!/usr/bin/env python3
"""Where a kernel's warps wait, per loop region, from ncu's SASS-level source page.

Usage: ncu --import REPORT --page source --csv --print-source sass > sass.csv
       python3 bench/ncu_regions.py sass.csv [TOP]

Prints the total stall samples; then each run of SASS lines executed at least ITER times
(default 31000: once a warp and 64-token block in the 64/128/4096 case, 512 warps x 64 blocks
minus the last blocks' skipped branches) with its samples and instructions a warp and block
(executions / 32768); then the TOP (default 15) lines by samples with their two main stall
reasons. Used for the 17-64-row kernels' stall profiles (docs/design/wide_rows.md).
"""
import csv
import sys

ITER = 31000
PER_BLOCK = 32768


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    top_n = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    hdr, data = rows[1], rows[2:]
    src = hdr.index("Source")
    samples = hdr.index("Warp Stall Sampling (All Samples)")
    execs = hdr.index("Instructions Executed")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]

    def num(r, i):
        return int(r[i] or 0)

    print("total", sum(num(r, samples) for r in data))
    regions, cur = [], None
    for i, r in enumerate(data):
        if num(r, execs) >= ITER:
            cur = [i, i] if cur is None else [cur[0], i]
        elif cur is not None and i - cur[1] > 3:
            regions.append(cur)
            cur = None
    if cur:
        regions.append(cur)
    for a, b in regions:
        s = sum(num(data[i], samples) for i in range(a, b + 1))
        n = sum(num(data[i], execs) for i in range(a, b + 1)) / PER_BLOCK
        print(a, b, "samples", s, "instr/warp/block %.0f" % n, data[a][src].strip()[:40])
    top = sorted(range(len(data)), key=lambda i: -num(data[i], samples))[:top_n]
    for i in sorted(top):
        r = data[i]
        why = sorted(((num(r, hdr.index(s)), s) for s in stalls), reverse=True)[:2]
        print(i, r[src].strip()[:60], r[samples], r[execs], why)


if __name__ == "__main__":
    main()
