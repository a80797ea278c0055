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
# Values SGLang reads at import time: attributes of a stand-in are stand-ins too
# (sglang/srt/layers/quantization/utils.py: scalar_types.uint4b8), and one may be subclassed.
from sgl_kernel.scalar_type import ScalarType, scalar_types
types_ = [scalar_types.uint4b8, scalar_types.uint8b128]
try:
    types_[0]()
except NotImplementedError as e:
    assert "sgl_kernel.scalar_type.scalar_types.uint4b8" in str(e), str(e)
else:
    raise AssertionError("scalar_types.uint4b8 ran")
class Sub(ScalarType):
    pass
try:
    Sub()
except NotImplementedError:
    pass
else:
    raise AssertionError("a subclass of a stand-in was made")
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


SGLANG_CHILD = """
import sys
sys.path.insert(0, {here!r})
import sgl_kernel_stand_in
if not sgl_kernel_stand_in.install():
    print("real sgl_kernel")
    raise SystemExit(0)
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
import fp8mla.sglang
print("imported")
"""


def test_sglang_imports_what_the_plugin_tests_need_beside_the_stand_in():
    """The imports test_sglang_plugin.py makes on the GPU, where the stand-in serves sgl_kernel:
    SGLang's import-time reads of sgl_kernel's values must find stand-ins (a CPU host imports
    them too, through SGLang's try / except fallbacks, which the stand-in bypasses)."""
    pytest.importorskip("sglang")
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", SGLANG_CHILD.format(here=HERE)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    if r.stdout.strip() == "real sgl_kernel":
        pytest.skip("sgl_kernel is installed here: the stand-in stays out")
    assert r.stdout.strip().endswith("imported"), r.stdout
