"""pytest fixtures for the fp8mla Python suite: fresh random data per test, reproducible by seed.

Every test draws new data; the seed is printed (pytest shows it with a failure) and
FP8MLA_TEST_SEED=<n> replays it.
"""

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng():
    seed = int(os.environ.get("FP8MLA_TEST_SEED", secrets.randbits(32)))
    print(f"FP8MLA_TEST_SEED={seed}")
    return np.random.default_rng(seed)


def pytest_configure(config):
    # fp8mla warns for FlashInfer 0.7's deprecated call forms as FlashInfer does; the suite
    # calls them on purpose (tests that check the warning use pytest.warns).
    config.addinivalue_line("filterwarnings",
                            "ignore:.*deprecated in FlashInfer 0.7:DeprecationWarning")
    config.addinivalue_line("filterwarnings",
                            "ignore:.*FlashInfer 0.7 flat CSR plans:DeprecationWarning")
