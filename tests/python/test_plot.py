"""fp8mla.plot: the PNG pictures of bench, demo and audit JSON, drawn with matplotlib.

The bench picture is drawn from the committed H200 grid (tests/audit/plot/h200_bench.json); the
demo and audit pictures from JSON the command writes in the test (FP8MLA_CLI names the binary;
scripts/test.sh sets it), so a change of the command's JSON that the module does not follow
fails here. Each test checks what is drawn (points, bar heights, the cast's colour) against the
JSON, then the PNG itself (size, not blank).
"""

import json
import os
import subprocess

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.colors import to_hex  # noqa: E402

import fp8mla.plot as plot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.environ.get("FP8MLA_CLI", "")
BENCH = os.path.join(ROOT, "tests", "audit", "plot", "h200_bench.json")
TRACES = os.path.join(ROOT, "tests", "audit", "traces", "cpu")


def cli(*args):
    if not (CLI and os.access(CLI, os.X_OK)):
        pytest.skip("FP8MLA_CLI does not name the fp8mla binary (scripts/test.sh sets it)")
    subprocess.run([CLI, *args], check=True, stdout=subprocess.DEVNULL, timeout=600)


def check_png(path, size):
    from PIL import Image  # matplotlib depends on pillow

    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size == size
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20, "the image is blank or nearly so"


def bars(ax):
    """The axes' bar containers, in the order they were drawn."""
    from matplotlib.container import BarContainer

    return [c for c in ax.containers if isinstance(c, BarContainer)]


def test_bench_roofline_has_every_timed_case(tmp_path):
    with open(BENCH) as f:
        r = json.load(f)
    timed = [c for c in r["cases"] if c["us"] > 0 and c["gbs"] > 0 and c["tfs"] > 0]
    fig = plot.figure(BENCH)
    (ax,) = fig.axes
    points = [p for coll in ax.collections for p in coll.get_offsets()]
    assert len(points) == len(timed)
    # Each point sits at the case's achieved TF/s and its flops per byte.
    got = sorted((float(y), float(x)) for x, y in points)
    want = sorted((c["tfs"], c["tfs"] * 1e3 / c["gbs"]) for c in timed)
    assert [v for pair in got for v in pair] == pytest.approx([v for pair in want for v in pair])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"streaming read {r['ceilings']['read_gbs']:.0f} GB/s" in labels
    assert any(label.startswith("cast_pool") for label in labels)
    out = tmp_path / "roofline.png"
    assert plot.save(BENCH, out) == str(out)
    check_png(out, (1100, 650))


def test_bench_sparse_rows_are_series_of_their_own(tmp_path):
    # A hand-written run with dense rows and `bench --sparse` rows (sparse, topk, check null).
    fixture = os.path.join(ROOT, "tests", "audit", "plot", "sparse_bench_fixture.json")
    with open(fixture) as f:
        r = json.load(f)
    fig = plot.figure(fixture)
    (ax,) = fig.axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "sparse shared_tile fp8_e4m3_block (1)" in labels
    assert "native shared_tile fp8_e4m3_block (1)" in labels
    assert "sparse fp8_exact fp8_e4m3 (1)" in labels and "sparse wide_rows fp8_e4m3 (1)" in labels
    points = [p for coll in ax.collections for p in coll.get_offsets()]
    assert len(points) == len(r["cases"])
    plot.save(r, tmp_path / "sparse.png")
    check_png(tmp_path / "sparse.png", (1100, 650))


def test_demo_draws_each_layer_and_the_step(tmp_path):
    out = tmp_path / "demo.json"
    cli("demo", "--layers", "3", "--batch", "2", "--context", "128", "--pool", "2048",
        "--no-progress", "--json", str(out))
    with open(out) as f:
        r = json.load(f)
    fig = plot.figure(r)
    top, bottom = fig.axes[:2]
    layer_bars = bars(top)
    assert len(layer_bars) == 5  # cast, its attention, gather, its attention, native
    native = [p.get_height() for p in layer_bars[4]]
    assert native == pytest.approx([l["native_ms"] for l in r["per_layer"]])
    cast = layer_bars[0]
    assert [p.get_height() for p in cast] == pytest.approx([l["cast_ms"] for l in r["per_layer"]])
    assert to_hex(cast[0].get_facecolor()) == "#d62728" and cast[0].get_hatch() == "//"
    # The step's bars end at each strategy's measured step time.
    ends = {}
    for c in bars(bottom):
        for p in c:
            y = round(p.get_y() + p.get_height() / 2)
            ends[y] = max(ends.get(y, 0.0), p.get_x() + p.get_width())
    assert [ends[0], ends[1], ends[2]] == pytest.approx(
        [r["step_ms"]["cast"], r["step_ms"]["gather"], r["step_ms"]["native"]])
    png = tmp_path / "demo.png"
    plot.save(r, png)
    check_png(png, (1200, 750))


@pytest.mark.parametrize("strategy", ["cast", "native"])
def test_audit_highlights_the_cast(tmp_path, strategy):
    out = tmp_path / f"{strategy}.json"
    cli("audit", os.path.join(TRACES, f"{strategy}.trace.json.gz"), "--json", str(out))
    with open(out) as f:
        r = json.load(f)
    fig = plot.figure(out)
    (ax,) = [a for a in fig.axes if a.get_legend() is not None]
    stacks = bars(ax)
    assert len(stacks) == len(plot.AUDIT_CATEGORIES)
    cast = stacks[plot.AUDIT_CATEGORIES.index("cast_copy")]
    assert [p.get_height() for p in cast] == pytest.approx([s["ms"]["cast_copy"] for s in r["steps"]])
    assert to_hex(cast[0].get_facecolor()) == "#d62728" and cast[0].get_hatch() == "//"
    # The verdict is in the picture: the cast's share in the cast trace, none in the native one.
    assert ax.get_title().replace("\n", " ") == r["verdict"]
    share = sum(p.get_height() for p in cast) / sum(s["busy_ms"] for s in r["steps"])
    if strategy == "cast":
        assert r["kv_cast"]["found"] and share > 0.5
    else:
        assert not r["kv_cast"]["found"] and share < 0.2
    png = tmp_path / f"{strategy}.png"
    plot.save(r, png)
    check_png(png, (1100, 650))


def test_bad_input_is_named(tmp_path, capsys):
    with pytest.raises(ValueError, match="results: not the JSON of fp8mla"):
        plot.figure({"command": "plot"})
    with pytest.raises(TypeError, match="results: expected a dict or a path"):
        plot.figure(3)
    with pytest.raises(ValueError, match="out: expected a .png"):
        plot.save(BENCH, tmp_path / "x.bmp")
    empty = {"ceilings": {"read_gbs": 1.0}, "cases": [{"us": 0, "gbs": 0, "tfs": 0}]}
    with pytest.raises(ValueError, match="no case with a time"):
        plot.figure(empty)
    assert plot.main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x.png")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert plot.main([BENCH, "--out", str(tmp_path / "ok.png")]) == 0
    assert os.path.getsize(tmp_path / "ok.png") > 10000
