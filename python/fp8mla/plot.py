"""PNG pictures of the command's JSON results, drawn with matplotlib.

`fp8mla bench --json`, `fp8mla demo --json` and `fp8mla audit --json` write results that the
command itself draws as SVG (`--plot FILE.svg`, `fp8mla plot`). This module draws the same three
pictures as PNG (or any format matplotlib writes, chosen by the file's extension) for users who
have matplotlib and want a raster image, e.g. in a notebook:

    python -m fp8mla.plot bench.json --out roofline.png
    python -m fp8mla.plot demo.json --out demo.png
    python -m fp8mla.plot audit.json --out audit.png

    import fp8mla.plot
    fig = fp8mla.plot.figure("audit.json")    # a matplotlib Figure, not shown or saved

matplotlib is optional (`pip install fp8mla[plot]`); it is imported only here, and without it
figure() and save() raise ImportError saying so. Only the object-oriented API is used (no
pyplot), so drawing changes no global matplotlib state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["load", "kind", "figure", "save", "main"]

# The audit's categories, in the order the command's SVG stacks them; the cast is the one the
# picture is about, drawn red and hatched.
AUDIT_CATEGORIES = ("attention", "cast_copy", "gemm", "communication", "other")
AUDIT_COLOURS = {"attention": "#1f77b4", "cast_copy": "#d62728", "gemm": "#2ca02c",
                 "communication": "#9467bd", "other": "#b0b0b0"}
STRATEGY_MARKERS = {"native": "o", "gather_cast": "^", "cast_pool": "x", "sparse": "D"}


def _matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("fp8mla.plot needs matplotlib (pip install matplotlib, or "
                          "pip install fp8mla[plot]); the fp8mla command draws SVG without it "
                          "(--plot FILE.svg)") from e
    return Figure


def load(results) -> dict:
    """The results as a dict: a dict is returned as is, a path (str / PathLike) is read as JSON."""
    if isinstance(results, dict):
        return results
    if not isinstance(results, (str, os.PathLike)):
        raise TypeError(f"results: expected a dict or a path to a JSON file, got "
                        f"{type(results).__name__}")
    with open(results, encoding="utf-8") as f:
        return json.load(f)


def kind(results: dict) -> str:
    """'bench', 'demo' or 'audit': which command wrote the results."""
    command = results.get("command")
    if command in ("demo", "audit"):
        return command
    if "cases" in results and "ceilings" in results:
        return "bench"
    raise ValueError("results: not the JSON of fp8mla bench, demo or audit (expected "
                     "'command': 'demo' or 'audit', or 'ceilings' and 'cases'; got keys "
                     f"{sorted(results)[:8]})")


def _bench(fig, r: dict) -> None:
    ax = fig.add_subplot(1, 1, 1)
    ceil = r["ceilings"]
    read, copy, mm = ceil.get("read_gbs"), ceil.get("copy_gbs"), ceil.get("matmul_bf16_tfs")
    series: dict = {}
    for c in r["cases"]:
        if not (c.get("us", 0) > 0 and c.get("gbs", 0) > 0 and c.get("tfs", 0) > 0):
            continue  # a case that did not run (or did not finish) has no point
        # Sparse top-k rows (bench --sparse) are series of their own, as the command draws them.
        strategy = "sparse" if c.get("sparse") else c["strategy"]
        name = strategy if strategy == "gather_cast" or strategy == "cast_pool" else \
            f"{strategy} {c.get('kernel', '')}".strip()
        label = f"{name} {c['format']}"
        intensity = c["tfs"] * 1e12 / (c["gbs"] * 1e9)  # attention flops per KV byte moved
        xs, ys, marker = series.setdefault(label, ([], [], STRATEGY_MARKERS.get(strategy, "s")))
        xs.append(intensity)
        ys.append(c["tfs"])
    if not series:
        raise ValueError("results: the bench JSON has no case with a time")
    for label, (xs, ys, marker) in series.items():
        ax.scatter(xs, ys, marker=marker, label=f"{label} ({len(xs)})", alpha=0.85)
    lo = min(min(xs) for xs, _, _ in series.values()) / 2
    hi = max(max(xs) for xs, _, _ in series.values()) * 2
    grid = [lo * (hi / lo) ** (i / 63) for i in range(64)]
    for gbs, style, name in ((read, "-", "streaming read"), (copy, "--", "device copy")):
        if gbs:
            roof = [min(x * gbs * 1e9 / 1e12, mm) if mm else x * gbs * 1e9 / 1e12 for x in grid]
            ax.plot(grid, roof, style, color="#444", linewidth=1.2, label=f"{name} {gbs:.0f} GB/s")
    if mm:
        ax.axhline(mm, color="#444", linewidth=0.8, linestyle=":", label=f"bf16 matmul {mm:.0f} TF/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (attention flops per KV byte moved)")
    ax.set_ylabel("achieved TF/s")
    device = r.get("device")
    device = device.get("name", "") if isinstance(device, dict) else (device or "")
    ax.set_title(f"fp8mla bench: decode attention against the measured ceilings {device}".strip())
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _demo(fig, r: dict) -> None:
    layers = r["per_layer"]
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [2, 1]})
    n = len(layers)
    w = 0.28
    xs = range(n)
    cast = [l["cast_ms"] for l in layers]
    cast_att = [l["cast_attend_ms"] for l in layers]
    gather = [l["gather_ms"] for l in layers]
    gather_att = [l["gather_attend_ms"] for l in layers]
    native = [l["native_ms"] for l in layers]
    top.bar([x - w for x in xs], cast, w, color="#d62728", hatch="//", label="cast of the whole pool")
    top.bar([x - w for x in xs], cast_att, w, bottom=cast, color="#1f77b4", label="attention on bf16")
    top.bar(list(xs), gather, w, color="#e377c2", label="gather + cast of the batch's pages")
    top.bar(list(xs), gather_att, w, bottom=gather, color="#1f77b4")
    top.bar([x + w for x in xs], native, w, color="#17becf", label="attention on FP8 (fp8mla)")
    top.set_xticks(list(xs) if n <= 16 else list(range(0, n, max(1, n // 10))))
    top.set_xlabel("layer")
    top.set_ylabel("ms a layer")
    top.set_title("each layer: (1) cast pool + attend, (2) gather + attend, (3) native")
    top.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    step = r["step_ms"]
    by = r.get("bytes_per_layer", {})
    names = ("cast", "gather", "native")
    labels = ("(1) cast pool, attend bf16", "(2) gather+cast, attend bf16", "(3) native FP8 (fp8mla)")
    converts = (sum(cast), sum(gather), 0.0)  # the step's conversion time, layer by layer
    for i, (name, label, conv) in enumerate(zip(names, labels, converts)):
        total = step[name]
        first = min(conv, total)
        colour = {"cast": "#d62728", "gather": "#e377c2", "native": "#17becf"}[name]
        bottom.barh(i, first, color=colour, hatch="//" if name == "cast" else None)
        bottom.barh(i, total - first, left=first, color="#1f77b4" if name != "native" else colour)
        gb = by.get(name, 0) * len(layers) / 1e9
        bottom.text(total, i, f" {total:.1f} ms, {gb:.2f} GB", va="center", fontsize=8)
    bottom.set_yticks(range(3), labels)
    bottom.invert_yaxis()
    bottom.set_xlabel("ms a step")
    bottom.set_xlim(0, max(step[n_] for n_ in names) * 1.35)
    fig.suptitle(f"fp8mla demo: one decode step of {r.get('model', '?')}, three ways "
                 f"({r.get('device', '?')}, {r.get('format', '?')}, {r.get('batch', '?')} requests)")


def _audit(fig, r: dict) -> None:
    steps = r["steps"]
    if not steps:
        raise ValueError("results: the audit found no steps to draw")
    ax = fig.add_subplot(1, 1, 1)
    xs = list(range(len(steps)))
    base = [0.0] * len(steps)
    for cat in AUDIT_CATEGORIES:
        h = [s["ms"].get(cat, 0.0) for s in steps]
        label = "dtype casts and copies" if cat == "cast_copy" else cat
        ax.bar(xs, h, 0.6, bottom=base, color=AUDIT_COLOURS[cat],
               hatch="//" if cat == "cast_copy" else None, label=label)
        base = [b + x for b, x in zip(base, h)]
    ax.set_xticks(xs, [s.get("label", str(i)) for i, s in enumerate(steps)],
                  rotation=30 if len(steps) > 6 else 0, fontsize=7)
    ax.set_ylabel("ms a step (kernel time by category)")
    fig.suptitle("fp8mla audit: " + os.path.basename(str(r.get("trace", ""))))
    verdict = r.get("verdict", "")
    if verdict:
        ax.set_title("\n".join(_wrap(verdict, 130)), fontsize=8)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _wrap(text: str, width: int) -> list:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def figure(results):
    """A matplotlib Figure of bench, demo or audit results (a dict, or a path to their JSON)."""
    r = load(results)
    which = kind(r)
    Figure = _matplotlib()
    fig = Figure(figsize=(11, 6.5) if which != "demo" else (12, 7.5), dpi=100,
                 layout="constrained")
    {"bench": _bench, "demo": _demo, "audit": _audit}[which](fig, r)
    return fig


def save(results, out) -> str:
    """Draws the results and writes them to `out` (format from its extension: .png, .pdf, .svg)."""
    ext = os.path.splitext(str(out))[1].lower()
    if ext not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
        raise ValueError(f"out: expected a .png, .pdf, .svg or .jpg file name, got {str(out)!r}")
    figure(results).savefig(out)
    return str(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp8mla.plot",
                                description="Draw the JSON of fp8mla bench, demo or audit as PNG "
                                            "with matplotlib.")
    p.add_argument("results", help="JSON written by fp8mla bench/demo/audit --json")
    p.add_argument("--out", required=True, help="image to write (.png, .pdf, .svg, .jpg)")
    a = p.parse_args(argv)
    try:
        path = save(a.results, a.out)
    except (OSError, ValueError, KeyError, ImportError) as e:
        print(f"python -m fp8mla.plot: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
