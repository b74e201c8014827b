"""Shared test set-up: fresh but reproducible seeds, and skipping GPU tests without CUDA.

Markers: ``gpu`` (needs CUDA; run ``pytest -m gpu`` on the device machine) and ``dist``
(multi-process). CPU kernel tests run the Triton kernels in the interpreter when
``TRITON_INTERPRET=1`` (``make test`` sets it).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # A different seed per test so tests see fresh random data, yet a failure reproduces:
    # the seed derives from the test id, and MOEKIT_TEST_SEED shifts all of them.
    base = int(os.environ.get("MOEKIT_TEST_SEED", "0"))
    seed = (zlib.crc32(request.node.nodeid.encode()) + base) % (2**31)
    torch.manual_seed(seed)
    yield


@pytest.fixture
def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
