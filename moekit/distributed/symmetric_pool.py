"""One symmetric-memory buffer per process group, shared by moekit's cross-rank kernels.

:class:`SymmetricPool` allocates ``SIGNAL_BYTES + size_bytes`` bytes with
``torch.distributed._symmetric_memory.empty`` and rendezvouses them once (``rendezvous``) with the
group. After that every rank knows the address of every peer's buffer in its own address space;
the kernels get them as the device tensor :attr:`SymmetricPool.peer_bases` (int64 ``[W]``) and
read or write the peers' memory directly over NVLink. Nothing is re-rendezvoused per call.

Sub-allocation: the first ``SIGNAL_BYTES`` hold the barrier flags (see
:mod:`moekit.kernels.allreduce`); the data region after them is split in two halves of
:attr:`SymmetricPool.half_bytes` that consecutive launches alternate between (double buffering,
which lets the kernels skip their exit barrier); a call's workspace is one half.
:meth:`SymmetricPool.fits` says whether a call's workspace fits; when it does not, or symmetric
memory is unavailable (no CUDA, ranks on several hosts, more than ``MAX_WORLD`` ranks,
size 0, a torch build without it), :attr:`available`/:attr:`reason` say so and the ops fall back
to NCCL with a one-time warning.

After the two halves comes the Lamport region of the barrier-free ``lamport`` algorithm:
``2 × W`` slots of :attr:`SymmetricPool.lamport_slot_bytes`, filled with the sentinel (bf16/fp16
-0.0) at creation; every Lamport launch returns the slots it used to that state.

Size: ``size_bytes``, else ``MOEKIT_SYMM_POOL_MB`` (MiB), else :data:`DEFAULT_POOL_BYTES`; Lamport
slots: ``lamport_slot_bytes``, else ``MOEKIT_AR_LAMPORT_SLOT_KB``, else
:data:`DEFAULT_LAMPORT_SLOT_BYTES` (0 turns the Lamport region off).

Rules: create the pool (or call an op once, which creates it) before CUDA-graph capture; use one
pool from one stream at a time; every rank of the group must make the same calls in the same
order with the same shapes (as with any collective).
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from moekit.config import env_kib, symm_pool_bytes
from moekit.distributed.env import disable_multicast_env
from moekit.kernels.allreduce import (
    CTL_WORDS,
    DATA_OFFSET,
    LAMPORT_ALIGN,
    LAMPORT_SENTINEL_BITS,
    MAX_WORLD,
    SIGNAL_BYTES,
    half_bytes,
    lamport_offset,
    lamport_region_bytes,
)
from moekit.kernels.allreduce import (
    lamport_fits as _lamport_fits,
)

DEFAULT_POOL_BYTES = 128 << 20  # data region; 2× covers a two_shot of 16k tokens × 2048 bf16
# One Lamport slot holds one rank's x of a call: 4 MiB covers 256 tokens × 7168 bf16.
DEFAULT_LAMPORT_SLOT_BYTES = 4 << 20

__all__ = [
    "DEFAULT_LAMPORT_SLOT_BYTES",
    "DEFAULT_POOL_BYTES",
    "SymmetricPool",
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
        capacity: bytes of the data region (excluding the signal region).
        half_bytes: bytes of each of its two halves (the most one call can stage).
        lamport_offset, lamport_slot_bytes: where the Lamport region starts in the buffer and
            the size of each of its slots (the most one Lamport call can send); 0 slot bytes
            means no Lamport region.
        available: False when symmetric memory cannot be used; ``reason`` says why.
        peer_bases: ``[W]`` int64 device tensor, the address of every rank's buffer here.
        epochs: ``[CTL_WORDS]`` int32 device tensor (local): the launch epoch and the arrival
            counter of the kernels (:mod:`moekit.kernels.allreduce`).
        handle: the ``_SymmetricMemory`` handle from ``rendezvous`` (None when unavailable).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        size_bytes: int | None = None,
        *,
        device: torch.device | None = None,
        lamport_slot_bytes: int | None = None,
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
        self.capacity = int(
            size_bytes if size_bytes is not None else symm_pool_bytes(DEFAULT_POOL_BYTES)
        )
        if self.capacity < 0:
            raise ValueError(f"size_bytes must be >= 0, got {self.capacity}")
        self.half_bytes = half_bytes(self.capacity)
        if lamport_slot_bytes is None:
            lamport_slot_bytes = env_kib("MOEKIT_AR_LAMPORT_SLOT_KB")
        if lamport_slot_bytes is None:
            lamport_slot_bytes = DEFAULT_LAMPORT_SLOT_BYTES
        if lamport_slot_bytes < 0:
            raise ValueError(f"lamport_slot_bytes must be >= 0, got {lamport_slot_bytes}")
        self.lamport_slot_bytes = int(lamport_slot_bytes) // LAMPORT_ALIGN * LAMPORT_ALIGN
        self.lamport_offset = lamport_offset(self.capacity)
        if device is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device if device is not None else torch.device("cpu")
        self.available = False
        self.reason = ""
        self.handle = None
        self.peer_bases: torch.Tensor | None = None
        self.epochs: torch.Tensor | None = None
        self._buffer: torch.Tensor | None = None
        self.reason = self._static_reason()
        if not self.reason:
            self._allocate()

    # decisions that are identical on every rank, so that no rank enters a collective alone
    def _static_reason(self) -> str:
        if self.device.type != "cuda":
            return f"symmetric memory needs CUDA tensors (device {self.device})"
        if self.world_size < 2:
            return "group of size 1 (nothing to reduce)"
        if self.world_size > MAX_WORLD:
            return f"group size {self.world_size} > {MAX_WORLD} ranks the kernels support"
        if self.capacity == 0:
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

        lamport = lamport_region_bytes(self.world_size, self.lamport_slot_bytes)
        total = self.lamport_offset + lamport
        error = ""
        try:
            buf = symm_mem.empty(total, dtype=torch.uint8, device=self.device)
            buf[:SIGNAL_BYTES].zero_()
            # every Lamport slot starts "empty"; peers write only after the collective below
            buf[self.lamport_offset :].view(torch.int16).fill_(LAMPORT_SENTINEL_BITS)
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
        self._buffer = buf
        self.handle = handle
        bases = [ptrs[r] + every_host[r][0] for r in range(self.world_size)]
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        self.epochs = torch.zeros(CTL_WORDS, dtype=torch.int32, device=self.device)
        torch.cuda.synchronize(self.device)
        self.available = True

    def fits(self, nbytes: int) -> bool:
        """Whether a call needing ``nbytes`` of the data region (both halves, as given by
        :func:`moekit.kernels.allreduce.workspace_bytes`) can run on this pool."""
        return self.available and nbytes // 2 <= self.half_bytes

    def lamport_fits(self, T: int, H: int, dtype: torch.dtype, algo: str = "lamport") -> bool:
        """Whether a ``lamport`` / ``lamport_two_shot`` call of [T, H] ``dtype`` fits the Lamport
        slots (bf16/fp16 only)."""
        return (
            self.available
            and dtype in (torch.bfloat16, torch.float16)
            and _lamport_fits(T, H, 2, algo, self.world_size, self.lamport_slot_bytes)
        )

    def local_view(
        self, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0
    ) -> torch.Tensor:
        """This rank's data region (from byte ``offset``) as a tensor of ``shape``/``dtype``."""
        if self._buffer is None:
            raise RuntimeError(f"symmetric pool unavailable: {self.reason}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if offset % itemsize or offset + numel * itemsize > self.capacity:
            raise ValueError(f"view of {numel} × {dtype} at byte {offset} exceeds the pool")
        start = DATA_OFFSET + offset
        return self._buffer[start : start + numel * itemsize].view(dtype).view(shape)

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable ({self.reason})"
        where = f"rank={self.rank}/{self.world_size}"
        return f"SymmetricPool({where}, capacity={self.capacity} B, {state})"


_POOLS: dict[str, SymmetricPool] = {}
# Bumped whenever the pool of some group changes; the ops drop their cached launch plans (which
# hold pool addresses) when it moves.
_generation = 0


def pool_generation() -> int:
    """A counter that changes whenever :func:`get_pool` may return a different pool."""
    return _generation


def get_pool(group: dist.ProcessGroup | None = None) -> SymmetricPool:
    """The pool of ``group`` (default: world), created on first use with the default size
    (collective on first use: every rank of the group must reach it)."""
    group = group if group is not None else dist.group.WORLD
    key = _group_key(group)
    pool = _POOLS.get(key)
    if pool is None:
        global _generation
        pool = SymmetricPool(group)
        _POOLS[key] = pool
        _generation += 1
    return pool


def set_pool(pool: SymmetricPool) -> SymmetricPool:
    """Make ``pool`` the one the ops use for its group (e.g. a larger or smaller size).

    Do this before capturing CUDA graphs that use the group: captured kernels keep the old pool's
    addresses.
    """
    global _generation
    _POOLS[_group_key(pool.group)] = pool
    _generation += 1
    return pool
