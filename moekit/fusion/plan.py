"""Planning: which basic ops each pass of a :class:`moekit.fusion.Sequential` runs fused.

At each position of the op list the rules of the pass are tried in order (priority, then
registration); the first whose pattern matches the window there and that accepts replaces the
window with its fused op, and planning goes on after the window. Declines (and rules turned
off) are recorded with their reasons. The backward keeps the windows of fused ops that run
both passes and fills the gaps with backward-only rules. Plans depend only on the ops, the
:class:`Facts` of the call and the rule settings, so they are deterministic and cached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from moekit.fusion.op import BasicOp, Decline, FusedOp
from moekit.fusion.registry import PASSES, active_settings, registered_rules, warn_forced

__all__ = ["Declined", "Facts", "Plan", "Step", "make_plan"]


@dataclasses.dataclass(frozen=True)
class Facts:
    """What a rule may know about a call besides its ops: the main input's dtype and device,
    its last dim and rank (never the token count: plans do not change with it), whether
    gradients will be wanted, whether moekit's Triton kernels run there (CUDA, or CPU under
    ``TRITON_INTERPRET=1``), and inside a ``torch.autocast`` region the dtype the call casts
    the parameters to (:meth:`dtype_of` a parameter: the dtype it computes in)."""

    dtype: torch.dtype
    device: torch.device
    hidden: int  # x.shape[-1]
    ndim: int  # x.dim()
    requires_grad: bool
    triton: bool
    param_dtype: torch.dtype | None = None  # the autocast region's dtype; None: outside one

    def dtype_of(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param`` computes in during the call: under autocast every floating
        parameter but fp64 ones is cast to the region's dtype (moekit.ops.autocast_weight)."""
        cast = self.param_dtype
        if cast is None or not param.is_floating_point() or param.dtype == torch.float64:
            return param.dtype
        return cast


@dataclasses.dataclass(frozen=True)
class Step:
    lo: int  # first op of the window
    hi: int  # one past its last op
    rule: str | None  # None: the basic op runs itself
    runner: BasicOp | FusedOp

    def describe(self, ops: Sequence[BasicOp]) -> str:
        names = ", ".join(type(op).__name__ for op in ops[self.lo : self.hi])
        where = f"[{self.lo}]" if self.hi == self.lo + 1 else f"[{self.lo}:{self.hi}]"
        return f"{where} {names}" if self.rule is None else f"{where} {self.rule}({names})"


@dataclasses.dataclass(frozen=True)
class Declined:
    """A rule that did not apply at a window, and why."""

    pass_: str
    lo: int
    hi: int
    rule: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """The steps of each pass and the rules that declined (``str(plan)`` lists them)."""

    ops: tuple[BasicOp, ...]
    facts: Facts
    forward: tuple[Step, ...]
    backward: tuple[Step, ...]  # in forward order; run in reverse
    declined: tuple[Declined, ...]

    def fused(self, pass_: str) -> list[str]:
        """Names of the rules applied in ``pass_`` ("forward" or "backward")."""
        steps = self.forward if pass_ == "forward" else self.backward
        return [s.rule for s in steps if s.rule is not None]

    def __str__(self) -> str:
        lines = []
        for pass_, steps in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"{pass_}:")
            lines += [f"  {s.describe(self.ops)}" for s in steps]
        for d in self.declined:
            lines.append(f"declined in {d.pass_} at [{d.lo}:{d.hi}]: {d.rule} ({d.reason})")
        return "\n".join(lines)


def _extras_used_after(ops: Sequence[BasicOp], i: int, j: int) -> list[str]:
    """Extras made by ``ops[i:j]`` that a later op reads or the chain returns (no op after
    the maker reads them)."""
    used = []
    for k in range(i, j):
        for name in ops[k].extra_outputs:
            read_after = any(name in op.extra_inputs for op in ops[j:])
            returned = not any(name in op.extra_inputs for op in ops[k + 1 :])
            if read_after or returned:
                used.append(name)
    return used


def _fuse(ops, lo, hi, pass_, rules, facts, settings, declined) -> list[Step]:
    disabled, forced = settings
    steps: list[Step] = []
    i = lo
    while i < hi:
        for rule in rules:
            j = i + len(rule.pattern)
            if j > hi or not rule.matches(ops[i:j]):
                continue
            if "all" in disabled or rule.name in disabled:
                declined.append(Declined(pass_, i, j, rule.name, "turned off"))
                continue
            out = rule.fn(ops[i:j], facts)
            if isinstance(out, FusedOp) and not out.makes_extras:
                used = _extras_used_after(ops, i, j)
                if used:
                    out = Decline(f"{', '.join(used)} made in the window are used after it")
            if isinstance(out, FusedOp):
                steps.append(Step(i, j, rule.name, out))
                i = j
                break
            reason = str(out) if out else "declined without a reason"
            declined.append(Declined(pass_, i, j, rule.name, reason))
            if rule.name in forced:
                warn_forced(rule.name, reason)
        else:
            steps.append(Step(i, i + 1, None, ops[i]))
            i += 1
    return steps


def make_plan(ops: tuple[BasicOp, ...], facts: Facts) -> Plan:
    """Plan both passes of ``ops`` for a call with these facts under the current settings."""
    settings = active_settings()
    declined: list[Declined] = []
    fwd = _fuse(ops, 0, len(ops), "forward", registered_rules("forward"), facts, settings, declined)
    both = {r.name for r in registered_rules("forward") if r.passes == PASSES}
    bwd_rules = [r for r in registered_rules("backward") if r.passes == ("backward",)]
    bwd: list[Step] = []
    gap = 0
    for s in fwd:
        if s.rule in both:
            bwd += _fuse(ops, gap, s.lo, "backward", bwd_rules, facts, settings, declined)
            bwd.append(s)
            gap = s.hi
    bwd += _fuse(ops, gap, len(ops), "backward", bwd_rules, facts, settings, declined)
    return Plan(ops, facts, tuple(fwd), tuple(bwd), tuple(declined))
