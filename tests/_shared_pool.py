"""A symmetric-pool stand-in for CPU tests: W processes map the same W zeroed files, so every
rank sees every peer's buffer in its own address space, as symmetric memory does on GPUs. With
``TRITON_INTERPRET=1`` moekit's cross-rank kernels then run in the interpreter across the
processes (barriers, peer reads and epochs included)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def make_files(directory: str, world: int, nbytes: int) -> list[str]:
    """``world`` zeroed files of ``nbytes`` (a new pool's state) in ``directory``."""
    paths = []
    for r in range(world):
        path = os.path.join(directory, f"pool{r}")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        paths.append(path)
    return paths


class SharedFilePool:
    """What the kernels use of a ``SymmetricPool``, over shared files (one per rank)."""

    def __init__(self, group: dist.ProcessGroup, paths: list[str], nbytes: int) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.nbytes, self.device = nbytes, torch.device("cpu")
        self.available, self.reason, self.handle = True, "", None
        self._buffers = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
                         for p in paths]  # fmt: skip
        self.buffer = self._buffers[self.rank]
        self.peer_bases = torch.tensor([b.data_ptr() for b in self._buffers], dtype=torch.int64)
        self.epochs = torch.zeros(2, dtype=torch.int32)
