"""`fp8mla audit` on profiler traces recorded fresh: scripts/record_traces.py records a small MLA
decode loop three ways with torch.profiler (cast the pool, gather then cast, fp8mla native),
then tests/audit/check_traces.py checks what the command finds against the profiler's own
figures (the KV cast found, its time and share within tolerance; nothing in the native trace).

Needs torch and the command: FP8MLA_CLI names the binary (scripts/test.sh sets it); skipped
without either. The committed traces in tests/audit/traces are checked by ctest.
"""

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.environ.get("FP8MLA_CLI", "")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    if not (CLI and os.access(CLI, os.X_OK)):
        pytest.skip("FP8MLA_CLI does not name the fp8mla binary (scripts/test.sh sets it)")
    out = tmp_path_factory.mktemp("traces")
    record = load("scripts/record_traces.py", "record_traces")
    # Small: three layers, two profiled steps, a 4096-token pool (about 10 s on 2 cores).
    record.main(["--out", str(out), "--layers", "3", "--steps", "2", "--pool", "4096",
                 "--context", "200"])
    return out


@pytest.mark.parametrize("strategy", ["cast", "gather", "native"])
def test_audit_finds_what_the_profiler_measured(traces, strategy):
    check = load("tests/audit/check_traces.py", "check_traces")
    trace = os.path.join(traces, f"{strategy}.trace.json.gz")
    with open(os.path.join(traces, f"{strategy}.expected.json")) as f:
        expected = json.load(f)
    failures = check.check_trace(CLI, trace, expected)
    assert not failures, "\n".join(failures)
    if strategy != "native":
        assert expected["steps"][0]["kv_casts"] == 3  # the recording made one cast a layer
