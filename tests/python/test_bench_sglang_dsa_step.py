"""bench/sglang_dsa_step.py's smoke test on the CPU: tiny sizes, eager (no CUDA graph), the
plugin's DSA step (SparsePlans over per-layer 656-byte pools, per-layer queries and top-k rows
with -1 entries) against the bench's float64 reference, FlashMLA absent (no CUDA), and the JSON
written. Batch 5 x top-k 64 exceeds the 256-token pool, so its rows are drawn per row (distinct
within a row, shared across rows) rather than as disjoint slices of one permutation. The
timings it prints are CPU timings and mean nothing; the device run is the lead's."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KEYS = {"kind", "layers", "heads", "batch", "topk", "qo_len", "context", "slot_span",
        "kv_format", "pool_tokens", "distinct_pools", "invalid_frac", "graph", "iters",
        "plan_host_us", "plugin_layers_ms", "plugin_step_ms", "flashmla_step_ms", "flashmla_heads",
        "speedup", "rel_l2", "ref_rel_l2", "flashmla_ref_rel_l2", "ref_rows", "flashmla",
        "flashmla_absent", "flashmla_cache_dtype"}


def test_dsa_step_bench_runs_and_the_plugin_matches_the_reference(tmp_path):
    out = tmp_path / "dsa_step.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_dsa_step.py"), "--device", "cpu",
           "--no-graph", "--layers", "2", "--heads", "4", "8", "--batch", "2", "5", "--topk",
           "64", "--pool-tokens", "250", "--iters", "1", "--seed", "3", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["flashmla"] is None and "not CUDA" in result["flashmla_absent"]
    rows = result["rows"]
    assert [(r["heads"], r["batch"]) for r in rows] == [(4, 2), (4, 5), (8, 2), (8, 5)]
    for r in rows:
        assert set(r) == KEYS
        assert (r["kind"], r["layers"], r["topk"], r["qo_len"]) == ("dsa", 2, 64, 1)
        assert r["kv_format"] == "fp8_e4m3_block" and r["graph"] is False
        assert r["pool_tokens"] == 256 and r["distinct_pools"] == 2  # 250 up to 64-token pages
        assert r["plugin_layers_ms"] > 0 and r["plugin_step_ms"] >= r["plugin_layers_ms"]
        assert r["plan_host_us"] > 0
        assert r["ref_rows"] == 2 * r["batch"]  # every row of every layer on the CPU
        assert r["ref_rel_l2"] < 1e-2  # bf16 outputs: ~2e-3
        for key in ("flashmla_step_ms", "flashmla_heads", "speedup", "rel_l2",
                    "flashmla_ref_rel_l2", "flashmla", "flashmla_cache_dtype"):
            assert r[key] is None, key
        assert "not CUDA" in r["flashmla_absent"]
    assert done.stdout.count("flashmla absent") == len(rows)


def test_rows_from_one_context_window(tmp_path):
    """--context: an extend chunk's query tokens (one request's) select from one window of the
    pool: a layer's slots span at most that many tokens (where the whole pool's rows span
    more), and the plugin still matches the float64 reference."""
    out = tmp_path / "dsa_ctx.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_dsa_step.py"), "--device", "cpu",
           "--no-graph", "--layers", "1", "--heads", "8", "--batch", "6", "--topk", "64",
           "--context", "96", "--pool-tokens", "512", "--iters", "1", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["context"] == 96 and row["pool_tokens"] == 512 and row["ref_rel_l2"] < 1e-2
    assert 64 <= row["slot_span"] <= 96
    assert "ctx=    96" in done.stdout
