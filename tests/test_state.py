"""moekit's process-wide state: one object, emptied by one call; importing moekit runs nothing.

Each import check runs in a fresh interpreter, where no earlier test has used moekit."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import torch

import moekit
from moekit.runtime.cache import cache_get, cached
from moekit.runtime.state import STATE, memoized, warn_once


def _fresh_python(code: str) -> str:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "NVSHMEM_", "TORCH_SYMM"))
    }
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=300)  # fmt: skip
    return out.stdout.strip()


def test_importing_moekit_hooks_nothing_runs_nothing_sets_nothing():
    code = (
        "import os, torch\n"
        "import moekit, moekit.fusion, moekit.distributed, moekit.nn, moekit.ops\n"
        "from moekit.runtime.state import STATE\n"
        "hooks = torch.nn.modules.module._global_parameter_registration_hooks\n"
        "env = [v for v in ('NCCL_NVLS_ENABLE', 'TORCH_SYMM_MEM_DISABLE_MULTICAST',"
        " 'NVSHMEM_DISABLE_NVLS') if v in os.environ]\n"
        "print(len(hooks), len(STATE.lookups), len(STATE.cache), env)\n"
    )
    # no parameter-registration hook, no measured calibration, no cache entry, no env var
    assert _fresh_python(code) == "0 0 0 []"


def test_sequential_installs_no_global_hook():
    # A chain finds its parameters at call time itself: nothing process-wide is hooked
    code = (
        "import torch\n"
        "from moekit import fusion\n"
        "chain = fusion.Sequential(fusion.Linear(4, 4))\n"
        "chain(torch.randn(2, 4)).sum().backward()\n"
        "print(len(torch.nn.modules.module._global_parameter_registration_hooks))\n"
    )
    assert _fresh_python(code) == "0"


def test_clear_empties_every_store():
    calls = []

    @memoized
    def square(n: int) -> int:
        calls.append(n)
        return n * n

    square(3)
    cached(("test_state", 1), lambda: "entry")
    STATE.lookups["test_state"] = 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warn_once(("test_state",), "once")
        warn_once(("test_state",), "once")
    assert len(seen) == 1
    uid = next(STATE.uids)
    moekit.clear_state()
    assert cache_get(("test_state", 1)) is None
    assert "test_state" not in STATE.lookups and not STATE.warned
    assert not STATE.cache and not STATE.scratch and not STATE.tile_counters and not STATE.pools
    square(3)
    assert calls == [3, 3]  # the memo was emptied
    assert next(STATE.uids) > uid  # ids are never handed out twice


def test_ops_work_again_after_clear():
    x = torch.randn(6, 8)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0], [2, 1]])
    probs = torch.rand(6, 2)
    first = moekit.ops.permute(x, idx, probs, num_experts=3)
    moekit.clear_state()
    again = moekit.ops.permute(x, idx, probs, num_experts=3)
    torch.testing.assert_close(first.hidden, again.hidden)
