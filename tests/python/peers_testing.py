"""What the bench/peers tests share: bench/peers on sys.path (its modules import by plain name, as
the device runs them), and torch with a module it needs, or the test skipped."""

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))


def torch_and(module):
    """torch, once `module` imports; else the test skips, naming why."""
    torch = pytest.importorskip("torch")
    try:
        __import__(module)
    except ImportError as e:
        pytest.skip(f"{module} not importable: {e}")
    return torch
