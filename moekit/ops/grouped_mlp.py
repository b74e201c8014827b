"""``grouped_mlp``: an expert MLP fc1 → (prob-scaled) activation → fc2 as one fused op.

Forward is two launches: fc1 with the activation and prob scaling in its epilogue (it also
stores the pre-activation h for backward), then the fc2 grouped GEMM. Backward is five: the fc2
dgrad with the activation backward and the prob gradient in its epilogue, a deterministic sum
of the prob-gradient partials, the fc2 wgrad, the fc1 dgrad and the fc1 wgrad (+1 launch per
bias). Weight gradients accumulate into ``w.main_grad`` (fp32) when that attribute exists.

Configurations the fused kernels do not cover (an F whose rows are not 16-byte aligned, a GLU
interleave that is not a multiple of 16) run the unfused composition of moekit ops instead,
with a one-time warning that says why. CPU tensors run that composition over the reference
grouped GEMM (or the fused kernels in Triton's interpreter when ``TRITON_INTERPRET=1``).

Host path: calls are keyed on their static configuration; the first call of a key validates
and builds a ``_Plan``, later calls skip validation and, from the third on, replay the recorded
kernel launches with only the pointers swapped (moekit/kernels/_replay.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F

from moekit.kernels import grouped_gemm as _gemm
from moekit.kernels import grouped_mlp as _mlp
from moekit.kernels._replay import LaunchReplay
from moekit.ops._apply import direct_apply
from moekit.ops._dispatch import use_triton
from moekit.ops._launch_cache import run_or_record
from moekit.ops._validate import (
    check_byte_aligned,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
)
from moekit.ops.grouped_gemm import _check_offsets
from moekit.ops.grouped_linear import grouped_linear
from moekit.reference.activations import Activation, apply_activation, resolve_activation

__all__ = ["grouped_mlp"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Backward runs its launches as one replayed segment (one pass of replay overhead instead of
# three) when freeing h and the activation before the gradients are allocated would save at
# most this much memory; larger problems keep three segments and the lower peak (their GPU
# time dwarfs the host time anyway).
ONE_SEGMENT_MAX_BYTES = 64 << 20


@dataclasses.dataclass(eq=False)
class _Plan:
    """Everything decided once per static configuration (shapes, strides, dtypes, devices,
    flags): validated once, then reused by every call with the same configuration, together
    with the recorded kernel launches that the call replays."""

    act: Activation
    interleave: int | None
    recompute: bool
    for_backward: bool  # grad mode on and an input requires grad: store h for backward
    unfused_reason: str | None  # why the fused kernels cannot run this (None: they can)
    direct: bool  # every input already has TMA-friendly strides: no copies before the kernels
    part_rows: int  # rows of the dprobs-partials buffer (see grouped_mlp_dact)
    one_segment: bool  # backward: all gradients allocated first, launches replayed as one
    fwd: LaunchReplay = dataclasses.field(default_factory=LaunchReplay)
    # backward configuration (needs_input_grad, dy strides) -> one LaunchReplay per segment
    bwd: dict = dataclasses.field(default_factory=dict)

    @property
    def act_kwargs(self) -> dict:
        a = self.act
        return dict(
            act=a.name, gated=a.gated, interleave=self.interleave,
            limit=a.limit, alpha=a.alpha, offset=a.offset,
        )  # fmt: skip


def _tma_strides(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.stride(-1) == 1 and all((s * size) % 16 == 0 for s in t.stride()[:-1])


def _unit_rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit stride on its last dim and 16-byte aligned base/strides (TMA's demands)."""
    return t if _tma_strides(t) and t.data_ptr() % 16 == 0 else t.contiguous()


def _release(t: torch.Tensor | None) -> None:
    """Free a saved activation's memory as soon as backward has consumed it, so that dx and
    the weight gradients are allocated in its place (TransformerEngine does the same). Autograd
    would otherwise hold it until this node's backward returns. With saved-tensor hooks (e.g.
    CPU offloading) ``t`` is the unpacked copy and only that copy is freed."""
    if t is not None:
        t.untyped_storage().resize_(0)


def _released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


class _GroupedMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, w1, w2, probs, b1, b2, plan: _Plan, mg1, mg2):
        R, H = x.shape
        dev, dt = x.device, x.dtype
        # (ctx.needs_input_grad is set even under torch.no_grad, hence the plan's flag)
        a = torch.empty(R, w2.shape[2], device=dev, dtype=dt)
        h = torch.empty(R, w1.shape[1], device=dev, dtype=dt) if plan.for_backward else None
        y = torch.empty(R, H, device=dev, dtype=dt)
        if R > 0:
            roles = (x, offsets, w1, w2, probs, b1, b2, a, h, y)
            if not plan.fwd.run(roles):  # the replay is not ready, or this call cannot take it
                with plan.fwd.recording(roles):
                    _mlp.grouped_mlp_fc1(x, w1, offsets, a, h, probs, b1, **plan.act_kwargs)
                    _gemm.grouped_mm_ragged_m(a, w2.transpose(1, 2), offsets, y, b2)
        ctx.plan = plan
        ctx.main_grads = (mg1, mg2)
        ctx.bias_dtypes = (
            b1.dtype if b1 is not None else None,
            b2.dtype if b2 is not None else None,
        )
        ctx.save_for_backward(x, offsets, w1, w2, probs, h, None if plan.recompute else a)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, offsets, w1, w2, probs, h, a = ctx.saved_tensors
        if h is not None and h.numel() and _released(h):
            raise RuntimeError(
                "grouped_mlp: backward ran a second time through the same graph, but the first "
                "backward released the saved activations; retain_graph=True is not supported"
            )
        plan: _Plan = ctx.plan
        mg1, mg2 = ctx.main_grads
        needs = ctx.needs_input_grad
        need_x, _, need_w1, need_w2, need_p, need_b1, need_b2 = needs[:7]
        R, H = x.shape
        E, W1, _ = w1.shape
        F_ = w2.shape[2]
        dev, dt = x.device, x.dtype
        if grad.dtype != dt:
            grad = grad.to(dt)
        # (H * itemsize is a multiple of 16 on this path: a contiguous grad is TMA-ready.)
        dy = grad if grad.is_contiguous() and not grad.data_ptr() & 15 else _unit_rows(grad)
        dx = dw1 = dw2 = dp = db1 = db2 = None
        if R == 0:
            dx = torch.zeros_like(x) if need_x else None
            dp = torch.zeros_like(probs) if need_p else None
            dw1 = torch.zeros_like(w1) if need_w1 and mg1 is None else None
            dw2 = torch.zeros_like(w2) if need_w2 and mg2 is None else None
            if need_b1:
                db1 = torch.zeros(E, W1, device=dev, dtype=ctx.bias_dtypes[0])
            if need_b2:
                db2 = torch.zeros(E, H, device=dev, dtype=ctx.bias_dtypes[1])
            return dx, None, dw1, dw2, dp, db1, db2, None, None, None

        bkey = (needs, dy.stride())
        seg = plan.bwd.get(bkey)
        if seg is None:
            seg = plan.bwd[bkey] = (LaunchReplay(), LaunchReplay(), LaunchReplay())
        # Large problems run three launch segments, so that h and the activation are freed
        # before the weight and input gradients are allocated in their place; small ones (where
        # host time matters and that memory does not) allocate everything first and run the
        # five launches as one replayed segment.

        # fc2 dgrad + activation backward (+ dprobs partials, + recomputed activation)
        dh = torch.empty(R, W1, device=dev, dtype=dt)
        a_re = torch.empty(R, F_, device=dev, dtype=dt) if plan.recompute and need_w2 else None
        part = None
        if probs is not None:
            part = torch.empty(plan.part_rows, R, device=dev, dtype=torch.float32)
        dp = torch.empty(R, device=dev, dtype=probs.dtype) if need_p else None
        act_out = (a_re if plan.recompute else a) if need_w2 else None
        b_dtypes = ctx.bias_dtypes

        if plan.one_segment:
            if need_w2 and mg2 is None:
                dw2 = torch.empty(E, H, F_, device=dev, dtype=w2.dtype)
            dx, dw1, db1, db2 = _alloc_fc1_grads(needs, x, w1, mg1, b_dtypes)
            target1 = (mg1 if mg1 is not None else dw1) if need_w1 else None
            target2 = mg2 if mg2 is not None else dw2
            # a is a role only when saved (with recompute, act_out is a_re, already a role)
            roles = (
                dy, offsets, w2, h, probs, dh, a_re, part, dp,
                None if plan.recompute else act_out, target2, w1, x, dx, target1, db1, db2,
            )  # fmt: skip
            if not seg[0].run(roles):  # the replay is not ready, or this call cannot take it
                with seg[0].recording(roles):
                    _dact(plan, dy, w2, offsets, h, probs, dh, a_re, part, dp)
                    if need_w2:
                        _gemm.grouped_mm_ragged_k(
                            dy.t(), act_out, offsets, target2, mg2 is not None
                        )
                    _fc1_grads(dy, dh, w1, x, offsets, dx, target1, mg1 is not None, db1, db2)
            _release(h)
            _release(act_out)
            return dx, None, dw1, dw2, dp, db1, db2, None, None, None

        run_or_record(
            seg[0], (dy, offsets, w2, h, probs, dh, a_re, part, dp),
            lambda: _dact(plan, dy, w2, offsets, h, probs, dh, a_re, part, dp),
        )  # fmt: skip
        part = None  # scratch: released before the weight gradients are allocated
        _release(h)
        if need_w2:  # fc2 wgrad (into w2.main_grad when present)
            target2 = mg2 if mg2 is not None else torch.empty(E, H, F_, device=dev, dtype=w2.dtype)
            dw2 = target2 if mg2 is None else None
            run_or_record(
                seg[1], (dy, offsets, act_out, target2),
                lambda: _gemm.grouped_mm_ragged_k(
                    dy.t(), act_out, offsets, target2, mg2 is not None
                ),
            )  # fmt: skip
            _release(act_out)
            act_out = None
        # h and the activation (saved or recomputed) are gone before dx and dw1 are allocated.
        a_re = None
        dx, dw1, db1, db2 = _alloc_fc1_grads(needs, x, w1, mg1, b_dtypes)
        target1 = (mg1 if mg1 is not None else dw1) if need_w1 else None
        run_or_record(
            seg[2], (dh, offsets, w1, x, dx, target1, db1, db2, dy),
            lambda: _fc1_grads(dy, dh, w1, x, offsets, dx, target1, mg1 is not None, db1, db2),
        )  # fmt: skip
        return dx, None, dw1, dw2, dp, db1, db2, None, None, None


def _dact(plan: _Plan, dy, w2, offsets, h, probs, dh, a_re, part, dp) -> None:
    """fc2 dgrad with the activation backward (and the dprobs partials, and the recomputed
    activation) in its epilogue, then the deterministic sum of the partials into dp."""
    used = _mlp.grouped_mlp_dact(dy, w2, offsets, h, probs, dh, a_re, part, **plan.act_kwargs)
    if dp is not None:
        _mlp.segment_colsum(used, None, dp.view(1, -1))


def _alloc_fc1_grads(needs, x, w1, mg1, bias_dtypes):
    """dx, dw1 (None when it goes to main_grad), db1, db2 as this backward needs them."""
    need_x, _, need_w1, _, _, need_b1, need_b2 = needs[:7]
    R, H = x.shape
    E, W1, _ = w1.shape
    dev = x.device
    dx = torch.empty(R, H, device=dev, dtype=x.dtype) if need_x else None
    dw1 = torch.empty(E, W1, H, device=dev, dtype=w1.dtype) if need_w1 and mg1 is None else None
    db1 = torch.empty(E, W1, device=dev, dtype=bias_dtypes[0]) if need_b1 else None
    db2 = torch.empty(E, H, device=dev, dtype=bias_dtypes[1]) if need_b2 else None
    return dx, dw1, db1, db2


def _fc1_grads(dy, dh, w1, x, offsets, dx, target1, accumulate1: bool, db1, db2) -> None:
    """fc1 dgrad, fc1 wgrad (into ``target1``: dw1 or w1.main_grad), the bias gradients."""
    if dx is not None:
        _gemm.grouped_mm_ragged_m(dh, w1, offsets, dx)
    if target1 is not None:
        _gemm.grouped_mm_ragged_k(dh.t(), x, offsets, target1, accumulate1)
    if db1 is not None:
        _mlp.segment_colsum(dh, offsets, db1)
    if db2 is not None:
        _mlp.segment_colsum(dy, offsets, db2)


_apply_grouped_mlp = direct_apply(_GroupedMLPFn)


# --------------------------------------------------------------------------------------------
# unfused composition (CPU path and fallback)
# --------------------------------------------------------------------------------------------


def _pad_units(w: torch.Tensor, dim: int, F_: int, F_pad: int, gated: bool, inter) -> torch.Tensor:
    """Zero-pad the F units of w along ``dim`` (each GLU half separately): padded units have
    pre-activation 0 and act(0) = 0 for every supported activation, so they change nothing."""
    if F_pad == F_:
        return w
    if not gated:
        return F.pad(w.movedim(dim, -1), (0, F_pad - F_)).movedim(-1, dim)
    if inter is not None:
        # regroup to halves: gate units then up units, each padded
        blocks = w.movedim(dim, -1).unflatten(-1, (F_ // inter, 2, inter))
        halves = [blocks[..., i, :].flatten(-2) for i in (0, 1)]
    else:
        halves = list(w.movedim(dim, -1).chunk(2, dim=-1))
    return torch.cat([F.pad(t, (0, F_pad - F_)) for t in halves], dim=-1).movedim(-1, dim)


def _grouped_mlp_unfused(x, offsets, w1, w2, probs, b1, b2, plan: _Plan, mg1, mg2) -> torch.Tensor:
    act, inter = plan.act, plan.interleave
    F_ = w2.shape[2]
    mult = 16 // x.element_size()
    F_pad = -(-F_ // mult) * mult
    if F_pad != F_:
        if mg1 is not None or mg2 is not None:
            raise ValueError(
                f"main_grad accumulation needs F (w2.shape[2]) to be a multiple of {mult} for "
                f"{str(x.dtype).replace('torch.', '')}, got F = {F_}"
            )
        w1 = _pad_units(w1, 1, F_, F_pad, act.gated, inter)
        b1 = _pad_units(b1, 1, F_, F_pad, act.gated, inter) if b1 is not None else None
        w2 = F.pad(w2, (0, F_pad - F_))
        inter = None  # _pad_units regrouped the GLU layout to halves
    h = grouped_linear(x, w1, offsets, b1, mg1)
    a = apply_activation(h.float(), act, inter)
    if probs is not None:
        a = a * probs.float()[:, None]
    return grouped_linear(a.to(x.dtype), w2, offsets, b2, mg2)


# --------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------

_warned: set[str] = set()


def _fused_unsupported(x: torch.Tensor, F_: int, interleave: int | None) -> str | None:
    """Why the fused kernels cannot run this configuration (None if they can)."""
    if (F_ * x.element_size()) % 16:
        return f"F = {F_} is not a multiple of {16 // x.element_size()} (16-byte TMA rows)"
    if interleave is not None and interleave % 16:
        return f"glu_interleave = {interleave} is not a multiple of 16 (the smallest GEMM tile)"
    return None


def _check_optional(name, t, shape, ref) -> torch.Tensor | None:
    if t is None:
        return None
    t = check_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    check_same_device(name, t, "x", ref)
    check_dtype(name, t, _FLOAT_DTYPES)
    return t


def grouped_mlp(
    x: torch.Tensor,
    offsets: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    probs: torch.Tensor | None = None,
    *,
    activation: str | Activation = "swiglu",
    glu_interleave: int | None = None,
    recompute_activation: bool = False,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert MLP over expert-sorted rows: ``y = fc2(act(fc1(x)) * probs)`` per expert.

    Args:
        x: [R, H] rows grouped by expert (bf16/fp16/fp32).
        offsets: [E] int32/int64 cumulative end offsets on x's device; rows past
            offsets[-1] give zero output and zero gradients.
        w1: [E, 2F, H] for gated activations, [E, F, H] otherwise (nn.Linear layout). Gated
            rows: ``[:F]`` gate, ``[F:]`` up; or, with ``glu_interleave=I``, blocks of I rows
            alternating gate, up (see moekit.reference.activations).
        w2: [E, H, F].
        probs: optional [R] routing probabilities; each row's activation output is scaled by
            its prob and the gradient flows to probs.
        activation: "swiglu", "geglu", "clamped_swiglu" (gpt-oss: limit 7, alpha 1.702,
            offset 1; pass ``moekit.Activation("clamped_swiglu", limit=..)`` for others),
            "relu2", "gelu", "silu".
        recompute_activation: save only x and the pre-activation for backward and recompute
            the activation output there (less memory, a little more epilogue work).
        b1: optional [E, 2F] / [E, F] fc1 bias; b2: optional [E, H] fc2 bias.

    Returns:
        [R, H] in x's dtype. ``w1.main_grad`` / ``w2.main_grad`` (fp32), when present, receive
        the weight gradients in place and ``.grad`` stays None.
    """
    mg1 = getattr(w1, "main_grad", None)
    mg2 = getattr(w2, "main_grad", None)
    key = _plan_key(
        x, offsets, w1, w2, probs, b1, b2, mg1, mg2,
        activation, glu_interleave, recompute_activation,
    )  # fmt: skip
    try:
        plan = _PLANS.get(key) if key is not None else None
    except TypeError:  # an unhashable argument: no plan, the full checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _make_plan(
            x, offsets, w1, w2, probs, b1, b2, activation, glu_interleave, recompute_activation
        )
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan

    reason = plan.unfused_reason
    if reason is None:
        if not plan.direct or (x.data_ptr() | w1.data_ptr() | w2.data_ptr()) & 15:
            x, w1, w2 = _unit_rows(x), _unit_rows(w1), _unit_rows(w2)
            probs = probs.contiguous() if probs is not None else None
            b1 = _unit_rows(b1) if b1 is not None else None
            b2 = _unit_rows(b2) if b2 is not None else None
        return _apply_grouped_mlp(x, offsets, w1, w2, probs, b1, b2, plan, mg1, mg2)
    if reason and reason not in _warned:
        _warned.add(reason)
        warnings.warn(
            f"moekit.grouped_mlp: fused path unavailable ({reason}); running the unfused "
            "composition of moekit ops",
            RuntimeWarning,
            stacklevel=2,
        )
    return _grouped_mlp_unfused(x, offsets, w1, w2, probs, b1, b2, plan, mg1, mg2)


# Plans by static configuration. The key holds everything the checks and the kernels'
# specialisation depend on, so a hit skips validation; bounded so that a caller cycling
# through endless shapes cannot grow it without limit.
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256


def _sig(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _plan_key(x, offsets, w1, w2, probs, b1, b2, mg1, mg2, activation, interleave, recompute):
    """The cache key of a CUDA call, or None (CPU, or input too odd to key: full checks).
    Written out flat (no helper call per tensor): it runs on every call."""
    try:
        if not x.is_cuda:
            return None
        return (
            x.shape, x.stride(), x.dtype, x.device, x.requires_grad,
            offsets.shape, offsets.stride(), offsets.dtype, offsets.device,
            w1.shape, w1.stride(), w1.dtype, w1.device, w1.requires_grad,
            w2.shape, w2.stride(), w2.dtype, w2.device, w2.requires_grad,
            None if probs is None else _sig(probs), None if b1 is None else _sig(b1),
            None if b2 is None else _sig(b2), None if mg1 is None else _sig(mg1),
            None if mg2 is None else _sig(mg2),
            activation, interleave, recompute, torch.is_grad_enabled(),
        )  # fmt: skip
    except AttributeError:
        return None


def _make_plan(
    x, offsets, w1, w2, probs, b1, b2, activation, glu_interleave, recompute_activation
) -> _Plan:
    """Validate every input (clear errors) and decide how this configuration runs."""
    x = check_tensor("x", x)
    w1 = check_tensor("w1", w1)
    w2 = check_tensor("w2", w2)
    check_ndim("x", x, 2, "[R, H]")
    check_ndim("w1", w1, 3, "[E, 2F, H] (gated) or [E, F, H]")
    check_ndim("w2", w2, 3, "[E, H, F]")
    check_dtype("x", x, _FLOAT_DTYPES)
    for name, w in (("w1", w1), ("w2", w2)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
        check_same_device(name, w, "x", x)
    act = resolve_activation(activation)
    R, H = x.shape
    E, W1, H1 = w1.shape
    F_ = w2.shape[2]
    if H1 != H or w2.shape[1] != H:
        raise ValueError(
            f"w1.shape[2] and w2.shape[1] must equal H = x.shape[1] = {H}, got w1 "
            f"{tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    if w2.shape[0] != E:
        raise ValueError(f"w1 and w2 must hold the same E experts, got {E} and {w2.shape[0]}")
    if act.gated:
        if W1 % 2:
            raise ValueError(
                f"w1.shape[1] must be even for gated activation {act.name!r} ([gate | up]), "
                f"got {W1}"
            )
        if W1 != 2 * F_:
            raise ValueError(
                f"w1.shape[1] must be 2 * F = {2 * F_} for gated activation {act.name!r} "
                f"(F = w2.shape[2]), got {W1}"
            )
    elif W1 != F_:
        raise ValueError(
            f"w1.shape[1] must equal F = w2.shape[2] = {F_} for activation {act.name!r}, got {W1}"
        )
    if glu_interleave is not None:
        if not act.gated:
            raise ValueError(f"glu_interleave applies to gated activations, not {act.name!r}")
        if not isinstance(glu_interleave, int) or glu_interleave <= 0 or F_ % glu_interleave:
            raise ValueError(
                f"glu_interleave must be a positive integer dividing F = {F_}, "
                f"got {glu_interleave!r}"
            )
    _check_offsets(offsets, E, x)
    check_byte_aligned("x", H, x.dtype, "H (x.shape[1])")
    _check_optional("probs", probs, (R,), x)
    _check_optional("b1", b1, (E, W1), x)
    _check_optional("b2", b2, (E, H), x)
    _main_grad("w1", w1)
    _main_grad("w2", w2)
    for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, w1, w2, probs, b1, b2)
    )
    # "" = the unfused composition without a warning (CPU tensors run the reference)
    reason = _fused_unsupported(x, F_, glu_interleave) if use_triton(x) else ""
    direct = (
        all(_tma_strides(t) for t in (x, w1, w2, b1, b2) if t is not None)
        and (probs is None or probs.stride(0) == 1)
    )  # fmt: skip
    # What backward holds longer when it allocates every gradient before its first launch:
    # the pre-activation h and the activation (saved or recomputed).
    held = R * (W1 + F_) * x.element_size()
    return _Plan(
        act, glu_interleave, bool(recompute_activation), for_backward, reason, direct,
        _mlp.dact_partial_rows(F_, glu_interleave), held <= ONE_SEGMENT_MAX_BYTES,
    )  # fmt: skip


def _main_grad(name: str, w: torch.Tensor) -> torch.Tensor | None:
    mg = getattr(w, "main_grad", None)
    if mg is None:
        return None
    if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32 or mg.shape != w.shape:
        raise ValueError(
            f"{name}.main_grad must be an fp32 tensor of {name}'s shape {tuple(w.shape)}, got "
            f"{getattr(mg, 'dtype', type(mg).__name__)} {tuple(getattr(mg, 'shape', ()))}"
        )
    check_same_device(f"{name}.main_grad", mg, name, w)
    return mg
