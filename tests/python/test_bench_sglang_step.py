"""bench/sglang_step.py's smoke test on the CPU: tiny sizes, eager (no CUDA graph), the three
ways (the plugin's native FP8 step, SGLang's cast-pool step, the gathered cast) agree and the
JSON is written. The timings it prints are CPU timings and mean nothing; the device run is the
lead's."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_step_bench_runs_and_the_ways_agree(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_step.py"), "--device", "cpu",
           "--no-graph", "--layers", "2", "--page-size", "1", "64", "--batch", "2", "--ctx",
           "96", "--heads", "4", "--iters", "1", "--extend", "--extend-q", "8",
           "--extend-ctx", "64", "--pool-tokens", "256", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["page_size"]) for r in rows] == [
        ("decode", 1), ("decode", 64), ("extend", 1), ("extend", 64)]
    for r in rows:
        assert r["rel_l2"] < 2e-2 and r["plugin_step_ms"] > 0 and r["cast_step_ms"] > 0
        assert r["gather_step_ms"] > 0 and r["pool_tokens"] >= 256  # --pool-tokens 256
        assert r["cast_kernel"] == "fp8mla-bf16" and r["graph"] is False
