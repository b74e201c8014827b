"""How a call of a :class:`moekit.fusion.Sequential` runs its plan: one way, under autograd.

The plan's ops are cut into *segments* at the positions where both passes have a step edge.
A segment that is one step in both passes with an autograd form of its own (a fused op's
moekit op, ``Linear``'s ``F.linear``) runs as that form, and autograd differentiates it like
any torch op. Every maximal run of the other segments runs as one *pipeline node*: an autograd
Function whose forward runs the forward plan's steps of the run and whose backward runs the
backward plan's steps in reverse, so the two passes may fuse different windows there. Extras
cross segments by name; the parameters each op computes with are handed in per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from moekit.fusion.op import BasicOp, OpContext, Params, add_grad
from moekit.fusion.plan import Plan, Step
from moekit.runtime.op import eager_shortcut, function_apply

__all__ = ["Program", "wire"]

# Stands in _Call.out_values for an extra output that the pipeline node returns as a tensor.
_RETURNED = object()


class Program:
    """A plan turned into the runners a call goes through (:meth:`run`)."""

    __slots__ = ("checks", "keys", "outputs", "plan", "region", "runs", "segments", "uncast")

    def __init__(self, plan: Plan, keys: Sequence[tuple[str, ...]]) -> None:
        self.plan, self.keys = plan, tuple(keys)  # keys: each op's parameter names
        self.outputs = frozenset(wire(plan.ops)[1])
        facts = plan.facts
        # inside an autocast region: (device type, the region's dtype)
        self.region = None if facts.param_dtype is None else (facts.device.type, facts.param_dtype)
        self.segments = _segments(plan)
        natives = [step for _, _, step in self.segments if step is not None]
        # basic ops whose autograd form depends on the call (Linear with a main_grad)
        self.checks = tuple((s.lo, s.runner) for s in natives if isinstance(s.runner, BasicOp))
        # the ops whose fused op casts their parameters itself inside the region
        self.uncast = frozenset(i for s in natives if self._in_region(s) for i in range(s.lo, s.hi))
        self.runs: dict[tuple[bool, ...], tuple] = {}

    def _in_region(self, step: Step) -> bool:
        return self.region is not None and getattr(step.runner, "autocast_native", False)

    def run(self, x: torch.Tensor, env: dict, params: Sequence[Params], grad: bool) -> Any:
        """The main output of one call; ``env`` gets every extra made. ``params``: one
        mapping per op; ``grad``: whether a backward may run."""
        ready = tuple(op.autograd_ready(params[i]) for i, op in self.checks) if self.checks else ()
        runs = self.runs.get(ready)
        if runs is None:
            runs = self.runs[ready] = self._runners(ready)
        for runner in runs:
            x = runner(x, env, params, grad)
        return x

    def _runners(self, ready: tuple[bool, ...]) -> tuple:
        """Each native step as itself, every maximal run of the rest as one pipeline node."""
        not_ready = {lo for (lo, _), ok in zip(self.checks, ready) if not ok}
        runs: list[Any] = []
        start = None  # first op of the pipeline node being gathered
        for lo, _, step in self.segments:
            if step is not None and lo not in not_ready:
                if start is not None:
                    runs.append(_Pipeline(self, start, lo))
                    start = None
                runs.append(_Native(step, self.region if self._in_region(step) else None))
            elif start is None:
                start = lo
        if start is not None:
            runs.append(_Pipeline(self, start, len(self.plan.ops)))
        return tuple(runs)


def _segments(plan: Plan) -> list[tuple[int, int, Step | None]]:
    """The plan cut where both passes have a step edge, as (lo, hi, step): ``step`` where
    the segment is one step in both passes with an autograd form, None otherwise."""
    edges = {s.hi for s in plan.forward} & {s.hi for s in plan.backward}
    out = []
    lo = 0
    for hi in sorted(edges):
        fwd = [s for s in plan.forward if lo <= s.lo < hi]
        bwd = [s for s in plan.backward if lo <= s.lo < hi]
        native = fwd == bwd and len(fwd) == 1 and fwd[0].runner.autograd_forward is not None
        out.append((lo, hi, fwd[0] if native else None))
        lo = hi
    return out


class _Native:
    """A step run as its autograd form. With ``region`` (an ``autocast_native`` fused op in
    an autocast region) it runs with the region on: its ops cast the parameters themselves."""

    __slots__ = ("basic", "form", "hi", "lo", "region")

    def __init__(self, step: Step, region: tuple[str, torch.dtype] | None) -> None:
        self.lo, self.hi, self.form = step.lo, step.hi, step.runner.autograd_forward
        self.basic = isinstance(step.runner, BasicOp)
        self.region = region

    def __call__(self, x: torch.Tensor, env: dict, params: Sequence[Params], grad: bool) -> Any:
        p = params[self.lo] if self.basic else params[self.lo : self.hi]
        if self.region is None:
            y, made = self.form(x, env, p)
        else:
            with torch.autocast(self.region[0], dtype=self.region[1]):
                y, made = self.form(x, env, p)
        if made:
            env.update(made)
        return y


class _Pipeline:
    """Ops ``[lo, hi)`` run step by step: under autograd as one node (:class:`_PipelineFn`)
    whose inputs are x, the tensor extras the ops read from outside the window and their
    parameters, and whose outputs are the main output and the extras needed after it."""

    __slots__ = ("bwd", "fwd", "hi", "index", "lo", "outs", "reads")

    def __init__(self, prog: Program, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        ops = prog.plan.ops
        made: set[str] = set()
        reads: list[str] = []
        for op in ops[lo:hi]:
            reads += [n for n in op.extra_inputs if n not in made and n not in reads]
            made.update(op.extra_outputs)
        after = {n for op in ops[hi:] for n in op.extra_inputs} | prog.outputs
        self.reads = tuple(reads)
        self.outs = tuple(n for op in ops[lo:hi] for n in op.extra_outputs if n in after)
        # the steps of each pass, as (lo, hi, runner) relative to the window
        fwd = [s for s in prog.plan.forward if lo <= s.lo < hi]
        self.fwd = tuple((s.lo - lo, s.hi - lo, s.runner) for s in fwd)
        bwd = [s for s in prog.plan.backward if lo <= s.lo < hi]
        self.bwd = tuple((s.lo - lo, s.hi - lo, s.runner) for s in reversed(bwd))
        # where each op's parameters sit among the node's parameter inputs
        index, pos = [], 0
        for keys in prog.keys[lo:hi]:
            index.append({k: pos + j for j, k in enumerate(keys)})
            pos += len(keys)
        self.index = tuple(index)

    def __call__(self, x: torch.Tensor, env: dict, params: Sequence[Params], grad: bool) -> Any:
        p = params[self.lo : self.hi]
        if not grad:
            return self.forward(x, env, p, False, False)[0]
        tensor_reads = [n for n in self.reads if isinstance(env[n], torch.Tensor)]
        tensors = [env[n] for n in tensor_reads]
        call = _Call(self, dict(env), p, tensor_reads)
        inputs = (call, x, *tensors, *[t for d in p for t in d.values()])
        if eager_shortcut((x, *tensors)):  # the C++ apply (see moekit.runtime.op)
            outs = _apply_pipeline.direct(*inputs)
        else:
            outs = _PipelineFn.apply(*inputs)
        if not self.outs:
            return outs
        it = iter(outs[1:])
        for n, v in zip(self.outs, call.out_values):
            env[n] = next(it) if v is _RETURNED else v
        call.out_values = []
        return outs[0]

    def forward(self, x: torch.Tensor, env: dict, params, needs_grad: bool, saving: bool):
        """(y, contexts) of the window's forward steps; ``env`` gets the extras made."""
        ctxs = [OpContext(saving) for _ in range(self.hi - self.lo)]
        ctxs[0].needs_input_grad = needs_grad
        for lo, hi, runner in self.fwd:
            if isinstance(runner, BasicOp):
                x, made = runner.op_forward(ctxs[lo], x, env, params[lo])
            else:
                x, made = runner.fuser_forward(ctxs[lo:hi], x, env, params[lo:hi])
            if made:
                env.update(made)
        return x, ctxs

    def backward(self, call: _Call, dy: torch.Tensor, douts: tuple) -> tuple:
        """The gradients of the node's inputs (after ``call``), from its outputs'."""
        ctxs, params = call.ctxs, call.params
        call.ctxs, call.params = [], ()  # the saved state goes with this backward
        grads = {n: g for n, g in zip(call.returned, douts) if g is not None}
        param_grads: list[Any] = [None] * sum(len(i) for i in self.index)
        for lo, hi, runner in self.bwd:
            if isinstance(runner, BasicOp):
                dy, input_grads, own = runner.op_backward(ctxs[lo], dy, grads, params[lo])
                per_op = (own,)
            else:
                dy, input_grads, per_op = runner.fuser_backward(
                    ctxs[lo:hi], dy, grads, params[lo:hi]
                )
            for name, g in (input_grads or {}).items():
                add_grad(grads, name, g)
            for k, pg in enumerate(per_op):
                self._place(param_grads, lo + k, pg)
        return (None, dy, *[grads.get(n) for n in call.tensor_reads], *param_grads)

    def _place(self, out: list, i: int, grads: Any) -> None:
        index = self.index[i]
        for name, g in (grads or {}).items():
            if name not in index and g is not None:
                raise RuntimeError(
                    f"moekit.fusion: the backward of op {self.lo + i} returned a gradient for "
                    f"{name!r}, not one of its parameters {tuple(index)}"
                )
            if g is not None:
                out[index[name]] = g


class _Call:
    """One pipeline node's call state (its non-tensor arguments and results).

    After the forward it holds no tensor that the node returns: autograd points each returned
    tensor at the node, which holds this call, and a reference back would make a cycle that
    keeps the whole graph (saved activations, the leaves' gradient accumulators) alive until
    Python's garbage collector runs. ``params`` (the tensors the ops computed with) and the
    contexts go with the backward."""

    __slots__ = ("ctxs", "env", "out_values", "params", "returned", "tensor_reads", "window")

    def __init__(self, window: _Pipeline, env: dict, params: tuple, tensor_reads: list) -> None:
        self.window, self.env, self.params, self.tensor_reads = window, env, params, tensor_reads
        self.ctxs: list[OpContext] = []
        self.out_values: list[Any] = []  # per extra output: its value, or _RETURNED
        self.returned: list[str] = []  # the extra outputs returned as tensors


def _distinct(t: torch.Tensor, others) -> torch.Tensor:
    """``t``, or a copy of it when it is one of ``others`` (an autograd Function returns each
    tensor object once, and none of its inputs)."""
    for u in others:
        if t is u:
            return t.clone()
    return t


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the pipeline node returns it: detached where autograd would otherwise see a
    graph of its own or a view (see ``_PipelineFn.forward``)."""
    return t.detach() if t.requires_grad or t._is_view() else t


class _PipelineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, x: torch.Tensor, *args: torch.Tensor):
        env, call.env = call.env, None
        window = call.window
        y, call.ctxs = window.forward(x, env, call.params, ctx.needs_input_grad[1], True)
        ctx.call = call
        ctx.main_meta = (y.shape, y.dtype, y.device)
        ctx.set_materialize_grads(False)
        # An output that is an input or an earlier output is copied first (a detached alias
        # would let an in-place update of it rewrite the input unseen). An output made by a
        # recorded graph (RecordedGraph) is detached: autograd would re-point its grad_fn at
        # this node, looping the graph's own backward into this one. So is a view (e.g. rows
        # reshaped to x's shape): returned as is it would be a view for autograd, which
        # FSDP2's output hooks warn about (detach shares its version counter, so in-place use
        # stays checked).
        made = y
        y = _detached(_distinct(y, (x, *args)))
        if not window.outs:
            return y
        tensors, taken = [y], [x, *args, made]
        for n in window.outs:
            t = env[n]
            if isinstance(t, torch.Tensor):
                tensors.append(_detached(_distinct(t, taken)))
                taken.append(t)
                call.returned.append(n)
            call.out_values.append(_RETURNED if isinstance(t, torch.Tensor) else t)
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tuple(tensors)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, *douts: torch.Tensor | None):
        if torch.is_grad_enabled():  # create_graph=True: this backward is not differentiable
            raise RuntimeError(
                "moekit.fusion.Sequential does not support a double backward (create_graph=True)"
            )
        call: _Call = ctx.call
        if not call.ctxs:
            raise RuntimeError(
                "moekit.fusion.Sequential: a second backward through the same graph "
                "(retain_graph=True) is not supported; its saved state is freed by the first"
            )
        if dy is None:  # the main output took no part in the loss
            shape, dtype, device = ctx.main_meta
            dy = torch.zeros(shape, dtype=dtype, device=device)
        return call.window.backward(call, dy, douts)


_apply_pipeline = function_apply(_PipelineFn)


def wire(ops: Sequence[BasicOp]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(extra inputs the caller passes, extra outputs returned), checked for consistency."""
    made: dict[str, int] = {}
    inputs: list[str] = []
    for i, op in enumerate(ops):
        for n in op.extra_inputs:
            if n not in made and n not in inputs:
                inputs.append(n)
        for n in op.extra_outputs:
            if n in made:
                raise ValueError(f"extra {n!r} is made by op {made[n]} and again by op {i}")
            if n in inputs:
                raise ValueError(
                    f"extra {n!r} is read before op {i} ({type(op).__name__}) makes it"
                )
            made[n] = i
    outputs = tuple(
        n for n, i in made.items() if not any(n in op.extra_inputs for op in ops[i + 1 :])
    )
    return tuple(inputs), outputs
