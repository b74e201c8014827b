"""Every environment knob moekit reads, in one place (documented in docs/ENV.md).

All knobs are prefixed ``MOEKIT_``; ``TRITON_INTERPRET`` is Triton's own and selects the CPU
interpreter, which is how CI runs the kernels without a GPU.
"""

from __future__ import annotations

import os


def interpret_mode() -> bool:
    """True when Triton kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    """``MOEKIT_AUTOTUNE=0`` turns autotuning off; heuristic tile configs are used instead."""
    return os.environ.get("MOEKIT_AUTOTUNE", "1") != "0"


def symm_pool_bytes(default: int) -> int:
    """Size of the symmetric-memory pool: ``MOEKIT_SYMM_POOL_MB`` (MiB) if set, else ``default``."""
    mb = os.environ.get("MOEKIT_SYMM_POOL_MB")
    return int(float(mb) * (1 << 20)) if mb else default


def env_kib(name: str) -> int | None:
    """A size knob given in KiB (e.g. ``MOEKIT_AR_ONE_SHOT_MAX_KB``), in bytes; None if unset."""
    value = os.environ.get(name)
    return int(float(value) * 1024) if value else None
