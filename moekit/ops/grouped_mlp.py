"""``grouped_mlp``: an expert MLP fc1 → (prob-scaled) activation → fc2 as one fused op.

Forward is two launches: fc1 with the activation and prob scaling in its epilogue (it also
stores the pre-activation h for backward), then the fc2 grouped GEMM. Backward is five: the fc2
dgrad with the activation backward and the prob gradient in its epilogue, a deterministic sum
of the prob-gradient partials, the fc2 wgrad, the fc1 dgrad and the fc1 wgrad (+1 launch per
bias). Weight gradients accumulate into ``w.main_grad`` (fp32) when that attribute exists.

Configurations the fused kernels do not cover (an F whose rows are not 16-byte aligned, a GLU
interleave that is not a multiple of 16) run the unfused composition of moekit ops instead,
with a one-time warning that says why. CPU tensors run that composition over the reference
grouped GEMM (or the fused kernels in Triton's interpreter under ``TRITON_INTERPRET=1``).

Host path: a call's validation is cached per static configuration (``_plan``); the kernel ops
replay their recorded launches (:mod:`moekit.runtime.replay`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

from moekit.activations import Activation, apply_activation, resolve_activation
from moekit.kernels import grouped_mlp as kernels
from moekit.ops import validation as v
from moekit.ops.autocast import autocast_dtype, autocast_on, autocast_tensors
from moekit.ops.grouped_gemm import launch_ragged_k, launch_ragged_m
from moekit.ops.grouped_linear import grouped_linear
from moekit.runtime.cache import first_time
from moekit.runtime.device import is_capturing, spare_bytes, use_triton
from moekit.runtime.eager import owned_gradient
from moekit.runtime.op import (
    call_key,
    eager_shortcut,
    function_apply,
    kernel_op,
    needs_grad,
    planned,
    refuse_double_backward,
)
from moekit.runtime.replay import compile_ahead, replayed, tensor_key
from moekit.runtime.state import memoized, warn_once
from moekit.runtime.tma import tma_rows, tma_strides
from moekit.tuning import grouped_gemm as gemm_tuning
from moekit.tuning import grouped_mlp as tuning

__all__ = ["fused_unsupported", "grouped_mlp"]

# Backward runs its launches as one replayed segment (one pass of replay overhead instead of
# three) when freeing h and the activation before the gradients are allocated would save at
# most this much memory; larger problems keep three segments and the lower peak (their GPU
# time dwarfs the host time anyway).
ONE_SEGMENT_MAX_BYTES = 64 << 20


@memoized
def _activation(name: str, limit: float, alpha: float, offset: float) -> Activation:
    return Activation(name, limit=limit, alpha=alpha, offset=offset)


def _interleave(interleave: int) -> int | None:
    return interleave or None  # kernel ops take 0 for "[gate | up] halves"


def _fc1(x, w1, offsets, a, h, probs, b1, act: Activation, interleave: int | None) -> None:
    R, H = x.shape
    E, F_ = w1.shape[0], a.shape[1]

    def launch(cfg, offsets: torch.Tensor = offsets) -> None:
        kernels.grouped_mlp_fc1(x, w1, offsets, a, h, probs, b1, act, interleave, cfg)

    key = (H, F_, E, act, interleave, h is not None, probs is not None)
    cfg = gemm_tuning.choose_config(
        "mlp_fc1", key, x.dtype, x.device, tuning.fc1_candidates(act.gated, interleave, x.dtype),
        lambda: gemm_tuning.routing_robust_launches(launch, R, E, offsets),
        tuning.fit_interleave(gemm_tuning.INTERPRET_CONFIG, interleave), keep_default_within=0.0,
    )  # fmt: skip
    launch(cfg)


def _dact(dy, w2, offsets, h, probs, dh, a_re, part, dp, act, interleave) -> None:
    """fc2 dgrad with the activation backward (and the dprobs partials, and the recomputed
    activation) in its epilogue, then the deterministic sum of the partials into dp."""
    R = dy.shape[0]
    E, H, F_ = w2.shape

    def launch(cfg, offsets: torch.Tensor = offsets):
        return kernels.grouped_mlp_dact(
            dy, w2, offsets, h, probs, dh, a_re, part, act, interleave, cfg
        )

    key = (H, F_, E, act, interleave, a_re is not None, probs is not None)
    cfg = gemm_tuning.choose_config(
        "mlp_dact", key, dy.dtype, dy.device,
        tuning.dact_candidates(interleave, R, F_, a_re is not None, dy.dtype),
        lambda: gemm_tuning.routing_robust_launches(launch, R, E, offsets),
        tuning.fit_interleave(gemm_tuning.INTERPRET_CONFIG, interleave), keep_default_within=0.0,
    )  # fmt: skip
    used = launch(cfg)
    if dp is not None:
        kernels.segment_colsum(used, None, dp.view(1, -1))


def _fc1_grads(dh, w1, x, offsets, dx, target1, accumulate1: bool, db1, zero_tail) -> None:
    """fc1 dgrad, fc1 wgrad (into ``target1``: dw1 or w1.main_grad), fc1's bias gradient."""
    if dx is not None:
        launch_ragged_m(dh, w1, offsets, None, dx, zero_tail)
    if target1 is not None:
        launch_ragged_k(dh.t(), x, offsets, target1, accumulate1)
    if db1 is not None:
        kernels.segment_colsum(dh, offsets, db1)


def _tma_layouts(x, offsets, w1, w2, probs, b1, b2) -> tuple:
    """The inputs as the kernels read them: rows TMA-ready, offsets and probs contiguous.
    Copies only what is not (a strided view, a misaligned base); a no-op otherwise."""
    x, w1, w2 = tma_rows(x), tma_rows(w1), tma_rows(w2)
    b1 = tma_rows(b1) if b1 is not None else None
    b2 = tma_rows(b2) if b2 is not None else None
    if probs is not None and not probs.is_contiguous():
        probs = probs.contiguous()
    return x, offsets if offsets.is_contiguous() else offsets.contiguous(), w1, w2, probs, b1, b2


def _released(t: torch.Tensor | None) -> bool:
    return t is not None and t.numel() > 0 and t.untyped_storage().nbytes() == 0


def _release(t: torch.Tensor | None) -> None:
    """Free a saved activation's memory as soon as backward has consumed it, so that dx and
    the weight gradients are allocated in its place (autograd would hold it until this node's
    backward returns). A second backward through the graph (``retain_graph=True``) finds it
    released and recomputes it. With saved-tensor hooks (e.g. CPU offloading) ``t`` is the
    unpacked copy and only that copy is freed."""
    if t is not None:
        t.untyped_storage().resize_(0)


def _forward_fake(x, offsets, w1, w2, probs, b1, b2, *, store_h, **_):
    R = x.shape[0]
    h = x.new_empty(R if store_h else 0, w1.shape[1])
    return x.new_empty(R, w2.shape[1]), h, x.new_empty(R, w2.shape[2])


def _aligned(x, w1, w2, b1, b2) -> bool:
    """Whether every operand the kernels read through TMA sits at a 16-byte aligned address."""
    p = x.data_ptr() | w1.data_ptr() | w2.data_ptr()
    if b1 is not None:
        p |= b1.data_ptr()
    if b2 is not None:
        p |= b2.data_ptr()
    return not p & 15


def _forward_impl(
    x: torch.Tensor,  # [R, H]
    offsets: torch.Tensor,  # [E]
    w1: torch.Tensor,  # [E, W1, H]
    w2: torch.Tensor,  # [E, H, F]
    probs: torch.Tensor | None,  # [R]
    b1: torch.Tensor | None,  # [E, W1]
    b2: torch.Tensor | None,  # [E, H]
    *,
    act_name: str, limit: float, alpha: float, offset: float,  # the Activation
    interleave: int,  # 0: [gate | up] halves
    store_h: bool,
    zero_tail: bool,  # False: y's rows past offsets[-1] are left unwritten
    plan_uid: int,  # a validated plan whose layouts the kernels read as given (0: none)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Fused forward: (y [R, H], h [R, W1] ([0, W1] unless ``store_h``), a [R, F] = act(h) *
    probs)."""
    act, inter = _activation(act_name, limit, alpha, offset), _interleave(interleave)
    if plan_uid and _aligned(x, w1, w2, b1, b2):
        key = ("mlp_fwd", plan_uid, zero_tail)  # the plan fixes every layout and activation
    else:
        x, offsets, w1, w2, probs, b1, b2 = _tma_layouts(x, offsets, w1, w2, probs, b1, b2)
        key = None
        if x.is_cuda:
            key = ("mlp_fwd", act, inter, zero_tail,
                   *map(tensor_key, (x, offsets, w1, w2, probs, b1, b2)))  # fmt: skip
    R, H = x.shape
    dev, dt = x.device, x.dtype
    a = torch.empty(R, w2.shape[2], device=dev, dtype=dt)
    h = torch.empty(R if store_h else 0, w1.shape[1], device=dev, dtype=dt)
    y = torch.empty(R, H, device=dev, dtype=dt)
    if R > 0:
        h_or_none = h if store_h else None

        def body() -> None:
            _fc1(x, w1, offsets, a, h_or_none, probs, b1, act, inter)
            launch_ragged_m(a, w2.transpose(1, 2), offsets, b2, y, zero_tail)

        replayed(key, (x, offsets, w1, w2, probs, b1, b2, a, h_or_none, y), body)
    return y, h, a


_forward = kernel_op("grouped_mlp_forward", fake=_forward_fake)(_forward_impl)


def _grad_shapes(x, w1, w2, probs, mg1, mg2, needs, b1_dtype, b2_dtype, w_dtype):
    """(wanted, shape, dtype) of each output of the backward kernel op: dx, dw1, dw2, dprobs,
    db1, db2 (weight gradients that go to main_grad are not outputs); the weight gradients in
    ``w_dtype``."""
    E, W1, H = w1.shape
    p_dtype = probs.dtype if probs is not None else x.dtype
    return (
        (needs[0], x.shape, x.dtype),
        (needs[1] and mg1 is None, w1.shape, w_dtype),
        (needs[2] and mg2 is None, w2.shape, w_dtype),
        (needs[3], (x.shape[0],), p_dtype),
        (needs[4], (E, W1), b1_dtype),
        (needs[5], (E, H), b2_dtype),
    )


def _backward_fake(dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, b1, *, needs, b1_dtype,
                   b2_dtype, w_dtype, **_):  # fmt: skip
    spec = _grad_shapes(x, w1, w2, probs, mg1, mg2, needs, b1_dtype, b2_dtype, w_dtype)
    # an output not computed: the empty fp32 tensor kernel_op's none_outputs puts in its place
    return tuple(
        x.new_empty(shape, dtype=dt) if want else x.new_empty(0, dtype=torch.float32)
        for want, shape, dt in spec
    )


def _backward_impl(
    dy: torch.Tensor,  # [R, H]
    x: torch.Tensor,  # [R, H]
    offsets: torch.Tensor,  # [E]
    w1: torch.Tensor,  # [E, W1, H]
    w2: torch.Tensor,  # [E, H, F]
    probs: torch.Tensor | None,  # [R]
    h: torch.Tensor,  # [R, W1] saved pre-activation
    a: torch.Tensor | None,  # [R, F] saved activation (None: recomputed here)
    mg1: torch.Tensor | None,  # w1.main_grad, accumulated into
    mg2: torch.Tensor | None,  # w2.main_grad, accumulated into
    b1: torch.Tensor | None,  # [E, W1]: to recompute h if a first backward freed it
    *,
    act_name: str,
    limit: float,
    alpha: float,
    offset: float,
    interleave: int,
    needs: list[bool],  # gradients wanted: x, w1, w2, probs, b1, b2
    b1_dtype: torch.dtype,
    b2_dtype: torch.dtype,
    w_dtype: torch.dtype,  # of the weight gradients (fp32 for fp32 weights cast per call)
    release: bool,  # free h and the activation as soon as they are consumed
    dy_owned: bool,  # nothing else holds dy: dx may take its memory once it is dead
    plan_uid: int,  # as in _forward_impl
    zero_tail: bool,  # False: dx's rows past offsets[-1] are left unwritten
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward of ``_forward``: (dx, dw1, dw2, dprobs, db1, db2), each None where it is
    not an output (not wanted, or a weight gradient that went to main_grad)."""
    act, inter = _activation(act_name, limit, alpha, offset), _interleave(interleave)
    if x.shape[0] == 0:  # nothing to launch; main_grad stays as it is
        spec = _grad_shapes(x, w1, w2, probs, mg1, mg2, needs, b1_dtype, b2_dtype, w_dtype)
        return tuple(
            torch.zeros(sh, dtype=dt, device=x.device) if want else None for want, sh, dt in spec
        )
    uid = plan_uid if plan_uid and _aligned(x, w1, w2, b1, None) else 0
    if not uid:
        x, offsets, w1, w2, probs, b1, _ = _tma_layouts(x, offsets, w1, w2, probs, b1, None)
    if _released(h):  # a second backward through the same graph (retain_graph=True)
        h, a = _recompute(x, offsets, w1, w2, probs, b1, a, act, inter)
    given = dy
    dy = tma_rows(dy if dy.dtype == x.dtype else dy.to(x.dtype))
    dy_owned = (dy_owned or dy is not given) and dy.is_contiguous()
    opts = _BackwardOptions(
        act, inter, tuple(needs), (b1_dtype, b2_dtype, w_dtype), uid, release and dy_owned,
        zero_tail,
    )  # fmt: skip
    return _run_backward(dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, opts, release)


_backward = kernel_op(
    "grouped_mlp_backward", fake=_backward_fake, mutates_args=("mg1", "mg2"), none_outputs=True
)(_backward_impl)


def _recompute(x, offsets, w1, w2, probs, b1, a, act, inter):
    """h and (if it was saved) the activation again, from the saved inputs."""
    h = torch.empty(x.shape[0], w1.shape[1], device=x.device, dtype=x.dtype)
    a_new = torch.empty(x.shape[0], w2.shape[2], device=x.device, dtype=x.dtype)
    _fc1(x, w1, offsets, a_new, h, probs, b1, act, inter)
    return h, (a_new if a is not None else None)


class _BackwardOptions(NamedTuple):
    """What one backward call computes, besides its tensors."""

    act: Activation
    inter: int | None
    needs: tuple[bool, ...]  # gradients wanted: x, w1, w2, probs, b1, b2
    grad_dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # b1's, b2's, the weights'
    uid: int  # a validated plan (0: none)
    reuse_dy: bool  # dx may take dy's memory once dy is dead
    zero_tail: bool  # False: dx's rows past offsets[-1] are left unwritten


class _Backward:
    """The backward launches of one call and the buffers they write.

    Small problems (or when memory is not released) allocate every gradient first and run the
    five launches as one replayed segment; large ones run three segments, freeing h and the
    activation before dx and dw1 are allocated in their place. dy is dead after the second
    segment, so when nothing else holds it (``reuse_dy``) dx is written into its memory: the
    peak then holds one [R, H] gradient instead of two."""

    def __init__(self, dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, opts: _BackwardOptions):
        act, inter, needs, bdt, uid = opts.act, opts.inter, list(opts.needs), *opts[3:5]
        self.reuse_dy, self.zero_tail = opts.reuse_dy, opts.zero_tail
        self.dy, self.x, self.offsets, self.w1, self.w2, self.probs = dy, x, offsets, w1, w2, probs
        self.h, self.a, self.mg1, self.mg2, self.act, self.inter = h, a, mg1, mg2, act, inter
        self.needs, self.grad_dtypes = needs, bdt  # b1's, b2's, the weights' gradients
        R, dev, dt = x.shape[0], x.device, x.dtype
        F_ = w2.shape[2]
        need_w2, need_p = needs[2], needs[3]
        self.dh = torch.empty(R, w1.shape[1], device=dev, dtype=dt)
        self.a_re = torch.empty(R, F_, device=dev, dtype=dt) if a is None and need_w2 else None
        self.part = None
        if probs is not None:
            rows = tuning.dact_partial_rows(F_, inter)
            self.part = torch.empty(rows, R, device=dev, dtype=torch.float32)
        self.dp = torch.empty(R, device=dev, dtype=probs.dtype) if need_p else None
        self.act_out = (a if a is not None else self.a_re) if need_w2 else None
        self.dx = self.t1 = self.t2 = self.db1 = self.db2 = None
        # Replay key prefix: a plan (uid) fixes every tensor's layout but dy's and the
        # gradients' dtypes (a caller may ask for others than the parameters'); without one,
        # _replay spells out every tensor.
        self.uid = uid
        if uid:
            self.base = ("mlp_bwd", uid, tuple(needs), dy.stride(), dy.dtype, bdt, self.zero_tail)
        else:
            self.base = (
                "mlp_bwd", act, inter, tuple(needs), mg1 is not None, mg2 is not None, bdt,
                self.zero_tail,
            )  # fmt: skip

    def held_bytes(self) -> int:
        """What three segments would free early: h and the activation."""
        n = self.h.numel() * self.h.element_size()
        if self.act_out is not None:
            n += self.act_out.numel() * self.act_out.element_size()
        return n

    def late_bytes(self) -> int:
        """What three segments allocate only after h and the activation are freed."""
        (E, W1, H), F_, es = self.w1.shape, self.w2.shape[2], self.x.element_size()
        ws = self.grad_dtypes[2].itemsize
        need_x, need_w1, need_w2 = self.needs[:3]
        n = self.x.numel() * es if need_x else 0
        n += E * W1 * H * ws if need_w1 and self.mg1 is None else 0
        return n + (E * H * F_ * ws if need_w2 and self.mg2 is None else 0)

    def first_of_its_configuration(self) -> bool:
        """True on the first backward of a configuration when one segment's peak fits in spare
        memory with room to spare. That call then runs one segment, so its five kernels compile
        side by side (one compile_ahead) rather than segment after segment, holding h and the
        activation for one segment longer, once."""
        if not self.x.is_cuda:
            return False
        roles = (self.dy, self.x, self.w1, self.w2, self.h, self.probs)
        key = ("mlp_bwd_first", *self.base, *map(tensor_key, roles))
        if not first_time(key) or is_capturing():
            return False
        return spare_bytes(self.x.device) >= 2 * (self.held_bytes() + self.late_bytes())

    def alloc_w2(self) -> None:
        x, (E, H, F_) = self.x, self.w2.shape
        if self.needs[2]:
            w_dt = self.grad_dtypes[2]
            self.t2 = self.mg2 if self.mg2 is not None else x.new_empty(E, H, F_, dtype=w_dt)
        self.db2 = x.new_empty(E, H, dtype=self.grad_dtypes[1]) if self.needs[5] else None

    def alloc_fc1(self, reuse_dy: bool) -> None:
        x, (E, W1, H) = self.x, self.w1.shape
        need_x, need_w1, _, _, need_b1, _ = self.needs
        if need_x:
            self.dx = self.dy if reuse_dy else x.new_empty(x.shape)
        if need_w1:
            w_dt = self.grad_dtypes[2]
            self.t1 = self.mg1 if self.mg1 is not None else x.new_empty(E, W1, H, dtype=w_dt)
        self.db1 = x.new_empty(E, W1, dtype=self.grad_dtypes[0]) if need_b1 else None

    def dact(self) -> None:
        _dact(
            self.dy, self.w2, self.offsets, self.h, self.probs, self.dh, self.a_re, self.part,
            self.dp, self.act, self.inter,
        )  # fmt: skip

    def wgrad2(self) -> None:
        """fc2's weight and bias gradients: the last reads of dy."""
        if self.t2 is not None:
            launch_ragged_k(self.dy.t(), self.act_out, self.offsets, self.t2, self.mg2 is not None)
        if self.db2 is not None:
            kernels.segment_colsum(self.dy, self.offsets, self.db2)

    def fc1(self) -> None:
        _fc1_grads(
            self.dh, self.w1, self.x, self.offsets, self.dx, self.t1, self.mg1 is not None,
            self.db1, self.zero_tail,
        )  # fmt: skip

    def _replay(self, segment: str, roles: tuple, body) -> None:
        key = None
        if self.x.is_cuda:
            key = (*self.base, segment)
            if not self.uid:
                key = (*key, *map(tensor_key, roles))
        replayed(key, roles, body)

    def one_segment(self) -> None:
        self.alloc_w2()
        self.alloc_fc1(reuse_dy=False)
        roles = (
            self.dy, self.offsets, self.w2, self.h, self.probs, self.dh, self.a_re, self.part,
            self.dp, self.a, self.t2, self.db2, self.w1, self.x, self.dx, self.t1, self.db1,
        )  # fmt: skip
        self._replay("all", roles, lambda: (self.dact(), self.wgrad2(), self.fc1()))

    def three_segments(self) -> None:
        roles = (self.dy, self.offsets, self.w2, self.h, self.probs, self.dh, self.a_re)
        self._replay("dact", (*roles, self.part, self.dp), self.dact)
        self.part = None
        _release(self.h)
        self.alloc_w2()
        roles = (self.dy, self.offsets, self.act_out, self.t2, self.db2)
        self._replay("wgrad2", roles, self.wgrad2)
        _release(self.act_out)
        self.alloc_fc1(self.reuse_dy)
        roles = (self.dh, self.offsets, self.w1, self.x, self.dx, self.t1, self.db1)
        self._replay("fc1", roles, self.fc1)

    def outputs(self) -> tuple:
        t1 = None if self.mg1 is not None else self.t1
        t2 = None if self.mg2 is not None else self.t2
        return self.dx, t1, t2, self.dp, self.db1, self.db2


def _run_backward(dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, opts, release: bool):
    bwd = _Backward(dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, opts)
    if not release or bwd.held_bytes() <= ONE_SEGMENT_MAX_BYTES or bwd.first_of_its_configuration():
        bwd.one_segment()
    else:
        bwd.three_segments()
    if release:
        _release(h)
        _release(bwd.act_out)
    return bwd.outputs()


def _backward_bytes(x, w1, w2, inter, recompute: bool) -> int:
    """Upper bound of the bytes a one-segment backward allocates, with h and the activation."""
    (R, H), (E, W1, _), F_ = x.shape, w1.shape, w2.shape[2]
    rows = 2 * R * H + 2 * R * W1 + (1 if recompute else 2) * R * F_ + E * W1 * H + E * H * F_
    return rows * x.element_size() + 4 * R * (tuning.dact_partial_rows(F_, inter) + 1)


def _needs(needs_input_grad: tuple) -> list[bool]:
    """The gradients the backward computes (x, w1, w2, probs, b1, b2), from the Function's
    ``needs_input_grad``."""
    n = needs_input_grad
    return [n[0], n[2], n[3], n[4], n[5], n[6]]


def _compile_backward_ahead(
    x, offsets, w1, w2, probs, b1, mg1, mg2, opts: _BackwardOptions, recompute: bool
) -> None:
    """On a configuration's first forward, start compiling its backward's kernels, so that
    they compile while the forward and the ops after it run (a new shape's first step otherwise
    compiles them only when the backward arrives, after everything else). The backward's
    buffers are allocated for a moment: skipped where they do not fit twice in spare memory,
    under CUDA-graph capture, and for a layout without a validated plan. (The plan fixes
    which inputs require gradients, so ``uid`` alone keys the configuration.)"""
    if not first_time(("mlp_bwd_ahead", opts.uid)):
        return
    if not (opts.uid and _aligned(x, w1, w2, b1, None)) or is_capturing():
        return
    if spare_bytes(x.device) < 2 * _backward_bytes(x, w1, w2, opts.inter, recompute):
        return
    (R, H), W1, F_ = x.shape, w1.shape[1], w2.shape[2]
    h, a = x.new_empty(R, W1), None if recompute else x.new_empty(R, F_)
    bwd = _Backward(x.new_empty(R, H), x, offsets, w1, w2, probs, h, a, mg1, mg2, opts)
    bwd.alloc_w2()
    bwd.alloc_fc1(reuse_dy=False)
    compile_ahead(lambda: (bwd.dact(), bwd.wgrad2(), bwd.fc1()), wait=False)


class _MLPCall(NamedTuple):
    """The options of one fused call, from its validated plan (a tuple: torch.compile traces it
    as constants)."""

    act_name: str
    limit: float
    alpha: float
    offset: float
    interleave: int  # 0: [gate | up] halves
    recompute: bool  # the backward recomputes the activation instead of saving it
    store_h: bool  # store h for the backward
    uid: int  # the plan's (0: none)
    eager: bool  # the call checked eager_shortcut for all its tensors
    zero_tail: bool  # False: rows past offsets[-1] are left unwritten

    @staticmethod
    def of(plan: _Plan, eager: bool, zero_tail: bool, store_h: bool) -> _MLPCall:
        a = plan.act
        return _MLPCall(
            a.name, a.limit, a.alpha, a.offset, plan.interleave or 0, plan.recompute, store_h,
            plan.uid, eager, zero_tail,
        )  # fmt: skip


class _MLPGrads(NamedTuple):
    """What one backward call computes, besides its tensors."""

    needs: tuple[bool, ...]  # gradients wanted: x, w1, w2, probs, b1, b2
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]  # b1's, b2's and the weights' grads
    direct: bool  # plain eager: the kernel op's implementation, which frees h and a early
    dy_owned: bool  # nothing else holds dy (only with direct): dx may take its memory


def _forward_pass(x, offsets, w1, w2, probs, b1, b2, call: _MLPCall) -> tuple:
    """The fused forward pass without autograd: (y [R, H], h [R, W1] pre-activation ([0, W1]
    unless ``call.store_h``), a [R, F] = act(h) · probs). Tensors as in :func:`grouped_mlp`,
    validated for ``call``."""
    run = _forward.impl if call.eager else _forward
    return run(
        x, offsets, w1, w2, probs, b1, b2, act_name=call.act_name, limit=call.limit,
        alpha=call.alpha, offset=call.offset, interleave=call.interleave, store_h=call.store_h,
        zero_tail=call.zero_tail, plan_uid=call.uid,
    )  # fmt: skip


def _backward_pass(dy, saved: tuple, main_grads: tuple, call: _MLPCall, grads: _MLPGrads) -> tuple:
    """The fused backward pass of :func:`_forward_pass`: (dx, dw1, dw2, dprobs, db1, db2), None
    where not wanted in ``grads.needs`` and for a weight whose gradient went to its fp32
    ``main_grad`` (``main_grads``: w1's and w2's, or None). ``saved``: (x, offsets, w1, w2,
    probs, h, a, b1), ``a`` None where the forward's call recomputes it."""
    x, offsets, w1, w2, probs, h, a, b1 = saved
    mg1, mg2 = main_grads
    needs = list(grads.needs)
    b1_dtype, b2_dtype, w_dtype = grads.dtypes
    run = _backward.impl if grads.direct else _backward
    out = run(
        dy, x, offsets, w1, w2, probs, h, a, mg1, mg2, b1, act_name=call.act_name,
        limit=call.limit, alpha=call.alpha, offset=call.offset, interleave=call.interleave,
        needs=needs, b1_dtype=b1_dtype, b2_dtype=b2_dtype, w_dtype=w_dtype,
        release=grads.direct, dy_owned=grads.dy_owned, plan_uid=call.uid,
        zero_tail=call.zero_tail,
    )  # fmt: skip
    if run is _backward:  # the custom op returns an empty tensor for each None
        wanted = (needs[0], needs[1] and mg1 is None, needs[2] and mg2 is None, *needs[3:])
        out = tuple(t if want else None for t, want in zip(out, wanted))
    return out


class _GroupedMLPFn(torch.autograd.Function):
    """``w1m`` / ``w2m``: None, or the higher-precision weights that ``w1`` / ``w2`` are
    per-call casts of (autocast): their gradients come straight out of the kernels in their
    dtype, instead of in x's dtype and cast again by autograd."""

    @staticmethod
    def forward(ctx, x, offsets, w1, w2, probs, b1, b2, mg1, mg2, call: _MLPCall, w1m, w2m):
        w_dtype = w1.dtype if w1m is None else w1m.dtype
        grad_dtypes = (*(b.dtype if b is not None else x.dtype for b in (b1, b2)), w_dtype)
        if call.eager and call.uid and x.is_cuda and x.shape[0] > 0:
            act = _activation(call.act_name, call.limit, call.alpha, call.offset)
            opts = _BackwardOptions(
                act, _interleave(call.interleave), tuple(_needs(ctx.needs_input_grad)),
                grad_dtypes, call.uid, False, call.zero_tail,
            )  # fmt: skip
            _compile_backward_ahead(x, offsets, w1, w2, probs, b1, mg1, mg2, opts, call.recompute)
        y, h, a = _forward_pass(x, offsets, w1, w2, probs, b1, b2, call)
        ctx.call = call
        # main_grad is mutated by every micro-batch's backward, so it cannot go through
        # save_for_backward (whose version check would fire); it is only written, never read.
        ctx.main_grads = (mg1, mg2)
        ctx.grad_dtypes = grad_dtypes
        ctx.masters = w1m is not None
        ctx.save_for_backward(x, offsets, w1, w2, probs, h, None if call.recompute else a, b1)
        return y

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("grouped_mlp")
        direct = eager_shortcut((grad,)) and ctx.call.eager
        # only the direct call may return dx in grad's memory (a custom op's outputs cannot
        # alias its inputs)
        grads = _MLPGrads(
            tuple(_needs(ctx.needs_input_grad)), ctx.grad_dtypes, direct,
            direct and owned_gradient(grad),
        )  # fmt: skip
        dx, dw1, dw2, dp, db1, db2 = _backward_pass(
            grad, ctx.saved_tensors, ctx.main_grads, ctx.call, grads
        )
        masters = (dw1, dw2) if ctx.masters else (None, None)
        if ctx.masters:
            dw1 = dw2 = None
        return dx, None, dw1, dw2, dp, db1, db2, None, None, None, *masters


_apply_grouped_mlp = function_apply(_GroupedMLPFn)


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


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What validation decided for one static configuration of a call."""

    act: Activation
    interleave: int | None
    recompute: bool
    for_backward: bool  # grad mode on and an input requires grad: store h for backward
    unfused_reason: str | None  # why the fused kernels cannot run this ("": CPU reference)
    # names a cached configuration whose layouts the kernels read as given, for the kernel
    # ops' launch replay (0: none, e.g. when compiling, where every call is validated afresh)
    uid: int = 0


def _check_optional(name, t, shape, ref) -> None:
    if t is None:
        return
    t = v.check_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    v.check_same_device(name, t, "x", ref)
    v.check_dtype(name, t, v.FLOAT_DTYPES)


def _fused_unsupported(x: torch.Tensor, F_: int, interleave: int | None) -> str | None:
    """Why the fused kernels cannot run this configuration (None if they can)."""
    if (F_ * x.element_size()) % 16:
        return f"F = {F_} is not a multiple of {16 // x.element_size()} (16-byte TMA rows)"
    if interleave is not None and interleave % 16:
        return f"glu_interleave = {interleave} is not a multiple of 16 (the smallest GEMM tile)"
    return None


def _main_grad(name: str, w: torch.Tensor) -> None:
    mg = getattr(w, "main_grad", None)
    if mg is None:
        return
    if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32 or mg.shape != w.shape:
        raise ValueError(
            f"{name}.main_grad must be an fp32 tensor of {name}'s shape {tuple(w.shape)}, got "
            f"{getattr(mg, 'dtype', type(mg).__name__)} {tuple(getattr(mg, 'shape', ()))}"
        )
    v.check_same_device(f"{name}.main_grad", mg, name, w)


def _make_plan(x, offsets, w1, w2, probs, b1, b2, activation, glu_interleave, recompute) -> _Plan:
    """Validate every input (clear errors) and decide how this configuration runs."""
    x, w1, w2 = v.check_tensor("x", x), v.check_tensor("w1", w1), v.check_tensor("w2", w2)
    v.check_ndim("x", x, 2, "[R, H]")
    v.check_dtype("x", x, v.FLOAT_DTYPES)
    act = resolve_activation(activation)
    v.check_mlp_weights(x, w1, w2, act)
    R, H = x.shape
    E, W1, _ = w1.shape
    v.check_interleave(glu_interleave, act, w2.shape[2])
    v.check_offsets(offsets, E, "x", x, "w1.shape[0]")
    v.check_byte_aligned("x", H, x.dtype, "H (x.shape[1])")
    v.check_interpretable("x", x)
    _check_optional("probs", probs, (R,), x)
    _check_optional("b1", b1, (E, W1), x)
    _check_optional("b2", b2, (E, H), x)
    _main_grad("w1", w1)
    _main_grad("w2", w2)
    for_backward = needs_grad(x, w1, w2, probs, b1, b2)
    # "" = the unfused composition without a warning (CPU tensors run the reference)
    reason = _fused_unsupported(x, w2.shape[2], glu_interleave) if use_triton(x) else ""
    return _Plan(act, glu_interleave, bool(recompute), for_backward, reason)


def _kernel_layouts(x, offsets, w1, w2, probs, b1, b2) -> bool:
    """Whether the kernels read these inputs as they are (at aligned addresses): rows
    TMA-ready, offsets and probs contiguous."""
    rows = all(tma_strides(t) for t in (x, w1, w2, b1, b2) if t is not None)
    return rows and offsets.is_contiguous() and (probs is None or probs.is_contiguous())


def _plan(x, offsets, w1, w2, probs, b1, b2, mg1, mg2, activation, interleave, recompute):
    key = call_key(
        "grouped_mlp", (x, offsets, w1, w2, probs, b1, b2, mg1, mg2),
        (activation, interleave, recompute, torch.is_grad_enabled()),
    )  # fmt: skip
    return planned(
        key,
        lambda: _make_plan(x, offsets, w1, w2, probs, b1, b2, activation, interleave, recompute),
        lambda: _kernel_layouts(x, offsets, w1, w2, probs, b1, b2),
    )


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
    zero_tail: bool = True,
) -> torch.Tensor:
    """Expert MLP over expert-sorted rows: ``y = fc2(act(fc1(x)) * probs)`` per expert.

    Args:
        x: [R, H] rows grouped by expert (bf16/fp16/fp32); H must span a multiple of 16
            bytes (8 elements for bf16/fp16, 4 for fp32) on every path.
        offsets: [E] int32/int64 cumulative end offsets on x's device, any stride; rows past
            offsets[-1] give zero output and zero gradients.
        w1: [E, 2F, H] for gated activations, [E, F, H] otherwise (nn.Linear layout). Gated
            rows: ``[:F]`` gate, ``[F:]`` up; or, with ``glu_interleave=I``, blocks of I rows
            alternating gate, up (see moekit.activations).
        w2: [E, H, F]. F may be any size: where F's rows are not 16-byte multiples (or the
            interleave is not a multiple of 16) the GPU runs an unfused, padded composition
            with the same results and a one-time warning.
        probs: optional [R] routing probabilities; each row's activation output is scaled by
            its prob and the gradient flows to probs.
        activation: "swiglu", "geglu", "clamped_swiglu" (gpt-oss: limit 7, alpha 1.702,
            offset 1; pass ``moekit.Activation("clamped_swiglu", limit=..)`` for others),
            "relu2", "gelu", "silu".
        recompute_activation: save only x and the pre-activation for backward and recompute
            the activation output there (less memory, a little more epilogue work).
        b1: optional [E, 2F] / [E, F] fc1 bias; b2: optional [E, H] fc2 bias.
        zero_tail: False leaves y's rows past offsets[-1] (and, in backward, dx's) unwritten
            instead of zeroing them: for callers whose row bound is far above the rows they use
            and that never read the tail (expert parallelism's receive bound).

    Returns:
        [R, H] in x's dtype. ``w1.main_grad`` / ``w2.main_grad`` (fp32), when present, receive
        the weight gradients in place and ``.grad`` stays None. Backward may run more than once
        through the same graph (``retain_graph=True``).

    Inside a ``torch.autocast`` region, x, the weights and biases are first cast to its dtype
    (as ``F.linear`` does; the weights' gradients then reach ``.grad``, in the weights' dtype,
    not ``main_grad``), and the result comes in that dtype; unless H would not span a multiple
    of 16 bytes in it, which keeps the call in its own dtype.
    """
    masters = (None, None)
    if isinstance(x, torch.Tensor) and autocast_on(x.device.type):
        if x.dim() == 2:
            x, w1, w2, b1, b2, masters = _autocast_inputs(x, w1, w2, b1, b2)
        with torch.autocast(x.device.type, enabled=False):  # the op's own torch calls as-is
            return _grouped_mlp(
                x, offsets, w1, w2, probs, activation, glu_interleave, recompute_activation,
                b1, b2, masters, bool(zero_tail),
            )  # fmt: skip
    return _grouped_mlp(
        x, offsets, w1, w2, probs, activation, glu_interleave, recompute_activation, b1, b2,
        masters, bool(zero_tail),
    )  # fmt: skip


def _autocast_inputs(x, w1, w2, b1, b2) -> tuple:
    """(x, w1, w2, b1, b2, masters) as an autocast region runs the call. Two weights of one
    higher-precision dtype that need gradients (fp32 parameters) are cast outside autograd and
    travel with the casts as ``masters``: the fused backward then writes their gradients in
    their dtype directly, instead of in the region's dtype for autograd to cast again (which
    moves three times the bytes). Otherwise every tensor goes through a differentiable cast."""
    dev = x.device.type
    dtype = autocast_dtype(dev, x.shape[1])
    if (
        dtype is not None
        and isinstance(w1, torch.Tensor)
        and isinstance(w2, torch.Tensor)
        and w1.dtype == w2.dtype
        and w1.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and w1.dtype != dtype
        and (w1.requires_grad or w2.requires_grad)
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()  # traced graphs fuse the casts themselves
    ):
        x, b1, b2 = autocast_tensors(dev, (x, b1, b2), (x.shape[1],))
        casts = tuple(w.detach().to(dtype).requires_grad_(w.requires_grad) for w in (w1, w2))
        return x, *casts, b1, b2, (w1, w2)
    return (*autocast_tensors(dev, (x, w1, w2, b1, b2), (x.shape[1],)), (None, None))


def _grouped_mlp(
    x,
    offsets,
    w1,
    w2,
    probs,
    activation,
    glu_interleave,
    recompute_activation,
    b1,
    b2,
    masters,
    zero_tail,
) -> torch.Tensor:
    mg1 = getattr(w1, "main_grad", None)
    mg2 = getattr(w2, "main_grad", None)
    plan = _plan(
        x, offsets, w1, w2, probs, b1, b2, mg1, mg2,
        activation, glu_interleave, recompute_activation,
    )  # fmt: skip
    # values are checked per call (the plan is cached): on the host for CPU tensors, on the
    # device under MOEKIT_DEBUG=1
    v.check_offsets_values(offsets, x.shape[0], rows_what="x.shape[0] (R)")
    reason = plan.unfused_reason
    if reason is None:
        # one eager check for the whole call: the Function and its kernel ops skip theirs
        eager = eager_shortcut((x, offsets, w1, w2, probs, b1, b2, mg1, mg2, *masters))
        call = _MLPCall.of(plan, eager, zero_tail, store_h=plan.for_backward)
        if not plan.for_backward:  # no gradient wanted (e.g. generation): no autograd node
            return _forward_pass(x, offsets, w1, w2, probs, b1, b2, call)[0]
        apply = _apply_grouped_mlp.direct if eager else _GroupedMLPFn.apply
        return apply(x, offsets, w1, w2, probs, b1, b2, mg1, mg2, call, *masters)
    if reason:
        warn_once(
            ("grouped_mlp", reason),
            f"moekit.grouped_mlp: fused path unavailable ({reason}); running the unfused "
            "composition of moekit ops",
        )
    if masters[0] is not None:  # the unfused ops differentiate through the casts themselves
        w1, w2 = (m.to(x.dtype) for m in masters)
    return _grouped_mlp_unfused(x, offsets, w1, w2, probs, b1, b2, plan, mg1, mg2)


def fused_unsupported(x: torch.Tensor, ffn_hidden_size: int, glu_interleave: int | None):
    """Why the fused passes cannot run on tensors like ``x`` with this F and GLU layout (None
    when they can): not a Triton device, or a layout the fused kernels do not cover."""
    if not use_triton(x):
        return "needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)"
    return _fused_unsupported(x, ffn_hidden_size, glu_interleave)
