"""Every environment variable moekit reads, read here and nowhere else (listed in docs/ENV.md).

moekit's own knobs are prefixed ``MOEKIT_``. ``TRITON_INTERPRET`` is Triton's: it selects the CPU
interpreter, which is how CI runs the kernels without a GPU. Triton decides it when a kernel is
defined (at import), so moekit remembers the value it was imported with and refuses a change
made later (see :func:`check_interpret_unchanged`).
"""

from __future__ import annotations

import os

__all__ = [
    "allreduce_threshold_bytes",
    "autotune_enabled",
    "cache_dir",
    "check_interpret_unchanged",
    "debug_checks",
    "fusion_spec",
    "interpret_mode",
    "lamport_slot_bytes",
    "symm_pool_bytes",
]


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# The interpreter setting moekit's kernels were defined with (they are defined when this
# package is imported, right after this module).
_INTERPRET_AT_IMPORT = _interpret_env()


def interpret_mode() -> bool:
    """True when moekit's Triton kernels run in Triton's CPU interpreter."""
    return _INTERPRET_AT_IMPORT


def check_interpret_unchanged() -> None:
    """Raise a clear error if ``TRITON_INTERPRET`` changed after moekit was imported.

    Triton turns each ``@triton.jit`` function into an interpreted or a compiled kernel when it
    is defined, so a later change cannot take effect; left alone it surfaces as Triton's
    "0 active drivers" error (or as a GPU tensor run through the interpreter)."""
    if _interpret_env() != _INTERPRET_AT_IMPORT:
        now = os.environ.get("TRITON_INTERPRET")
        raise RuntimeError(
            f"TRITON_INTERPRET changed to {now!r} after moekit was imported (it was "
            f"{'1' if _INTERPRET_AT_IMPORT else 'unset'}); Triton fixes the interpreter choice "
            "when kernels are defined, so set TRITON_INTERPRET=1 before importing moekit "
            "(or triton), e.g. `TRITON_INTERPRET=1 python script.py`"
        )


def autotune_enabled() -> bool:
    """``MOEKIT_AUTOTUNE=1`` turns autotuning on; otherwise the shape-based default configs
    are used (no first-call timing of candidates)."""
    return os.environ.get("MOEKIT_AUTOTUNE", "0") == "1"


def debug_checks() -> bool:
    """``MOEKIT_DEBUG=1`` turns on every op's opt-in input checks, as if each call passed
    ``validate=True``: offsets in order and in range, expert ids in range. On CUDA tensors they
    run on the device (``torch._assert_async``: no host sync; a failure surfaces as a
    device-side assert at the next synchronisation). Read at each call (under
    ``torch.compile``, when the graph is traced)."""
    return os.environ.get("MOEKIT_DEBUG", "0") == "1"


def cache_dir() -> str:
    """Where moekit keeps tuned configs: ``MOEKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/moekit``,
    else ``~/.cache/moekit``."""
    explicit = os.environ.get("MOEKIT_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "moekit")


def _kib(name: str) -> int | None:
    value = os.environ.get(name)
    return int(float(value) * 1024) if value else None


def symm_pool_bytes(default: int) -> int:
    """Data bytes of a symmetric-memory pool: ``MOEKIT_SYMM_POOL_MB`` (MiB) if set."""
    mb = os.environ.get("MOEKIT_SYMM_POOL_MB")
    return int(float(mb) * (1 << 20)) if mb else default


def lamport_slot_bytes(default: int) -> int:
    """Bytes of one Lamport slot of the all-reduce workspace: ``MOEKIT_AR_LAMPORT_SLOT_KB``."""
    value = _kib("MOEKIT_AR_LAMPORT_SLOT_KB")
    return default if value is None else value


# The all-reduce ``auto`` thresholds, by name: MOEKIT_AR_<NAME>_MAX_KB.
ALLREDUCE_THRESHOLDS = ("one_shot", "two_shot", "lamport", "lamport_two_shot")


def allreduce_threshold_bytes(name: str) -> int | None:
    """Largest message (bytes) ``auto`` sends by algorithm ``name``, from
    ``MOEKIT_AR_<NAME>_MAX_KB``; None when unset (the measured default applies)."""
    if name not in ALLREDUCE_THRESHOLDS:
        raise ValueError(f"name must be one of {ALLREDUCE_THRESHOLDS}, got {name!r}")
    return _kib(f"MOEKIT_AR_{name.upper()}_MAX_KB")


def fusion_spec() -> str:
    """``MOEKIT_FUSIONS``: comma-separated fusion rule names, each prefixed ``-`` (never apply
    it) or ``+`` (apply it and warn, with its reason, where it declines); ``-all`` turns every
    rule off. Read at each planning of a :class:`moekit.fusion.Sequential`."""
    return os.environ.get("MOEKIT_FUSIONS", "")
