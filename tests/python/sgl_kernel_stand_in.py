"""A stand-in for the sgl_kernel package, for running the SGLang plugin's tests on a GPU host
that lacks it.

On a CUDA device SGLang 0.5.23 imports sgl_kernel's compiled ops from many modules at import
time (quantization schemes, activations, samplers), and its wheel (536 MB) is more than a
device call may carry. The plugin's paths call none of those ops: the stand-in satisfies the
imports, and any call of one of its functions raises NotImplementedError naming the op, so a
test that reached one would fail loudly rather than compute something else.
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import types


def _message(full):
    return (f"{full}: sgl_kernel is not installed here; a stand-in satisfies SGLang's imports "
            "(tests/python/sgl_kernel_stand_in.py) and none of its ops runs")


class _StandInType(type):
    """The type of a stand-in name: calling one raises NotImplementedError naming it, and its
    attributes are stand-ins too, since SGLang reads some of sgl_kernel's values at import time
    (quantization/utils.py: scalar_types.uint4b8). A class, so SGLang may also subclass one."""

    def __call__(cls, *args, **kwargs):
        raise NotImplementedError(_message(cls.__qualname__))

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")


def _stand_in(full):
    module, _, name = full.rpartition(".")
    return _StandInType(name, (), {"__qualname__": full, "__module__": module})


class _StandInModule(types.ModuleType):
    """sgl_kernel or one of its submodules: every public attribute is a stand-in."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []  # a package, so `from sgl_kernel.quantization import ...` resolves


def install():
    """Serves sgl_kernel and its submodules from the stand-in when the real package does not
    import; returns True when the stand-in serves them (installed now or before)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    try:
        importlib.import_module("sgl_kernel")
        return False
    except ImportError:
        pass
    sys.meta_path.insert(0, _Finder())
    return True
