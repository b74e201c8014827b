"""A new fusion for ``moekit.fusion``: ``Linear → Bias`` as one ``F.linear`` with the bias
folded in, forward and backward, registered with ``moekit.fusion.register_fusion``.

    python examples/fusion_custom_rule.py

The chain below has two ``Linear → Bias`` windows: the rule fuses the first and declines the
second (its Linear already has a bias); a tensor-parallel Linear is declined too. The script
prints the plan, checks outputs and gradients against the same chain with every rule off and
against ``Sequential.reference``, and unregisters the rule. CPU, float32, about a second.
See docs/fusion.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import moekit.fusion as mf
from moekit.fusion.ops.linear import accumulate_weight_grad

RULE = "linear_bias"

# --- the new fusion: a fused op and its rule, 25 lines of code (docstrings counted, blank
# --- lines and comments not), registered by the 3-line register_fusion call in main() ----


class FusedLinearBias(mf.FusedOp):
    """``y = x @ weightᵀ + bias`` in one ``F.linear``. Owns no parameters: it computes with
    the Linear's ``weight`` and the Bias's ``bias`` as the call hands them in (``params``, one
    mapping per op). Leaves the Linear's context (``x``)."""

    def fuser_forward(self, ctxs, x, extras, params):
        linear, bias = params
        ctxs[0].x = x
        return F.linear(x, linear["weight"], bias["bias"]), None

    def fuser_backward(self, ctxs, dy, grads, params):
        x, w, b = ctxs[0].x, params[0]["weight"], params[1]["bias"]
        dx = dy @ w if ctxs[0].needs_input_grad else None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        # into w.main_grad when the weight has one, as Linear's own backward does
        dw = accumulate_weight_grad(w, dy2.t() @ x2) if w.requires_grad else None
        acc = torch.promote_types(dy2.dtype, torch.float32)  # fp32, or fp64 for fp64
        db = dy2.sum(0, dtype=acc).to(b.dtype) if b.requires_grad else None
        return dx, {}, ({"weight": dw}, {"bias": db})  # dx, extra-input grads, per op


def linear_bias_rule(ops, facts):
    """The fused op, or why not."""
    linear, bias = ops
    if linear.mode is not None:  # its backward all-reduces dx over the group
        return mf.Decline(f"a tensor-parallel Linear (mode={linear.mode!r})")
    if linear.bias is not None:
        return mf.Decline("the Linear already has a bias")
    if bias.bias.shape != (linear.out_features,) or bias.bias.dtype != linear.weight.dtype:
        return mf.Decline("the Bias does not match the Linear's output")
    return FusedLinearBias(ops)


# --- the rest: build, plan, check --------------------------------------------------------


def _run(fn, seq, x, dy) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient of one forward + backward."""
    seq.zero_grad(set_to_none=True)
    x.grad = None
    y = fn(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in seq.parameters())]


def main() -> dict:
    torch.manual_seed(0)
    mf.register_fusion(
        linear_bias_rule, name=RULE, pattern=(mf.Linear, mf.Bias), passes=("forward", "backward")
    )
    try:
        H, Fw = 32, 64  # hidden, expert-style ffn width (gated: fc1 makes 2·Fw)
        seq = mf.Sequential(
            mf.Linear(H, 2 * Fw), mf.Bias(2 * Fw), mf.SwiGLU(),
            mf.Linear(Fw, H, bias=True), mf.Bias(H),
        )  # fmt: skip
        with torch.no_grad():  # Bias starts at zero: give it something to check
            seq[1].bias.normal_()
            seq[4].bias.normal_()

        x = torch.randn(4, 8, H, requires_grad=True)  # [B, T, H]: any leading dims
        dy = torch.randn(4, 8, H)
        plan = seq.plan(x)  # what a call with this x runs (plans depend on x's rank)
        print(plan)
        assert plan.fused("forward") == [RULE] and plan.fused("backward") == [RULE], plan
        assert [d.reason for d in plan.declined] == ["the Linear already has a bias"], plan
        tp = mf.Sequential(mf.Linear(H, Fw, mode="column"), mf.Bias(Fw)).plan()
        print("\n".join(f"tensor-parallel: {d.rule} ({d.reason})" for d in tp.declined))
        assert not tp.fused("forward"), tp

        fused = _run(seq, seq, x, dy)
        with mf.fusions(disable=["all"]):
            assert seq.plan(x).fused("forward") == []
            unfused = _run(seq, seq, x, dy)
        reference = _run(seq.reference, seq, x, dy)

        names = ["y", "x.grad", *(f"{n}.grad" for n, _ in seq.named_parameters())]
        err = 0.0
        for name, a, u, r in zip(names, fused, unfused, reference):
            for other, what in ((u, "unfused"), (r, "reference")):
                torch.testing.assert_close(a, other, rtol=1e-5, atol=1e-5, msg=f"{name} {what}")
                err = max(err, ((a - other).norm() / other.norm().clamp_min(1e-30)).item())
        print(
            f"OK: {RULE} fuses Linear → Bias at [0:2]; outputs and gradients ({len(names)} "
            f"tensors) match the unfused chain and the reference (max rel err {err:.1e})"
        )
        return {"plan": plan, "max_rel_err": err, "tensors": len(names)}
    finally:
        mf.unregister_fusion(RULE)


if __name__ == "__main__":
    main()
