"""GPU: with MOEKIT_AUTOTUNE=1 the tuner times real launches, logs the shape it tuned and
saves the choice, which a fresh view of the store (another process) reads back."""

from __future__ import annotations

import logging

import pytest
import torch

from moekit.ops import grouped_mm
from moekit.runtime.cache import cache_clear
from moekit.runtime.state import STATE
from moekit.tuning import store


@pytest.mark.gpu
def test_gpu_autotune_logs_saves_and_reuses(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MOEKIT_AUTOTUNE", "1")
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path))
    STATE.tuned.clear()
    cache_clear()
    T, E, K, N = 3000, 8, 512, 768
    offsets = torch.tensor([0, 500, 900, 0, 1200, 100, 0, 300], device="cuda").cumsum(0)
    offsets = offsets.to(torch.int32)
    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="moekit.tuning"):
        out = grouped_mm(a, b, offsets)
    assert sum("moekit: tuned m" in r.getMessage() for r in caplog.records) == 1
    fp = store.fingerprint(a.device)
    STATE.tuned.clear()
    cache_clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moekit.tuning"):
        again = grouped_mm(a, b, offsets)
    assert not any("moekit: tuned" in r.getMessage() for r in caplog.records)
    assert torch.equal(out, again)
    keys = [k for k in STATE.tuned[store.path_for(fp)] if "'m'" in k]
    assert len(keys) == 1
    cache_clear()
