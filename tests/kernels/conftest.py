"""Kernel tests run compiled on a GPU when one is present, interpreted or lowered on CPU.

`-m gpu` selects the tests that exercise a kernel on the device (experiments/gpu_check.py runs
them first on a GPU machine).
"""

import jax
import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs compiled on a GPU if present (CPU: interpret)")


@pytest.fixture
def interpret() -> bool:
    """Mosaic GPU interpret mode unless a GPU runs the kernel for real."""
    return jax.default_backend() != "gpu"
