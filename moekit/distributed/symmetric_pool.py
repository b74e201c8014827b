"""One symmetric-memory buffer per process group, for moekit's cross-rank kernels.

:class:`SymmetricPool` allocates ``nbytes`` bytes on every rank with
``torch.distributed._symmetric_memory.empty``, zero-fills them and rendezvouses them once
(``rendezvous``) with the group. After that every rank knows the address of every peer's buffer
in its own address space; kernels get them as the device tensor :attr:`SymmetricPool.peer_bases`
(int64 ``[W]``) and read or write the peers' memory directly over NVLink. Nothing is
re-rendezvoused per call.

The pool is only bytes: how a kernel lays out its workspace in them is the kernel's business (the
all-reduce's layout is in :mod:`moekit.kernels.allreduce`). What the pool guarantees: the same
size on every rank; every byte zero at creation, before any peer can reach it (so an all-zero
state is a kernel's starting state); and :attr:`SymmetricPool.epochs`, a small zeroed int32
device tensor local to each rank that the kernels using the pool keep their launch count in.

When symmetric memory cannot be used (no CUDA, a group of one, ranks on several hosts, size 0,
a torch build without it, a failed allocation or rendezvous) :attr:`available` is False and
:attr:`reason` says why; the ops then fall back to NCCL with a one-time warning.

Size: ``size_bytes``, else ``MOEKIT_SYMM_POOL_MB`` (MiB), else :data:`DEFAULT_POOL_BYTES`.

Rules: create the pool (or call an op once, which creates it) before CUDA-graph capture; use one
pool from one stream at a time; every rank of the group must make the same calls in the same
order with the same shapes (as with any collective).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from moekit.config import symm_pool_bytes
from moekit.distributed.env import disable_multicast_env
from moekit.runtime.state import STATE

# Room for the all-reduce's workspace at the token counts of a training step: its flags, two
# halves for one_shot / two_shot and its Lamport slots (docs/allreduce_rmsnorm.md).
DEFAULT_POOL_BYTES = 192 << 20
EPOCH_WORDS = 2  # words of SymmetricPool.epochs

__all__ = [
    "DEFAULT_POOL_BYTES",
    "EPOCH_WORDS",
    "SymmetricPool",
    "clear_pools",
    "get_pool",
    "pool_generation",
    "set_pool",
]


def _group_key(group: dist.ProcessGroup) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else f"id{id(group)}"


class SymmetricPool:
    """A symmetric buffer rendezvoused once with ``group`` (collective: every rank constructs it).

    Attributes:
        group, rank, world_size: the process group and this rank's place in it.
        nbytes: bytes of every rank's buffer.
        device: the CUDA device of the buffer (the current one unless ``device`` is given).
        available: False when symmetric memory cannot be used; ``reason`` says why.
        buffer: this rank's buffer, a uint8 ``[nbytes]`` tensor (None when unavailable).
        peer_bases: ``[W]`` int64 device tensor, the address of every rank's buffer here.
        epochs: ``[EPOCH_WORDS]`` int32 device tensor, zero at creation and local to this rank,
            advanced only by the kernels that use the pool (every rank makes the same calls,
            so it stays the same on every rank).
        handle: the symmetric-memory handle from ``rendezvous`` (None when unavailable).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        size_bytes: int | None = None,
        *,
        device: torch.device | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "SymmetricPool needs an initialised default process group "
                "(call moekit.distributed.init_distributed() or "
                "torch.distributed.init_process_group())"
            )
        disable_multicast_env()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if size_bytes is None:
            size_bytes = symm_pool_bytes(DEFAULT_POOL_BYTES)
        self.nbytes = int(size_bytes)
        if self.nbytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {self.nbytes}")
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device if device is not None else torch.device("cpu")
        self.available = False
        self.buffer: torch.Tensor | None = None
        self.peer_bases: torch.Tensor | None = None
        self.epochs: torch.Tensor | None = None
        self.handle = None
        self.reason = self._static_reason()
        if not self.reason:
            self._allocate()

    def _static_reason(self) -> str:
        """Why the pool cannot be used, decided identically on every rank (so that no rank
        enters the allocation's collectives alone); "" when it can."""
        if self.device.type != "cuda":
            return f"symmetric memory needs CUDA tensors (device {self.device})"
        if self.world_size < 2:
            return "group of size 1 (nothing to reduce)"
        if self.nbytes == 0:
            return "pool size is 0 (MOEKIT_SYMM_POOL_MB=0)"
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "SymmetricPool cannot be created during CUDA-graph capture: create it, or call the "
                "op once, before capturing"
            )
        try:
            import torch.distributed._symmetric_memory as symm_mem  # noqa: F401
        except ImportError as e:  # identical on every rank (same build)
            return f"torch.distributed._symmetric_memory unavailable: {e}"
        hosts: list[str | None] = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        if len(set(hosts)) != 1:
            hosts_str = sorted({str(h) for h in hosts})
            return f"ranks span several hosts {hosts_str}; symmetric memory needs NVLink peers"
        return ""

    def _allocate(self) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        error = ""
        try:
            buf = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            buf.zero_()  # before the rendezvous below, so no peer can write first
            torch.cuda.synchronize(self.device)
            handle = symm_mem.rendezvous(buf, self.group)
            ptrs = [int(p) for p in handle.buffer_ptrs]
            offset = buf.data_ptr() - ptrs[self.rank]
        except (RuntimeError, AttributeError, TypeError) as e:  # reported below, never swallowed
            error = f"{type(e).__name__}: {e}"
            offset = -1
        # agree on success (and learn each rank's offset inside its allocation) in one collective
        mine = torch.tensor([offset, 0 if error else 1], dtype=torch.int64, device=self.device)
        every = torch.empty((self.world_size, 2), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        every_host = every.cpu().tolist()  # one-time host sync at set-up
        if error or not all(ok for _, ok in every_host):
            self.reason = "symmetric-memory allocation/rendezvous failed" + (
                f" on this rank ({error})" if error else " on another rank"
            )
            return
        self.buffer = buf
        self.handle = handle
        bases = [ptrs[r] + every_host[r][0] for r in range(self.world_size)]
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.epochs = torch.zeros(EPOCH_WORDS, dtype=torch.int32, device=self.device)
        torch.cuda.synchronize(self.device)
        self.available = True

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable ({self.reason})"
        where = f"rank={self.rank}/{self.world_size}"
        return f"SymmetricPool({where}, nbytes={self.nbytes}, {state})"


# The pools live in moekit.runtime.state.STATE, by (group, use): the all-reduce's ("default")
# and the expert exchange's are apart. STATE.pool_generation is bumped whenever the pool of
# some group changes, so that users key what they derive from a pool (its addresses, their
# workspace layout) on it.


def pool_generation() -> int:
    """A counter that changes whenever :func:`get_pool` may return a different pool."""
    return STATE.pool_generation


def get_pool(
    group: dist.ProcessGroup | None = None, *, use: str = "default", min_bytes: int = 0
) -> SymmetricPool:
    """The pool of ``group`` (default: world) for ``use``, created on first use (collective:
    every rank of the group must reach it) with the default size, or ``min_bytes`` if larger.

    ``use`` keeps pools of different layouts apart (``"default"``: the all-reduce's). A pool
    smaller than ``min_bytes`` is replaced by a larger one; every rank must ask for the same
    ``min_bytes``, so that all replace it together."""
    group = group if group is not None else dist.group.WORLD
    key = (_group_key(group), use)
    pool = STATE.pools.get(key)
    # A process group destroyed and created again may reuse the old one's name: the pool (its
    # peers, rank and size) belongs to the old group object, so it is replaced.
    if pool is None or pool.group is not group or (pool.available and pool.nbytes < min_bytes):
        if use != "default":
            size = min_bytes
        else:  # the configured size (MOEKIT_SYMM_POOL_MB), or more where asked
            size = max(min_bytes, symm_pool_bytes(DEFAULT_POOL_BYTES)) if min_bytes else None
        STATE.pools.pop(key, None)  # the old buffer goes before the new one is allocated
        pool = SymmetricPool(group, size)
        STATE.pools[key] = pool
        STATE.pool_generation += 1
    return pool


def set_pool(pool: SymmetricPool, *, use: str = "default") -> SymmetricPool:
    """Make ``pool`` the one the ops use for its group and ``use`` (e.g. a larger or smaller
    size, or one over another kind of shared memory).

    Do this before capturing CUDA graphs that use the group: captured kernels keep the old pool's
    addresses.
    """
    STATE.pools[(_group_key(pool.group), use)] = pool
    STATE.pool_generation += 1
    return pool


def clear_pools() -> None:
    """Forget every pool (their buffers are freed once nothing else holds them)."""
    STATE.pools.clear()
    STATE.pool_generation += 1
