"""The fusion-rule registry, and which rules are on (``MOEKIT_FUSIONS``, :func:`fusions`).

A rule is a function ``rule(ops, facts) -> FusedOp | Decline`` registered with the pattern of
basic-op types it matches, a priority (higher is tried first; ties in registration order) and
the passes it fuses:

- ``("forward", "backward")``: the fused op runs both passes of its window;
- ``("forward",)``: only the forward; it leaves each op's context as the op's own forward
  would, and the backward is planned separately;
- ``("backward",)``: only the backward, over ops whose forward left their contexts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from moekit import config
from moekit.runtime.state import STATE, warn_once

__all__ = ["Rule", "fusions", "register_fusion", "registered_rules", "unregister_fusion"]

PASSES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A registered rule (see :func:`register_fusion`)."""

    name: str
    fn: Callable[..., Any] = dataclasses.field(repr=False)
    pattern: tuple[Any, ...] = dataclasses.field(repr=False)  # a type (or types) per op
    priority: int
    passes: tuple[str, ...]
    order: int  # registration order, the tie-break between equal priorities

    def matches(self, ops: tuple) -> bool:
        return len(ops) == len(self.pattern) and all(
            isinstance(op, t) for op, t in zip(ops, self.pattern)
        )


def register_fusion(
    rule: Callable[..., Any] | None = None,
    *,
    name: str,
    pattern: Iterable[Any],
    priority: int = 0,
    passes: Iterable[str] = PASSES,
) -> Any:
    """Register ``rule`` under ``name`` (usable as a decorator when ``rule`` is omitted).

    Args:
        rule: ``rule(ops, facts)`` gets a window of basic ops matching ``pattern`` and the
            :class:`moekit.fusion.Facts` of the call; returns a :class:`moekit.fusion.FusedOp`
            or a :class:`moekit.fusion.Decline` (a reason string).
        name: unique name, used by ``MOEKIT_FUSIONS`` and :func:`fusions`.
        pattern: basic-op types of the window, in order (an element may be a tuple of types).
        priority: higher is tried first at each position.
        passes: ``("forward", "backward")``, ``("forward",)`` or ``("backward",)``.
    """
    passes = tuple(passes)
    pattern = tuple(pattern)
    if not isinstance(name, str) or not name or name.startswith(("+", "-")) or "," in name:
        raise ValueError(f"name must be a non-empty str without '+', '-' or ',', got {name!r}")
    if name == "all":
        raise ValueError("name 'all' is reserved (MOEKIT_FUSIONS=-all)")
    if name in STATE.fusion_rules:
        raise ValueError(f"a fusion rule named {name!r} is already registered")
    if passes not in (PASSES, ("forward",), ("backward",)):
        raise ValueError(
            f"passes must be ('forward', 'backward'), ('forward',) or ('backward',), got {passes!r}"
        )
    if not pattern:
        raise ValueError("pattern must name at least one op type")
    if not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"rule must be callable, got {type(fn).__name__}")
        order = max((r.order for r in STATE.fusion_rules.values()), default=-1) + 1
        STATE.fusion_rules[name] = Rule(name, fn, pattern, priority, passes, order)
        STATE.fusion_generation += 1
        return fn

    return register if rule is None else register(rule)


def unregister_fusion(name: str) -> None:
    """Remove the rule ``name``."""
    if name not in STATE.fusion_rules:
        raise ValueError(f"no fusion rule named {name!r}; registered: {sorted(STATE.fusion_rules)}")
    del STATE.fusion_rules[name]
    STATE.fusion_generation += 1


def registered_rules(pass_: str) -> list[Rule]:
    """The rules of one pass, in the order they are tried."""
    rules = [r for r in STATE.fusion_rules.values() if pass_ in r.passes]
    return sorted(rules, key=lambda r: (-r.priority, r.order))


# --- which rules are on -------------------------------------------------------------------


def _parse(spec: str) -> tuple[set[str], set[str]]:
    disabled: set[str] = set()
    forced: set[str] = set()
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        sign, name = item[0], item[1:].strip()
        if sign not in "+-" or not name:
            raise ValueError(
                f"MOEKIT_FUSIONS entries must look like '-name' or '+name', got {item!r}"
            )
        if sign == "+" and name == "all":
            raise ValueError("MOEKIT_FUSIONS: '+all' forces nothing; name the rules to force")
        (disabled if sign == "-" else forced).add(name)
    return disabled, forced


def _names(arg: str, value: object) -> frozenset[str]:
    if isinstance(value, str):  # one name, not its letters
        return frozenset((value,))
    try:
        names = frozenset(value)
    except TypeError:
        raise TypeError(f"{arg} must be a rule name or names, got {type(value).__name__}") from None
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"{arg} must hold rule names (str), got {type(n).__name__}")
    return names


@contextlib.contextmanager
def fusions(
    *, disable: str | Iterable[str] = (), force: str | Iterable[str] = ()
) -> Iterator[None]:
    """Within this block, never apply the rules in ``disable`` (``"all"``: every rule) and
    warn whenever a rule in ``force`` declines; each takes a rule name or names. Blocks nest;
    they add to ``MOEKIT_FUSIONS``."""
    d, f = _names("disable", disable), _names("force", force)
    if "all" in f:
        raise ValueError("fusions(force=...) takes rule names; 'all' forces nothing")
    for n in (d | f) - {"all"}:
        _check_known(n)
    STATE.fusion_overrides.append((d, f))
    try:
        yield
    finally:
        STATE.fusion_overrides.pop()


def _check_known(name: str) -> None:
    if name not in STATE.fusion_rules:
        raise ValueError(f"unknown fusion rule {name!r}; registered: {sorted(STATE.fusion_rules)}")


def settings_key() -> tuple:
    """What the current rule settings depend on (part of every plan's cache key): entering
    the same :func:`fusions` block again finds the plans made in it before."""
    return STATE.fusion_generation, config.fusion_spec(), tuple(STATE.fusion_overrides)


def active_settings() -> tuple[frozenset[str], frozenset[str]]:
    """(disabled, forced) rule names now; ``"all"`` in disabled turns every rule off."""
    disabled, forced = _parse(config.fusion_spec())
    for n in (disabled | forced) - {"all"}:
        if n not in STATE.fusion_rules:
            raise ValueError(
                f"MOEKIT_FUSIONS names unknown fusion rule {n!r}; registered: "
                f"{sorted(STATE.fusion_rules)}"
            )
    for d, f in STATE.fusion_overrides:
        disabled |= d
        forced |= f
    return frozenset(disabled), frozenset(forced)


def warn_forced(name: str, reason: str) -> None:
    """The one-time warning of a forced rule that declined."""
    warn_once(
        ("fusion", name, reason),
        f"moekit.fusion: forced rule {name!r} declined ({reason}); running the unfused ops",
        stacklevel=4,
    )
