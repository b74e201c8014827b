"""Process-group set-up from the ``torchrun`` environment, with NVLink multicast kept off.

``torchrun`` exports ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`init_distributed` turns them into an initialised default process group and pins the CUDA
device to ``LOCAL_RANK``. :func:`group_from_name` finds a group by its ``group_name`` (what the
ops' custom ops take in place of a ProcessGroup).

NVLink SHARP / multicast objects are forbidden on the machines moekit is tested on (and moekit's
kernels never need them): :func:`disable_multicast_env` sets ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` unless the user already set
them. It runs when :mod:`moekit.distributed` is imported, again in :func:`init_distributed`, and
before the symmetric pool allocates: NCCL reads its variable when a communicator is created (the
first collective), torch's symmetric memory when it allocates and rendezvouses.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "NO_MULTICAST_ENV",
    "DistInfo",
    "disable_multicast_env",
    "group_from_name",
    "init_distributed",
]

NO_MULTICAST_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def disable_multicast_env() -> dict[str, str]:
    """Set the three no-multicast variables in ``os.environ`` where unset; returns their values."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in NO_MULTICAST_ENV}


@dataclass(frozen=True)
class DistInfo:
    """What :func:`init_distributed` set up."""

    rank: int  # global rank
    world_size: int
    local_rank: int  # rank on this node (CUDA device index)
    device: torch.device
    group: dist.ProcessGroup  # the default (world) group


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta | None = None,
) -> DistInfo:
    """Initialise the default process group from the ``torchrun`` environment (idempotent).

    backend: ``"nccl"`` when CUDA is available, else ``"gloo"`` (``None`` picks).
    Sets the current CUDA device to ``LOCAL_RANK`` before creating the group, so NCCL and the
    symmetric pool bind to the right GPU. Without ``RANK``/``WORLD_SIZE`` in the environment this
    is a single-process group (world size 1), which keeps scripts runnable without torchrun.
    """
    disable_multicast_env()
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        kwargs: dict = {"backend": backend, "rank": rank, "world_size": world_size}
        if timeout is not None:
            kwargs["timeout"] = timeout
        if device.type == "cuda" and backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init bound to this GPU
        dist.init_process_group(**kwargs)
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        group=dist.group.WORLD,
    )


def group_from_name(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (its ``group_name``).

    A torch.library custom op takes tensors and scalars, not a ProcessGroup, so an op that runs
    a collective inside one takes the group's name and resolves it here, the way torch's own
    functional collectives do (through the same c10d registry, which has no public accessor).
    """
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._resolve_process_group(name)
    except RuntimeError as e:
        raise ValueError(f"group_name: no process group is registered as {name!r}") from e
