"""Helpers for tests that spawn several gloo ranks with torch.multiprocessing, or run a GPU
check script under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NoReturn

import pytest
import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finish_worker() -> NoReturn:
    """End a spawned gloo rank that passed: wait for its peers, then exit at once.

    gloo's C++ teardown (process-group destructor, then static destructors at interpreter exit)
    races with the peer's and sometimes calls ``std::terminate`` (SIGABRT, "terminate called
    without an active exception"), failing a test that passed. A rank that reached here has
    nothing left to check, so it skips the teardown with ``os._exit(0)``. A rank that failed
    never gets here: its exception propagates and ``mp.spawn`` reports it.
    """
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gpu_check_under_torchrun(script: str, passed: str | None = None) -> None:
    """Run ``tests/distributed/<script>`` under torchrun, one rank per local GPU (skips below
    2), with NVLink multicast off; fails with the output's tail unless it exits 0 (and prints
    ``passed`` when given)."""
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip("needs >= 2 GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONPATH=REPO)  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
           os.path.join(REPO, "tests", "distributed", script)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    if passed is not None:
        assert passed in proc.stdout, proc.stdout[-4000:]


def load_local_experts(full: torch.nn.Module, ep: torch.nn.Module, rank: int, world: int) -> None:
    """Give the expert-parallel layer ``ep`` the single-process layer ``full``'s weights: every
    parameter, the experts' only this rank's share."""
    experts = full.experts.fc1_weight.shape[0] // world
    state = full.state_dict()
    for name in ("experts.fc1_weight", "experts.fc2_weight"):
        state[name] = state[name][rank * experts : (rank + 1) * experts].clone()
    ep.load_state_dict(state)


def rank_tokens(world: int, first: int, hidden: int, seed: int = 100) -> tuple[list, list, list]:
    """(token counts, inputs, output gradients) of every rank, each rank ``9·rank`` tokens more
    than the first: the same on every rank, different per rank."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [first + 9 * r for r in range(world)]
    xs = [torch.randn(n, hidden, generator=gen) for n in sizes]
    gs = [torch.randn(n, hidden, generator=gen) for n in sizes]
    return sizes, xs, gs


def steps_ep_and_full(ep, full, rank: int, world: int, first: int, capacity_factor) -> tuple:
    """One forward + backward of the expert-parallel layer on this rank's tokens and of the
    single-process layer on every rank's (with a capacity limit, on each rank's alone: drops
    are decided per rank). Returns (this rank's y, its input with .grad, the single-process
    layer's y and input rows of this rank, the input's gradient rows of this rank)."""
    sizes, xs, gs = rank_tokens(world, first, full.router.weight.shape[1])
    x = xs[rank].clone().requires_grad_()
    y = ep(x)
    y.backward(gs[rank])
    xa = torch.cat(xs).requires_grad_()
    if capacity_factor is None:
        ya = full(xa)
    else:
        ya = torch.cat([full(part) for part in xa.split(sizes)])
    ya.backward(torch.cat(gs))
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    return y, x, ya[mine], xa.grad[mine]
