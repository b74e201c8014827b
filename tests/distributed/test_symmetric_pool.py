"""SymmetricPool and the torchrun-environment helpers (CPU / gloo, two spawned ranks).

The pool on CPU must report itself unavailable with a reason (the ops then fall back); the GPU
behaviour (zeroed buffers, rendezvous once, reuse, fallback when too small) is checked by
``tests/distributed/gpu_allreduce_check.py`` under torchrun. The pool is generic: it knows
nothing of the all-reduce's workspace, and imports nothing above ``config`` and ``runtime``.
"""

from __future__ import annotations

import ast
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.distributed import NO_MULTICAST_ENV, disable_multicast_env
from tests._multiproc import finish_worker

WORLD = 2


def test_disable_multicast_env_sets_unset_vars(monkeypatch):
    for k in NO_MULTICAST_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # an explicit user value is kept
    got = disable_multicast_env()
    assert got == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                   "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip
    assert all(os.environ[k] == v for k, v in got.items())


def test_distributed_imports_only_lower_layers():
    import moekit.distributed

    folder = os.path.dirname(moekit.distributed.__file__)
    for name in os.listdir(folder):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moekit."):
                layer = node.module.split(".")[1]
                assert layer in ("config", "runtime", "distributed"), (name, node.module)


def test_pool_needs_initialised_group():
    from moekit.distributed import SymmetricPool

    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(RuntimeError, match="initialised default process group"):
        SymmetricPool()


def _worker(rank: int, store_dir: str) -> None:
    # the torchrun environment, as init_distributed reads it
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank)})
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    with open(os.path.join(store_dir, "port")) as f:
        os.environ["MASTER_PORT"] = f.read().strip()
    for k in NO_MULTICAST_ENV:
        os.environ.pop(k, None)
    from moekit.distributed import (
        DEFAULT_POOL_BYTES,
        SymmetricPool,
        get_pool,
        group_from_name,
        init_distributed,
        set_pool,
    )
    from moekit.distributed.symmetric_pool import pool_generation

    info = init_distributed(backend="gloo")
    try:
        assert (info.rank, info.world_size, info.local_rank) == (rank, WORLD, rank)
        assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert init_distributed().rank == rank  # idempotent
        assert group_from_name(info.group.group_name) is info.group
        with pytest.raises(ValueError, match="no process group is registered"):
            group_from_name("no such group")
        pool = get_pool()
        assert get_pool() is pool  # created once per group, then reused
        gen = pool_generation()
        if info.device.type == "cpu":
            assert not pool.available and "CUDA" in pool.reason
            assert pool.buffer is None and pool.peer_bases is None and pool.epochs is None
        assert (pool.rank, pool.world_size) == (rank, WORLD)
        os.environ["MOEKIT_SYMM_POOL_MB"] = "0.5"
        assert SymmetricPool().nbytes == 1 << 19
        del os.environ["MOEKIT_SYMM_POOL_MB"]
        assert SymmetricPool().nbytes == DEFAULT_POOL_BYTES
        small = set_pool(SymmetricPool(size_bytes=4096))
        assert get_pool() is small and small.nbytes == 4096
        assert pool_generation() != gen  # users of the old pool's addresses rebuild
        with pytest.raises(ValueError, match="size_bytes must be >= 0"):
            SymmetricPool(size_bytes=-1)
        assert "unavailable" in repr(small) or "available" in repr(small)
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_init_distributed_and_pool_on_cpu():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "port"), "w") as f:
            f.write(str(port))
        mp.spawn(_worker, args=(d,), nprocs=WORLD, join=True)


def _reinit_worker(rank: int, store_dir: str) -> None:
    from moekit.distributed import get_pool
    from moekit.distributed.symmetric_pool import pool_generation

    first = None
    for attempt in range(2):  # the same group name "0" both times
        dist.init_process_group(
            "gloo", init_method=f"file://{store_dir}/store{attempt}", rank=rank, world_size=1
        )
        try:
            pool = get_pool()
            assert pool.group is dist.group.WORLD
            if first is None:
                first, gen = pool, pool_generation()
            else:  # the old group's pool (its peers, rank, size) is not handed out again
                assert pool is not first and pool_generation() != gen
        finally:
            dist.destroy_process_group()


@pytest.mark.dist
def test_pool_of_a_destroyed_group_is_not_reused():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_reinit_worker, args=(d,), nprocs=1, join=True)


@pytest.mark.gpu
@pytest.mark.dist
def test_pool_gpu_single_process_group_of_one():
    # one GPU process: a group of size 1 has nothing to reduce, the pool says so
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", init_method=f"file://{d}/s", rank=0, world_size=1)
        try:
            from moekit.distributed import SymmetricPool

            pool = SymmetricPool()
            assert not pool.available and "size 1" in pool.reason
        finally:
            dist.destroy_process_group()
    assert torch.cuda.is_available()
