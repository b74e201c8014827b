"""Integer helpers for launch sizes on the host.

Triton 3.6 exports ``triton.cdiv`` and ``triton.next_power_of_2`` as constexpr functions, whose
host calls cost microseconds each: too much for code that runs on every call of an op.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ≥ n (0 for n = 0, as triton.next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
