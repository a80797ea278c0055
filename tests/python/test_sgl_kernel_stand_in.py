"""The sgl_kernel stand-in the SGLang plugin's GPU run uses (sgl_kernel_stand_in.py): it serves
the package and its submodules to imports, and every op it stands in for raises when called. In
a child interpreter, so the stand-in never enters this process's modules."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import sys
sys.path.insert(0, {here!r})
import sgl_kernel_stand_in
if not sgl_kernel_stand_in.install():
    print("real sgl_kernel")
    raise SystemExit(0)
import sgl_kernel
from sgl_kernel import int8_scaled_mm, silu_and_mul
from sgl_kernel.quantization import ggml_dequantize
assert sgl_kernel_stand_in.install()  # a second call: still served, no second finder
assert sum(type(f).__name__ == "_Finder" for f in sys.meta_path) == 1
for op, name in ((int8_scaled_mm, "sgl_kernel.int8_scaled_mm"),
                 (ggml_dequantize, "sgl_kernel.quantization.ggml_dequantize")):
    try:
        op(1, 2, k=3)
    except NotImplementedError as e:
        assert name in str(e), str(e)
    else:
        raise AssertionError(name + " ran")
assert not hasattr(sgl_kernel, "__version__")
print("stand-in")
"""


def test_stand_in_serves_imports_and_raises_on_calls():
    r = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    if r.stdout.strip() == "real sgl_kernel":
        pytest.skip("sgl_kernel is installed here: the stand-in stays out")
    assert r.stdout.strip() == "stand-in"
