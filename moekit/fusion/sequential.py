"""``moekit.fusion.Sequential``: a chain of basic ops run with whatever fusions apply.

Autograd runs at the pipeline level: one autograd node for the whole chain, whose forward runs
the forward plan and whose backward runs the backward plan, so the two passes may fuse
different windows (see :mod:`moekit.fusion.plan`). Where both passes run the same steps and
each has an autograd form of its own (a fused op's moekit op, ``Linear``'s ``F.linear``), the
chain runs those forms one after another instead and autograd differentiates them: the same
result for less host time.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moekit.fusion.op import BasicOp, OpContext, add_grad
from moekit.fusion.plan import Facts, Plan, make_plan
from moekit.fusion.registry import settings_key
from moekit.ops.autocast import autocast_on
from moekit.ops.custom_op import eager_shortcut, function_apply
from moekit.runtime.device import use_triton
from moekit.runtime.state import STATE

__all__ = ["Sequential"]

_MAX_PLANS = 64


def _on_parameter_registered(module, name, param):
    STATE.param_generation += 1


def _watch_parameter_registrations() -> None:
    """Count every parameter registration from now on (``op.weight = Parameter(...)``,
    ``load_state_dict(assign=True)``): a Sequential then collects its parameters again. A
    process-wide nn.Module hook, installed by the first Sequential, not at import."""
    if STATE.param_hook is None:
        register = torch.nn.modules.module.register_module_parameter_registration_hook
        STATE.param_hook = register(_on_parameter_registered)


class _Program:
    """A plan turned into the calls each pass makes."""

    __slots__ = ("bwd", "fwd", "n_ops", "n_params", "plan", "ready", "slices", "steps")

    def __init__(self, plan: Plan, slices: tuple[tuple[int, int], ...]) -> None:
        self.plan, self.slices, self.n_ops = plan, slices, len(plan.ops)
        self.n_params = slices[-1][1] if slices else 0
        # Both passes run the same steps and each has an autograd form: the call runs those
        # forms one after another and autograd differentiates them, with no pipeline node
        # (see FusedOp.autograd_forward) -- when every basic op among them is ready for it.
        self.steps = self.ready = None
        if plan.backward == plan.forward:
            forms = tuple(getattr(s.runner, "autograd_forward", None) for s in plan.forward)
            if all(forms):
                self.steps = forms
                self.ready = tuple(
                    s.runner.autograd_ready for s in plan.forward if isinstance(s.runner, BasicOp)
                )
        self.fwd = tuple(_forward_call(s.lo, s.hi, s.runner) for s in plan.forward)
        self.bwd = tuple(
            (_backward_call(s.lo, s.hi, s.runner), s.lo) for s in reversed(plan.backward)
        )


def _forward_call(lo: int, hi: int, runner: Any) -> Callable:
    if isinstance(runner, BasicOp):
        return lambda ctxs, x, env: runner.op_forward(ctxs[lo], x, env)
    return lambda ctxs, x, env: runner.fuser_forward(ctxs[lo:hi], x, env)


def _backward_call(lo: int, hi: int, runner: Any) -> Callable:
    if isinstance(runner, BasicOp):

        def basic(ctxs, dy, grads):
            dx, input_grads, param_grads = runner.op_backward(ctxs[lo], dy, grads)
            return dx, input_grads, (param_grads,)

        return basic
    return lambda ctxs, dy, grads: runner.fuser_backward(ctxs[lo:hi], dy, grads)


def _run_forward(
    prog: _Program, x: torch.Tensor, env: dict, first_needs_grad: bool = False, saving=False
) -> tuple[torch.Tensor, list]:
    ctxs = [OpContext(saving) for _ in range(prog.n_ops)]
    ctxs[0].needs_input_grad = first_needs_grad
    for call in prog.fwd:
        x, made = call(ctxs, x, env)
        if made:
            env.update(made)
    return x, ctxs


# Stands in _Call.out_values for an extra output that the Function returns as a tensor.
_RETURNED = object()
# What Sequential._autocast_native returns for a call it does not run.
_NOT_NATIVE = object()


class _Call:
    """One call's state, handed to the autograd Function (non-tensor arguments and results).

    After the forward it holds no tensor that the Function returns: autograd points each
    returned tensor at the Function's node, which holds this call, and a reference back would
    make a cycle that keeps the whole graph (saved activations, the leaves' gradient
    accumulators) alive until Python's garbage collector runs. ``swap``: the parameter slots
    and the tensors the forward used for them (the parameters, or per-call casts under
    autocast), which the backward's ops must read too."""

    __slots__ = (
        "ctxs", "env", "out_names", "out_values", "param_dtypes", "prog", "swap", "tensor_names"
    )  # fmt: skip

    def __init__(self, prog, env, tensor_names, out_names, swap=None, param_dtypes=None) -> None:
        self.prog, self.env, self.tensor_names, self.out_names = prog, env, tensor_names, out_names
        self.swap = swap
        self.param_dtypes = param_dtypes  # the parameters' dtypes where their casts are inputs
        self.ctxs: list[OpContext] = []
        self.out_values: list[Any] = []  # per extra output: its value, or _RETURNED


def _registered_otherwise(slots, tensors) -> bool:
    """Whether a slot holds another tensor than the forward used: per-call casts, or
    parameters a caller swapped in for the forward only (``torch.func.functional_call``)."""
    for mod, name, i in slots:  # noqa: SIM110 - a loop: a generator costs more here
        if mod._parameters.get(name) is not tensors[i]:
            return True
    return False


@contextlib.contextmanager
def _swapped(slots: Sequence[tuple[nn.Module, str, int]], tensors: Sequence[torch.Tensor]):
    """The ops' parameters replaced by ``tensors`` (slot ``(module, name, i)`` reads
    ``tensors[i]``) for the duration: the ops read ``self.weight`` in both passes, so a
    per-call cast must stand in for the parameter in both."""
    old = [mod._parameters[name] for mod, name, _ in slots]
    for mod, name, i in slots:
        mod._parameters[name] = tensors[i]
    key = id(slots)
    STATE.standing_in[key] = STATE.standing_in.get(key, 0) + 1
    try:
        yield
    finally:
        for (mod, name, _), p in zip(slots, old):
            mod._parameters[name] = p
        if STATE.standing_in[key] == 1:
            del STATE.standing_in[key]
        else:
            STATE.standing_in[key] -= 1


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
        if call.tensor_names:
            env.update(zip(call.tensor_names, args))
        y, ctxs = _run_forward(call.prog, x, env, ctx.needs_input_grad[1], True)
        call.ctxs = ctxs
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
        if not call.out_names:
            return y
        outs = [env[n] for n in call.out_names]
        call.out_values = [_RETURNED if isinstance(t, torch.Tensor) else t for t in outs]
        tensors, taken = [y], [x, *args, made]
        for t in outs:
            if isinstance(t, torch.Tensor):
                tensors.append(_detached(_distinct(t, taken)))
                taken.append(t)
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tuple(tensors)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, *douts: torch.Tensor | None):
        if torch.is_grad_enabled():  # create_graph=True: this backward is not differentiable
            raise RuntimeError(
                "moekit.fusion.Sequential does not support a double backward (create_graph=True)"
            )
        call: _Call = ctx.call
        swap, call.swap = call.swap, None  # e.g. autocast's casts go with this backward
        if swap is not None and _registered_otherwise(*swap):
            with _swapped(*swap):
                return _PipelineFn.run_backward(ctx, call, dy, douts)
        return _PipelineFn.run_backward(ctx, call, dy, douts)

    @staticmethod
    def run_backward(ctx, call: _Call, dy: torch.Tensor | None, douts: tuple) -> tuple:
        prog, ctxs = call.prog, call.ctxs
        if not ctxs:
            raise RuntimeError(
                "moekit.fusion.Sequential: a second backward through the same graph "
                "(retain_graph=True) is not supported; its saved state is freed by the first"
            )
        call.ctxs = []  # the saved state goes with this backward
        grads: dict[str, Any] = {}
        if douts:
            names = [n for n, v in zip(call.out_names, call.out_values) if v is _RETURNED]
            for n, g in zip(names, douts):
                if g is not None:
                    grads[n] = g
        if dy is None:  # the main output took no part in the loss
            shape, dtype, device = ctx.main_meta
            dy = torch.zeros(shape, dtype=dtype, device=device)
        param_grads: list[Any] = [None] * prog.n_params
        slices = prog.slices
        for call_bwd, lo in prog.bwd:
            dy, input_grads, per_op = call_bwd(ctxs, dy, grads)
            if input_grads:
                for name, g in input_grads.items():
                    add_grad(grads, name, g)
            for k, pg in enumerate(per_op):
                start, end = slices[lo + k]
                if len(pg) != end - start:
                    _wrong_count(prog, lo + k, len(pg), end - start)
                param_grads[start:end] = pg
        dtypes = call.param_dtypes
        if dtypes is not None:  # casts outside autograd: each gradient in its parameter's dtype
            param_grads = [
                g.to(d) if isinstance(g, torch.Tensor) and g.dtype != d else g
                for g, d in zip(param_grads, dtypes)
            ]
        if call.tensor_names:
            return (None, dy, *[grads.get(n) for n in call.tensor_names], *param_grads)
        return (None, dy, *param_grads)


def _wrong_count(prog: _Program, i: int, got: int, want: int) -> None:
    raise RuntimeError(
        f"moekit.fusion: the backward of op {i} ({type(prog.plan.ops[i]).__name__}) returned "
        f"{got} parameter gradients for its {want} parameters"
    )


_apply_pipeline = function_apply(_PipelineFn)


class Sequential(nn.Module):
    """A chain of :class:`moekit.fusion.BasicOp` s (positionally, or an ``OrderedDict`` of
    named ops) that runs fused ops wherever a registered rule applies.

    ``forward(x, *extra_inputs, **named_extra_inputs)``: ``x`` is the main input; the extra
    inputs are those the ops read that no earlier op makes, in order of first use
    (:attr:`extra_input_names`), positionally or by name. Returns the main output, or
    ``(main, *extra_outputs)`` when ops make extras no later op reads
    (:attr:`extra_output_names`).

    Fused ops own no parameters: the state dict, the parameters an optimizer sees and every
    result are the same whichever fusions run (up to rounding). :meth:`plan` shows what runs.
    """

    def __init__(self, *ops: BasicOp | OrderedDict) -> None:
        super().__init__()
        _watch_parameter_registrations()
        if len(ops) == 1 and isinstance(ops[0], OrderedDict):
            named = list(ops[0].items())
        else:
            named = [(str(i), op) for i, op in enumerate(ops)]
        if not named:
            raise ValueError("Sequential needs at least one op")
        for name, op in named:
            if not isinstance(op, BasicOp):
                raise TypeError(
                    f"op {name!r} must be a moekit.fusion basic op, got {type(op).__name__}"
                )
            self.add_module(name, op)
        self.ops: tuple[BasicOp, ...] = tuple(op for _, op in named)
        self.extra_input_names, self.extra_output_names = _wire(self.ops)
        # extras cast with x under autocast whatever their shape (a residual stream that meets
        # the main tensor after a row-parallel Linear has changed its width)
        self._autocast_extras = frozenset(
            n for op in self.ops for n in op.autocast_extras if n in self.extra_input_names
        )
        self._programs: OrderedDict[tuple, _Program] = OrderedDict()
        self._refresh_params()

    def __getitem__(self, i: int) -> BasicOp:
        return self.ops[i]

    def __len__(self) -> int:
        return len(self.ops)

    def _refresh_params(self) -> None:
        params: list[nn.Parameter] = []
        slices = []
        for op in self.ops:
            own = list(op.parameters())
            slices.append((len(params), len(params) + len(own)))
            params += own
        params, slices = tuple(params), tuple(slices)
        self._params_generation = STATE.param_generation
        old = getattr(self, "_params", None)
        if old is not None and len(old) == len(params) and all(map(operator.is_, old, params)):
            return  # another module's parameter: the plans hold
        # New objects of the same kind (FSDP2's unsharded / sharded parameters, a
        # functional_call's tensors) keep the plans, which the rules made from these facts.
        same = old is not None and list(map(_param_facts, old)) == list(map(_param_facts, params))
        self._params, self._slices = params, slices
        # Where each parameter is registered (a shared one in every place), for per-call casts
        index = {id(p): i for i, p in enumerate(params)}
        self._slots = tuple(
            (mod, name, index[id(p)])
            for mod in self.modules()
            for name, p in mod._parameters.items()
            if p is not None and id(p) in index
        )
        if not same:
            self._programs.clear()

    def _params_replaced(self) -> bool:
        """Whether a parameter was replaced without the registration hook: FSDP2's unshard /
        reshard and ``torch.func.functional_call`` write ``_parameters`` directly, and the
        call must use (and send gradients to) the tensors registered now. Not while this
        chain's own stand-ins are swapped in: a call re-entered then (activation
        checkpointing's recompute inside the backward) must not adopt per-call casts as
        its parameters."""
        if id(self._slots) in STATE.standing_in:
            return False
        return _registered_otherwise(self._slots, self._params)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(): parameters may change
        out = super()._apply(fn, recurse)
        self._refresh_params()
        # The parameter objects usually survive a cast in place, but the rules decided on
        # their dtypes and devices: plan afresh.
        self._programs.clear()
        return out

    # --- planning ---------------------------------------------------------------------------

    def _facts(self, x: torch.Tensor, requires_grad: bool) -> Facts:
        return Facts(x.dtype, x.device, x.shape[-1], x.dim(), requires_grad, use_triton(x))

    def _program(self, x: torch.Tensor, requires_grad: bool, casting: bool = False) -> _Program:
        # ``casting``: the parameters are per-call casts (autocast), of other dtypes than theirs
        key = (x.dtype, x.device, x.shape[-1], x.dim(), requires_grad, settings_key(), casting)
        programs = self._programs
        prog = programs.get(key)
        if prog is not None:
            if len(programs) > 1:
                programs.move_to_end(key)
        else:
            prog = _Program(make_plan(self.ops, self._facts(x, requires_grad)), self._slices)
            if len(programs) >= _MAX_PLANS:
                programs.popitem(last=False)
            programs[key] = prog
        return prog

    def plan(
        self,
        x: torch.Tensor | None = None,
        *,
        requires_grad: bool | None = None,
    ) -> Plan:
        """The plan a call with main input ``x`` runs (default: an input of the parameters'
        dtype and device), inside a ``torch.autocast`` region when called in one.
        ``str(plan)`` lists each pass's steps and every decline with its reason."""
        if x is None:
            p = self._params[0] if self._params else None
            x = torch.empty(
                0, _hidden_hint(self.ops), dtype=p.dtype if p is not None else None,
                device=p.device if p is not None else None,
            )  # fmt: skip
        if requires_grad is None:
            requires_grad = True
        if self._params_generation != STATE.param_generation or self._params_replaced():
            self._refresh_params()
        if autocast_on(x.device.type):
            x, _, _, casts = self._autocast_inputs(x, (), {}, cast=_cast_like)
            if casts is not None:
                with _swapped(self._slots, casts):
                    return self._program(x, requires_grad, True).plan
        return self._program(x, requires_grad).plan

    def extra_repr(self) -> str:
        try:
            text = str(self.plan())
        except Exception as e:  # a repr must not raise; say why there is no plan
            text = f"no plan: {e}"
        return "plan:\n  " + text.replace("\n", "\n  ")

    # --- running ----------------------------------------------------------------------------

    def _extras(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self.extra_input_names
        if len(args) > len(names):
            raise TypeError(
                f"Sequential takes {len(names)} extra input(s) {names}, got {len(args)}"
            )
        env = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in names:
                raise TypeError(f"unexpected extra input {k!r}; this chain reads {names}")
            if k in env:
                raise TypeError(f"extra input {k!r} given both by position and by name")
            env[k] = v
        if len(env) != len(names):
            missing = [n for n in names if n not in env]
            raise TypeError(f"missing extra input(s) {missing}; this chain reads {names}")
        return env

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self._params_generation != STATE.param_generation or self._params_replaced():
            self._refresh_params()
        if autocast_on(x.device.type):
            return self._forward_under_autocast(x, args, kwargs)
        return self._run(x, args, kwargs, self._params)

    def _run(
        self,
        x: torch.Tensor,
        args: tuple,
        kwargs: dict,
        params: tuple,
        casts: bool = False,
        masters: bool = False,
    ) -> Any:
        """One call with ``params`` standing in for the parameters (the parameters
        themselves, or with ``casts`` their per-call casts, swapped in by the caller; with
        ``masters`` the casts are outside autograd and the parameters take their gradients
        directly)."""  # fmt: skip
        names = self.extra_input_names
        if not kwargs and len(args) == len(names):  # every extra by position: nothing to check
            env = dict(zip(names, args))
        else:
            env = self._extras(args, kwargs)
        requires_grad = torch.is_grad_enabled() and (
            x.requires_grad or _any_requires_grad(params) or _any_requires_grad(env.values())
        )
        prog = self._program(x, requires_grad, casts)
        out_names = self.extra_output_names
        if prog.steps is not None and _all_true(prog.ready):
            if masters and requires_grad:  # autograd differentiates the steps: join the casts
                joined = tuple(
                    c if c is p or not p.requires_grad else _JoinedCast.apply(p, c)
                    for p, c in zip(self._params, params)
                )
                with _swapped(self._slots, joined):
                    return _run_steps(prog, x, env, out_names)
            return _run_steps(prog, x, env, out_names)
        if not requires_grad:
            y, _ = _run_forward(prog, x, env)
            return (y, *[env[n] for n in out_names]) if out_names else y
        tensor_names = [n for n, v in env.items() if isinstance(v, torch.Tensor)]
        tensors = [env.pop(n) for n in tensor_names]
        inputs = self._params if masters else params
        dtypes = tuple(p.dtype for p in inputs) if masters else None
        call = _Call(prog, env, tensor_names, out_names, (self._slots, params), dtypes)
        if eager_shortcut((x, *tensors)):  # the C++ apply (see moekit.ops.custom_op)
            outs = _apply_pipeline.direct(call, x, *tensors, *inputs)
        else:
            outs = _PipelineFn.apply(call, x, *tensors, *inputs)
        if not out_names:
            return outs
        it = iter(outs[1:])
        extra = [next(it) if v is _RETURNED else v for v in call.out_values]
        return (outs[0], *extra)

    def _autocast_inputs(
        self, x: torch.Tensor, args: tuple, kwargs: dict, cast: Callable | None = torch.Tensor.to
    ) -> tuple:
        """(x, args, kwargs, casts) as a call inside an autocast region runs them: x, the
        floating extra inputs of x's dtype that have its shape or that an op reads in the
        chain's dtype (``BasicOp.autocast_extras``, e.g. a residual), and the floating
        parameters in the region's dtype (fp64 left alone, as autocast does); ``casts`` is
        None when no parameter needs one (or ``cast`` is None: the parameters are left
        alone)."""
        dtype = torch.get_autocast_dtype(x.device.type)

        def eligible(t: Any) -> bool:
            return (
                isinstance(t, torch.Tensor)
                and t.is_floating_point()
                and t.dtype not in (dtype, torch.float64)
            )

        casts = None
        if cast is not None and any(eligible(p) for p in self._params):
            made: dict[int, torch.Tensor] = {}  # a tied parameter is cast once
            for p in self._params:
                if eligible(p) and id(p) not in made:
                    made[id(p)] = cast(p, dtype)
            casts = tuple(made.get(id(p), p) for p in self._params)
        if eligible(x):
            follows = self._autocast_extras

            def alike(name: str | None, v: Any) -> Any:
                same = (
                    isinstance(v, torch.Tensor)
                    and v.dtype == x.dtype
                    and (v.shape == x.shape or name in follows)
                )
                return v.to(dtype) if same else v

            names = self.extra_input_names
            args = tuple(alike(names[i] if i < len(names) else None, v) for i, v in enumerate(args))
            kwargs = {k: alike(k, v) for k, v in kwargs.items()}
            x = x.to(dtype)
        return x, args, kwargs, casts

    def _forward_under_autocast(self, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Inside a ``torch.autocast`` region the chain runs in the region's dtype with
        autocast off, as the chain converted to that dtype would (``.to(dtype)``) run outside
        it: x and the floating extra inputs of x's shape and dtype (a residual stream
        travelling with it) are cast, and so is every floating parameter, per call, as
        ``F.linear`` casts its weight. The ops read their parameters in the forward and the
        backward, so the casts stand in for the parameters in both passes; gradients reach
        the parameters through the casts, in their own dtype (their ``main_grad`` is not
        used)."""
        # Outside a trace the casts are made outside autograd and the parameters themselves are
        # the pipeline's inputs: the backward hands each gradient over in its parameter's
        # dtype, which the ops may write directly (see moekit.fusion.op.grad_dtype).
        masters = not torch.compiler.is_compiling()
        x, args, kwargs, _ = self._autocast_inputs(x, args, kwargs, cast=None)
        if masters:
            out = self._autocast_native(x, args, kwargs)
            if out is not _NOT_NATIVE:
                return out
        cast = _detached_cast if masters else torch.Tensor.to
        casts = self._autocast_inputs(x, (), {}, cast=cast)[3]  # x is in the region's dtype now
        with torch.autocast(x.device.type, enabled=False):
            if casts is None:
                return self._run(x, args, kwargs, self._params)
            with _swapped(self._slots, casts):
                return self._run(x, args, kwargs, casts, True, masters)

    def _autocast_native(self, x: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """The call under autocast (``x`` and the extras already cast) when every step of its
        plan is an ``autocast_native`` fused op's autograd form: those run inside the region on
        the parameters themselves (their ops cast, and write fp32 weights' gradients in fp32);
        ``_NOT_NATIVE`` otherwise."""
        env = self._extras(args, kwargs)
        requires_grad = torch.is_grad_enabled() and (
            x.requires_grad or _any_requires_grad(self._params) or _any_requires_grad(env.values())
        )
        key = (x.dtype, x.device, x.shape[-1], x.dim(), requires_grad, settings_key(), True)
        prog = self._programs.get(key)
        if prog is None:  # plan as the casts would, on stand-ins without data
            _, _, _, casts = self._autocast_inputs(x, (), {}, cast=_cast_like)
            with _swapped(self._slots, casts or self._params):
                prog = self._program(x, requires_grad, True)
        if not (requires_grad and prog.steps is not None and _all_true(prog.ready)):
            return _NOT_NATIVE
        if not all(getattr(s.runner, "autocast_native", False) for s in prog.plan.forward):
            return _NOT_NATIVE
        return _run_steps(prog, x, env, self.extra_output_names)

    def reference(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The chain in plain differentiable PyTorch, op by op (each op's ``reference``): the
        oracle the fused and unfused runs are tested against."""
        env = self._extras(args, kwargs)
        for op in self.ops:
            x, made = op.reference(x, env)
            env.update(made)
        out_names = self.extra_output_names
        return (x, *(env[n] for n in out_names)) if out_names else x


def _param_facts(p: torch.Tensor) -> tuple:
    """What the rules may have planned on about a parameter."""
    return (type(p), p.dtype, p.device, p.shape, p.requires_grad)


def _run_steps(prog: _Program, x: torch.Tensor, env: dict, out_names: tuple) -> Any:
    """The plan's steps through their autograd forms (see ``_Program.steps``)."""
    for step in prog.steps:
        x, made = step(x, env)
        if made:
            env.update(made)
    return (x, *[env[n] for n in out_names]) if out_names else x


class _JoinedCast(torch.autograd.Function):
    """A cast made outside autograd, joined to its parameter for a differentiating caller:
    the cast's values, with the gradient handed to the parameter in the parameter's dtype."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def _detached_cast(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``p`` in ``dtype`` outside autograd, standing in for ``p`` in the ops (a leaf that
    requires grad where ``p`` does); the ops' backward may write its gradient in ``p``'s
    dtype (:func:`moekit.fusion.op.grad_dtype`)."""
    cast = p.detach().to(dtype)
    if p.requires_grad:
        cast.requires_grad_()
        cast.moekit_grad_dtype = p.dtype
    return cast


def _cast_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for ``p.to(dtype)`` with no data (planning needs dtypes, not values)."""
    return torch.empty_like(p, dtype=dtype).requires_grad_(p.requires_grad)


def _any_requires_grad(values) -> bool:
    """Whether any of ``values`` (parameters, or extras of any type) is a tensor that requires
    grad."""
    for v in values:  # noqa: SIM110 - a loop, not any(...): a generator costs more here
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def _all_true(checks) -> bool:
    for check in checks:  # noqa: SIM110 - a loop, not all(...): a generator costs more here
        if not check():
            return False
    return True


def _hidden_hint(ops: tuple[BasicOp, ...]) -> int:
    """The main input's last dim as the first op expects it (for plan() without an input)."""
    op = ops[0]
    return int(getattr(op, "in_features", None) or getattr(op, "hidden_size", 0) or 0)


def _wire(ops: tuple[BasicOp, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
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
