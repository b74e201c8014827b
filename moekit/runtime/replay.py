"""The one launch path: every moekit kernel launch goes through :func:`launch`, and every op runs
its launches inside :func:`replayed`.

A Triton launch costs tens of microseconds of host time for a kernel with ~30 arguments
(binding, specialisation keys, cache look-up, a driver query per pointer), which makes small
MoE problems host-bound. An op's launch sequence depends only on static facts (shapes,
strides, dtypes, flags), so the op keys it on them: the first call of a key runs the launchers
the normal way (configs get chosen or tuned then), the second also records each launch, and
later calls replay them, calling each compiled kernel's C launcher directly with the recorded
arguments and only the tensor pointers swapped for this call's (a pointer into one of the op's
tensors, e.g. a view of a scratch buffer, is replayed at the same byte offset).

Soundness: everything Triton specialises on must be what it was when recorded. The key fixes
every integer and constexpr argument and the grid; pointers must be 16-byte aligned (what
Triton assumed for them when recording; checked on every replay, a misaligned call takes the
normal path); the device must be the one recorded on. Anything the recorder cannot map back to
one of the op's tensors (a launcher-internal copy, aliasing, a callable grid, launch hooks
installed by a profiler) disables replay for that key, and the op keeps the normal path. The
normal path is always what runs on CPU, under Triton's interpreter and with a profiler's
launch hooks installed; tests compare the two.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch
import triton
from triton import knobs

from moekit.config import autotune_enabled
from moekit.runtime.cache import cached
from moekit.runtime.device import is_tile_counter, scratch, tile_counter
from moekit.runtime.state import STATE

__all__ = ["LaunchReplay", "compile_ahead", "launch", "replayed", "tensor_key"]


def _hooks_installed() -> bool:
    """A profiler's launch hooks (e.g. proton): replay steps aside so that it sees every launch."""
    hook = knobs.runtime.launch_enter_hook
    return bool(getattr(hook, "calls", hook is not None))


# (kernel, compiled kernel, grid, positional args, keyword args) of each launch while recording
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "moekit_launch_record", default=None
)


# Set while an op's launches are only being compiled (see compile_ahead)
_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "moekit_compile_only", default=False
)


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)``; noted when a LaunchReplay is recording in this context."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **meta)
        return
    compiled = kernel[grid](*args, **meta)
    rec = _RECORD.get()
    if rec is not None:
        rec.append((kernel, compiled, grid, args, meta))


class _Call:
    """One recorded launch: the C launcher, its fixed arguments, and where pointers go."""

    __slots__ = ("c_launch", "grid", "head", "scratch", "slots", "template")

    def __init__(self, c_launch, grid, head, template, slots, scratch):
        self.c_launch = c_launch
        self.grid = grid
        self.head = head  # (function, cooperative, pdl, packed metadata)
        self.template = template  # full argument list, pointers as placeholders
        self.slots = slots  # ((argument position, role index, byte offset in the role), ...)
        self.scratch = scratch  # (bytes, alignment) of global scratch, or None


def _full_args(kernel, args: tuple, meta: dict) -> list:
    """Every parameter of ``kernel`` in signature order, as Triton's launcher receives them."""
    out = list(args)
    for p in kernel.params[len(args) :]:
        if p.name in meta:
            out.append(meta[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise KeyError(p.name)
    return out


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (any strides)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


# A tile_counter argument: each replay takes its own stream's counter, which ``run`` appends
# last to the role pointers, so role -1 indexes it.
COUNTER_ROLE = -1


def _build_call(rec, locate) -> _Call | None:
    kernel, compiled, grid, args, meta = rec
    if not isinstance(grid, tuple):
        return None
    if compiled is None or not hasattr(compiled, "packed_metadata"):
        return None  # e.g. the interpreter: nothing compiled to call
    runner = compiled.run  # initialises the handles (CudaLauncher on NVIDIA)
    needed = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size")
    if not all(hasattr(runner, a) for a in needed) or getattr(runner, "profile_scratch_size", 0):
        return None
    full = _full_args(kernel, args, meta)
    slots = []
    for pos, a in enumerate(full):
        if isinstance(a, torch.Tensor):
            found = (COUNTER_ROLE, 0) if is_tile_counter(a.data_ptr()) else locate(a.data_ptr())
            if found is None:
                return None
            slots.append((pos, *found))
            full[pos] = 0
    scratch = None
    if runner.global_scratch_size > 0:
        n = 1
        for g in grid:
            n *= g
        scratch = (n * runner.num_ctas * runner.global_scratch_size, runner.global_scratch_align)
    g = tuple(grid) + (1,) * (3 - len(grid))
    head = (
        compiled.function,
        runner.launch_cooperative_grid,
        runner.launch_pdl,
        compiled.packed_metadata,
    )
    return _Call(runner.launch, g, head, full, tuple(slots), scratch)


def _issue_function(calls: Sequence[_Call]):
    """One generated Python function that replays every recorded launch:
    ``issue(roles, counter, stream, scratch) -> bool``.

    It reads the pointer of each role some launch uses, returns False (nothing launched) when
    one of them is not 16-byte aligned or a role recorded as a tensor is now None, and otherwise
    calls each launch's C launcher with its fixed arguments bound by name and its pointers
    written as ``role pointer + byte offset`` (``counter``: the tile counter's address). Written
    out once per recording, so a replay costs one Python call per launch instead of a template
    copy and a loop over its pointer slots, and no pointer reads of roles no launch uses."""
    env: dict[str, object] = {}
    used = sorted({role for c in calls for _, role, _ in c.slots if role != COUNTER_ROLE})
    name = {role: f"p{role}" for role in used} | {COUNTER_ROLE: "c"}
    lines = ["def issue(r, c, stream, s):"]
    if used:
        lines += [
            "    try:",
            *(f"        p{role} = r[{role}].data_ptr()" for role in used),
            "    except AttributeError:",  # a role recorded as a tensor is None now
            "        return False",
            f"    if ({' | '.join(f'p{role}' for role in used)}) & 15:",
            "        return False",
        ]
    for i, c in enumerate(calls):
        fn, coop, pdl, packed = c.head
        env[f"L{i}"], env[f"F{i}"], env[f"M{i}"] = c.c_launch, fn, packed
        where = {pos: (role, delta) for pos, role, delta in c.slots}
        args = []
        for pos, value in enumerate(c.template):
            if pos in where:
                role, delta = where[pos]
                args.append(f"{name[role]} + {delta}" if delta else name[role])
            else:
                env[f"a{i}_{pos}"] = value
                args.append(f"a{i}_{pos}")
        g = c.grid
        # (grid, stream, function, cooperative, pdl, global scratch, profile scratch,
        #  packed metadata, launch metadata, enter hook, exit hook, *kernel arguments)
        head = [
            str(int(g[0])), str(int(g[1])), str(int(g[2])), "stream", f"F{i}",
            str(int(coop)), str(int(pdl)), "s" if c.scratch else "None", "None", f"M{i}",
            "None", "None", "None",
        ]  # fmt: skip
        lines.append(f"    L{i}({', '.join(head + args)})")
    lines.append("    return True")
    exec(compile("\n".join(lines), "<moekit launch replay>", "exec"), env)
    return env["issue"]


class LaunchReplay:
    """The launch sequence of one op for one static configuration.

    Usage by an op (``roles``: the op's tensors in a fixed order, None for absent ones)::

        if not replay.run(roles):          # not ready yet, or this call does not qualify
            with replay.recording(roles):  # records when due, else a no-op
                ... launchers, called the normal way ...
    """

    __slots__ = (
        "_calls", "_counter", "_device", "_issue", "_scratch", "_seen", "_torch_device", "disabled",
    )  # fmt: skip

    def __init__(self) -> None:
        self._calls: tuple[_Call, ...] | None = None
        self._issue = None  # _issue_function(self._calls)
        self._seen = 0
        self._device = -1
        self._torch_device = torch.device("cpu")
        self._scratch = 0  # bytes of global scratch the largest launch needs
        self._counter = False  # whether a launch takes a tile counter
        self.disabled = False

    @property
    def ready(self) -> bool:
        return self._calls is not None

    @property
    def first_call(self) -> bool:
        return self._seen == 0 and not self.disabled

    def run(self, roles: Sequence[torch.Tensor | None]) -> bool:
        """Replay the recorded launches for these tensors; False if the op must launch itself."""
        calls = self._calls
        if calls is None:
            return False
        dev = self._device
        if _hooks_installed() or torch._C._cuda_getDevice() != dev:
            return False
        stream = torch._C._cuda_getCurrentRawStream(dev)  # current_stream(), one call less
        # One scratch block serves every launch: they run in order on this stream. (Held until
        # they are issued: under capture it is a fresh block that must not be handed out again.)
        scratch_buf = scratch(self._scratch, dev, stream) if self._scratch else None
        scratch_ptr = scratch_buf.data_ptr() if scratch_buf is not None else None
        counter = None
        if self._counter:  # the same per-stream counter the normal path would pass
            counter = tile_counter(self._torch_device, stream)  # held until issued
        counter_ptr = counter.data_ptr() if counter is not None else 0
        issued = self._issue(roles, counter_ptr, stream, scratch_ptr)
        del counter, scratch_buf
        return issued

    @contextlib.contextmanager
    def recording(self, roles: Sequence[torch.Tensor | None]) -> Iterator[None]:
        """Run the body's launches normally; on the second call, also record them."""
        self._seen += 1
        if self.disabled or self._calls is not None or self._seen != 2:
            yield
            return
        rec: list = []
        token = _RECORD.set(rec)
        try:
            yield
        finally:
            _RECORD.reset(token)
        self._build(rec, roles)

    def _build(self, rec: list, roles: Sequence[torch.Tensor | None]) -> None:
        self.disabled = True  # unless everything below maps
        if not rec or _hooks_installed():
            return
        extents = []  # (first byte, one past the last, role index)
        for i, t in enumerate(roles):
            if t is None:
                continue
            p = t.data_ptr()
            if p == 0 or p & 15:  # empty or misaligned
                return
            extents.append((p, p + max(_span_bytes(t), 1), i))
        extents.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(extents):
            if start < end:  # overlapping roles (aliasing): a pointer's role is ambiguous
                return

        def locate(ptr: int) -> tuple[int, int] | None:
            """(role, byte offset) of a kernel's pointer argument: inside exactly one role."""
            for start, end, i in extents:
                if start <= ptr < end:
                    return i, ptr - start
            return None

        calls = []
        for r in rec:
            try:
                c = _build_call(r, locate)
            except Exception:  # another Triton's internals: stay on its normal path
                return
            if c is None:
                return
            calls.append(c)
        self._device = torch.cuda.current_device()
        self._torch_device = torch.device("cuda", self._device)
        self._scratch = max((c.scratch[0] for c in calls if c.scratch), default=0)
        self._counter = any(role == COUNTER_ROLE for c in calls for _, role, _ in c.slots)
        self._issue = _issue_function(calls)
        self._calls = tuple(calls)
        self.disabled = False


class _CompileWithLauncher(Executor):
    """Runs Triton's compile jobs in a thread pool, each followed by the build of the kernel's
    C launcher (a C compiler run, otherwise done on the first launch, one after another). The
    launcher lands in Triton's cache, where that first launch then finds it."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool

    def submit(self, fn, /, *args, **kwargs) -> Future:
        def compile_and_build_launcher():
            kernel = fn(*args, **kwargs)
            with contextlib.suppress(Exception):  # the first launch builds (and reports) it
                triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return self.pool.submit(compile_and_build_launcher)


@functools.cache
def _compile_pool() -> Executor:
    return _CompileWithLauncher(ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)))


class _SharedKernel:
    """A compile job's result, finalised (entered in the kernel's cache) once, by whichever
    thread asks first. The interface of Triton's ``FutureKernel``."""

    def __init__(self, finalize: Callable, future: Future, forget: Callable[[], None]) -> None:
        self.finalize, self.future, self.forget = finalize, future, forget
        self.kernel = None
        self.lock = threading.Lock()

    def result(self, ignore_errors: bool = False):
        try:
            kernel = self.future.result()
        except Exception:
            self.forget()  # a later compile tries again (and the real launch reports it)
            if ignore_errors:
                return None
            raise
        with self.lock:
            if self.kernel is None:
                self.finalize(kernel)
                self.kernel = kernel
                self.forget()
        return self.kernel


def _forget(key: str) -> None:
    with STATE.compiles_lock:
        STATE.compiles.pop(key, None)


class _SharedCompiles(triton.AsyncCompileMode):
    """Triton's ``AsyncCompileMode`` with compile jobs shared between its instances: a kernel
    another instance is still compiling (one left to finish in the background, see
    :func:`compile_ahead`) is waited for instead of compiled twice."""

    def __init__(self, executor: Executor) -> None:
        super().__init__(executor, ignore_errors=True)
        self.jobs: list[_SharedKernel] = []

    def submit(self, key, compile_fn, finalize_fn):
        with STATE.compiles_lock:  # Triton's cache key of the kernel -> its job
            job = STATE.compiles.get(key)
            if job is None:
                future = self.executor.submit(compile_fn)
                job = _SharedKernel(finalize_fn, future, lambda: _forget(key))
                STATE.compiles[key] = job
        self.jobs.append(job)
        return job

    def finish(self) -> None:
        for job in self.jobs:
            job.result(ignore_errors=True)


@functools.cache
def _finisher() -> Executor:
    """The thread that finalises compile jobs left running in the background."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="moekit-compile")


def compile_ahead(body: Callable[[], object], *, wait: bool = True) -> None:
    """Compile every kernel ``body`` would launch, in parallel threads, launching nothing.

    A new shape's first call compiles its kernels one after another as it reaches each launch
    (a second or more each, plus a C compiler run for each kernel's launcher). Run first with
    ``launch`` only compiling, inside Triton's ``AsyncCompileMode``, the compilations overlap
    where they leave the GIL (ptxas, the C compiler), and the real run that follows finds them
    compiled. Only for bodies whose work outside the launches is
    allocation: the body runs twice. Not with autotuning on (the tuner must time real launches)
    nor inside another ``AsyncCompileMode``; a failure here is left for the real run to raise.

    ``wait=False`` returns once the compilations are started: an op's first forward starts its
    backward's this way. A later call that needs one of those kernels waits for its job rather
    than compiling it again.
    """
    if autotune_enabled():
        return
    token = _COMPILE_ONLY.set(True)
    mode = _SharedCompiles(_compile_pool())
    try:
        with mode:
            body()
    except Exception:  # the real run reports it
        pass
    finally:
        _COMPILE_ONLY.reset(token)
    if wait:
        mode.finish()
    elif mode.jobs:
        _finisher().submit(mode.finish)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What a launcher's non-pointer arguments may take from a tensor: part of a replay key."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def replayed(
    key: tuple | None, roles: Sequence[torch.Tensor | None], body: Callable[[], object]
) -> None:
    """Run ``body``'s launches for these tensors (the op's "roles", None for absent ones):
    replayed when recorded, else run normally (and recorded on the second call of ``key``).

    ``key`` holds everything the launchers' non-pointer arguments depend on (see
    :func:`tensor_key`); ``None`` (CPU, the interpreter) just runs ``body``. ``body`` must do
    nothing but allocate and launch: on the first call of a key it runs twice, first only
    compiling its kernels (:func:`compile_ahead`)."""
    if key is None:
        body()
        return
    rep = cached(("replay", *key), LaunchReplay)
    if not rep.run(roles):
        if rep.first_call:
            compile_ahead(body)
        with rep.recording(roles):
            body()
