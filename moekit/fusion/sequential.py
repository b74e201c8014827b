"""``moekit.fusion.Sequential``: a chain of basic ops run with whatever fusions apply.

A call reads the tensors registered as its ops' parameters now (what FSDP2 or
``torch.func.functional_call`` put there included), plans for its facts (cached), and runs the
plan the one way :mod:`moekit.fusion.fuser` runs plans, handing each op the tensors it computes
with. Inside a ``torch.autocast`` region those are the parameters' casts, made per call by
:func:`moekit.ops.autocast.autocast_weight`; nothing is ever put in place of a parameter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from moekit.fusion.fuser import Program, wire
from moekit.fusion.op import BasicOp, Params
from moekit.fusion.plan import Facts, Plan, make_plan
from moekit.fusion.registry import settings_key
from moekit.ops.autocast import autocast_on, autocast_weight
from moekit.runtime.device import use_triton

__all__ = ["Sequential"]

_MAX_PLANS = 64


class _Slots:
    """Where each op of a chain registers its parameters (every ``_parameters`` entry of the
    op and its submodules), and the tensors registered there when it was made."""

    __slots__ = ("keys", "params", "seen", "sizes", "tensors")

    def __init__(self, ops: Iterable[BasicOp]) -> None:
        where, sizes = [], []
        for op in ops:
            entries = []
            for prefix, mod in op.named_modules():
                store = mod._parameters
                sizes.append((store, len(store)))
                entries += [(f"{prefix}.{name}" if prefix else name, store, name) for name in store]
            where.append(entries)
        self.keys = tuple(tuple(k for k, _, _ in w) for w in where)  # each op's names
        self.sizes = tuple(sizes)
        self.params: tuple[Params, ...] = tuple({k: s[n] for k, s, n in w} for w in where)
        self.seen = tuple((s, n, s[n]) for w in where for _, s, n in w)
        self.tensors = tuple(t for _, _, t in self.seen if t is not None)

    def current(self) -> bool:
        """Whether the same tensors are registered in the same places as when it was made."""
        for store, name, t in self.seen:
            if store.get(name) is not t:
                return False
        # a parameter added or removed; a loop, not all(...): a generator costs more here
        for store, n in self.sizes:  # noqa: SIM110
            if len(store) != n:
                return False
        return True

    def facts(self) -> tuple:
        """What the rules may have planned on about the parameters."""
        facts = [(type(p), p.dtype, p.device, p.shape, p.requires_grad) for p in self.tensors]
        return self.keys, facts


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
        self.extra_input_names, self.extra_output_names = wire(self.ops)
        # extras cast with x under autocast whatever their shape (a residual stream that meets
        # the main tensor after a row-parallel Linear has changed its width)
        self._autocast_extras = frozenset(
            n for op in self.ops for n in op.autocast_extras if n in self.extra_input_names
        )
        self._programs: OrderedDict[tuple, Program] = OrderedDict()
        self._slots = _Slots(self.ops)

    def __getitem__(self, i: int) -> BasicOp:
        return self.ops[i]

    def __len__(self) -> int:
        return len(self.ops)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(): parameters may change
        out = super()._apply(fn, recurse)
        # The parameter objects usually survive a cast in place, but the rules decided on
        # their dtypes and devices: plan afresh.
        self._slots = _Slots(self.ops)
        self._programs.clear()
        return out

    def _params(self) -> tuple[Params, ...]:
        """Each op's parameters as registered now: FSDP2's unshard / reshard and
        ``torch.func.functional_call`` write ``_parameters`` directly, and a call computes
        with (and sends gradients to) the tensors registered for it. New tensors of other
        facts than the last ones (dtype, shape …) drop the plans, which the rules made from
        those facts."""
        slots = self._slots
        if not slots.current():
            new = _Slots(self.ops)
            if new.facts() != slots.facts():
                self._programs.clear()
            self._slots = slots = new
        return slots.params

    # --- planning ---------------------------------------------------------------------------

    def _program(self, x: torch.Tensor, grad: bool, region: torch.dtype | None = None) -> Program:
        # ``region``: the autocast region's dtype, which the parameters are cast to
        key = (x.dtype, x.device, x.shape[-1], x.dim(), grad, settings_key(), region)
        programs = self._programs
        prog = programs.get(key)
        if prog is None:
            facts = Facts(x.dtype, x.device, x.shape[-1], x.dim(), grad, use_triton(x), region)
            prog = Program(make_plan(self.ops, facts), self._slots.keys)
            if len(programs) >= _MAX_PLANS:
                programs.popitem(last=False)
            programs[key] = prog
        elif len(programs) > 1:
            programs.move_to_end(key)
        return prog

    def plan(self, x: torch.Tensor | None = None, *, requires_grad: bool | None = None) -> Plan:
        """The plan a call with main input ``x`` runs (default: an input of the parameters'
        dtype and device), inside a ``torch.autocast`` region when called in one.
        ``str(plan)`` lists each pass's steps and every decline with its reason."""
        self._params()
        if x is None:
            p = self._slots.tensors[0] if self._slots.tensors else None
            x = torch.empty(
                0, _hidden_hint(self.ops), dtype=p.dtype if p is not None else None,
                device=p.device if p is not None else None,
            )  # fmt: skip
        grad = True if requires_grad is None else requires_grad
        if not autocast_on(x.device.type):
            return self._program(x, grad).plan
        region = torch.get_autocast_dtype(x.device.type)
        dtype = region if _castable(x, region) else x.dtype
        x = torch.empty((0,) * (x.dim() - 1) + (x.shape[-1],), dtype=dtype, device=x.device)
        return self._program(x, grad, region).plan

    def extra_repr(self) -> str:
        try:
            text = str(self.plan())
        except Exception as e:  # a repr must not raise; say why there is no plan
            text = f"no plan: {e}"
        return "plan:\n  " + text.replace("\n", "\n  ")

    # --- running ----------------------------------------------------------------------------

    def _extras(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self.extra_input_names
        if not kwargs and len(args) == len(names):  # every extra by position: nothing to check
            return dict(zip(names, args))
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

    def _grad(self, x: torch.Tensor, env: dict) -> bool:
        """Whether the call may be differentiated (its plan and its nodes depend on it)."""
        return torch.is_grad_enabled() and (
            x.requires_grad
            or _any_requires_grad(self._slots.tensors)
            or _any_requires_grad(env.values())
        )

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        env = self._extras(args, kwargs)
        params = self._params()
        if autocast_on(x.device.type):
            y = self._run_in_region(x, env, params)
        else:
            grad = self._grad(x, env)
            y = self._program(x, grad).run(x, env, params, grad)
        out_names = self.extra_output_names
        return (y, *[env[n] for n in out_names]) if out_names else y

    def _run_in_region(self, x: torch.Tensor, env: dict, params: tuple[Params, ...]) -> Any:
        """Inside a ``torch.autocast`` region the chain runs in the region's dtype with
        autocast off, as the chain converted to that dtype (``.to(dtype)``) would run outside
        it: x and the extra inputs that travel with it are cast (:meth:`_cast_inputs`), and
        every floating parameter (fp64 aside) per call, as ``F.linear`` casts its weight (a
        tied one once); gradients reach the parameters through the casts, in their own dtype.
        A fused op that casts as the chain would (``FusedOp.autocast_native``) runs with the
        region on, on the registered parameters."""
        device = x.device.type
        dtype = torch.get_autocast_dtype(device)
        x = self._cast_inputs(x, env, dtype)
        grad = self._grad(x, env)
        prog = self._program(x, grad, dtype)
        made: dict[int, torch.Tensor] = {}
        casts = tuple(
            d if i in prog.uncast else {k: _cast(p, dtype, made) for k, p in d.items()}
            for i, d in enumerate(params)
        )
        with torch.autocast(device, enabled=False):
            return prog.run(x, env, casts, grad)

    def _cast_inputs(self, x: torch.Tensor, env: dict, dtype: torch.dtype) -> torch.Tensor:
        """x in the region's dtype (floating, fp64 aside), and with it (in ``env``) the extra
        inputs of x's dtype that have its shape or that an op reads in the chain's dtype
        (``BasicOp.autocast_extras``, e.g. a residual)."""
        if not _castable(x, dtype):
            return x
        follows = self._autocast_extras
        for name, v in env.items():
            if (
                isinstance(v, torch.Tensor)
                and v.dtype == x.dtype
                and (v.shape == x.shape or name in follows)
            ):
                env[name] = v.to(dtype)
        return x.to(dtype)

    def reference(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The chain in plain differentiable PyTorch, op by op (each op's ``reference``): the
        oracle the fused and unfused runs are tested against."""
        env = self._extras(args, kwargs)
        for op in self.ops:
            x, made = op.reference(x, env)
            env.update(made)
        out_names = self.extra_output_names
        return (x, *(env[n] for n in out_names)) if out_names else x


def _castable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast casts ``t`` to ``dtype`` (floating, not fp64, not in it already)."""
    return t.is_floating_point() and t.dtype not in (dtype, torch.float64)


def _cast(p: torch.Tensor | None, dtype: torch.dtype, made: dict) -> torch.Tensor | None:
    """``p`` as the call computes with it in ``dtype``, cast once per call (``made``)."""
    if p is None:
        return None
    cast = made.get(id(p))
    if cast is None:
        cast = made[id(p)] = autocast_weight(p, dtype, master=False)[0]
    return cast


def _any_requires_grad(values) -> bool:
    """Whether any of ``values`` (parameters, or extras of any type) is a tensor that requires
    grad."""
    for v in values:  # noqa: SIM110 - a loop, not any(...): a generator costs more here
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return True
    return False


def _hidden_hint(ops: tuple[BasicOp, ...]) -> int:
    """The main input's last dim as the first op expects it (for plan() without an input)."""
    op = ops[0]
    return int(getattr(op, "in_features", None) or getattr(op, "hidden_size", 0) or 0)
