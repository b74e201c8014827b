"""Each built-in fusion rule against the chain's plain-PyTorch reference (``seq.reference``):
outputs and every gradient (main input, extra inputs, every parameter) agree in fp32 on the
CPU whether the rule applies or every rule is off, and the plan shows the rule applied (and
not applied with the rules off).

The grouped MLP and MoE kernels run in Triton's interpreter (``TRITON_INTERPRET=1``); fp32 only
(the interpreter's bf16 ``tl.dot`` is wrong, and the rules decline bf16 on the CPU). The
``allreduce_add_rmsnorm`` rule needs two ranks: tests/fusion/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import moekit.fusion as mf
from moekit.config import interpret_mode
from moekit.fusion import fusions
from moekit.ops import RouterConfig
from tests.fusion._check import assert_close, check_all_modes, compare, output_grads, run

# the router kernel's masked lanes divide 0/0 in Triton's interpreter (numpy warns; the
# lanes are discarded)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide")

needs_interpret = pytest.mark.skipif(
    not interpret_mode(), reason="the grouped MLP kernels need TRITON_INTERPRET=1 on the CPU"
)

H, F = 32, 48  # distinct, so a transposed weight or swapped width cannot pass


def _offsets(ends) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


# --- grouped_mlp ------------------------------------------------------------------------------

# (activation op, bias, glu_interleave, R rows, offsets) — why each exists:
MLP_CASES = {
    # an empty expert in the middle: its segment must neither shift the next expert's rows
    # nor leave garbage in its own weight gradient
    "scaled_swiglu-empty_middle": (mf.ScaledSwiGLU, False, None, 40, [8, 8, 30, 40]),
    # the first expert empty and rows past offsets[-1] (padding tail): the tail must come out
    # zero, and with a bias the bias must not be added to rows no expert owns
    "swiglu-bias-empty_first-tail": (mf.SwiGLU, True, None, 40, [0, 13, 13, 33]),
    # every row in one (the middle) expert, interleaved gate/up layout, GeGLU with biases
    "geglu-bias-inter16-all_in_one": (mf.GeGLU, True, 16, 24, [0, 24, 24]),
    # a single row (smaller than any tile) with the probs scale and interleave
    "scaled_swiglu-bias-inter16-one_row": (mf.ScaledSwiGLU, True, 16, 1, [0, 1, 1]),
    # one expert (E=1) and a tail after it
    "scaled_geglu-E1-tail": (mf.ScaledGeGLU, False, None, 21, [17]),
}


def _mlp(act_cls, bias: bool, inter, E: int) -> mf.Sequential:
    seq = mf.Sequential(
        mf.GroupedLinear(E, H, 2 * F, bias=bias), act_cls(glu_interleave=inter),
        mf.GroupedLinear(E, F, H, bias=bias),
    )  # fmt: skip
    return seq


@needs_interpret
@pytest.mark.parametrize("case", list(MLP_CASES), ids=list(MLP_CASES))
def test_grouped_mlp(case):
    act_cls, bias, inter, R, ends = MLP_CASES[case]
    E = len(ends)
    seq = _mlp(act_cls, bias, inter, E)
    offsets = _offsets(ends)
    x = torch.randn(R, H)
    extras = [offsets]
    if seq[1].scaled:
        extras.append(torch.rand(R))
    fused, unfused, ref = check_all_modes(seq, x, extras)
    assert fused.plan.fused("forward") == ["grouped_mlp"]
    assert fused.plan.fused("backward") == ["grouped_mlp"]

    # exact zeros where no expert owns a row or an expert owns none (uninitialised memory in
    # a kernel's output would still pass a relative-norm check when it happens to be small)
    end = ends[-1]
    counts = [b - a for a, b in zip([0, *ends[:-1]], ends)]
    for label, r in (("fused", fused), ("unfused", unfused)):
        assert torch.all(r.outs[0][end:] == 0), f"{label}: rows past offsets[-1] not zero"
        assert torch.all(r.grads["x"][end:] == 0), f"{label}: dx past offsets[-1] not zero"
        if "probs" in r.grads:
            assert torch.all(r.grads["probs"][end:] == 0), label
        for e, c in enumerate(counts):
            if c == 0:
                for name in ("param 0.weight", "param 2.weight", "param 0.bias", "param 2.bias"):
                    if name in r.grads:
                        g = r.grads[name][e]
                        assert torch.all(g == 0), f"{label}: {name}[{e}] of an empty expert"
    # a case whose every row is owned must still produce a non-trivial output (the checks
    # above are not vacuous)
    if end > 0:
        assert ref.outs[0][:end].abs().max() > 0


@needs_interpret
def test_grouped_mlp_non_contiguous_inputs():
    """x a transposed view and probs a strided one: the kernels must honour the strides (or
    the fused op copy), not read the storage as if contiguous."""
    seq = _mlp(mf.ScaledSwiGLU, True, None, 3)
    x, probs = torch.randn(H, 14).t(), torch.rand(28)[::2]
    assert not x.is_contiguous() and not probs.is_contiguous()
    fused, _, _ = check_all_modes(seq, x, [_offsets([4, 4, 11]), probs])
    assert fused.plan.fused("forward") == ["grouped_mlp"]


@needs_interpret
def test_grouped_mlp_all_rows_past_offsets():
    """offsets[-1] = 0: no expert owns any row (e.g. every token dropped). Output and every
    gradient must be exact zeros (not uninitialised memory), fused and unfused. The reference
    is checked by the test below; here the expectation is written out."""
    seq = _mlp(mf.ScaledSwiGLU, True, None, 3)
    offsets, x, probs = _offsets([0, 0, 0]), torch.randn(9, H), torch.rand(9)
    dys = [torch.randn(9, H)]
    for mode in ("fused", "unfused"):
        r = run(seq, mode, x, [offsets, probs], dys)
        assert r.plan.fused("forward") == (["grouped_mlp"] if mode == "fused" else [])
        assert torch.all(r.outs[0] == 0), mode
        for name, g in r.grads.items():
            assert g is not None and torch.all(g == 0), f"{mode}: {name}"


def test_reference_differentiable_when_no_row_is_owned():
    """The oracle itself with offsets[-1] = 0: GroupedLinear.reference once returned a tensor
    without grad_fn there (no row ran a matmul), so the reference could not be differentiated
    for a legal configuration. Its gradients must be zeros, like the op's."""
    seq = mf.Sequential(mf.GroupedLinear(2, H, H))
    x = torch.randn(4, H, requires_grad=True)
    y = seq.reference(x, _offsets([0, 0]))
    assert y.requires_grad  # autograd would give zero gradients, like the op itself
    y.sum().backward()
    assert torch.all(x.grad == 0)


@needs_interpret
@pytest.mark.parametrize("x_grad", [True, False], ids=["x_grad", "x_data"])
def test_grouped_mlp_partial_gradients(x_grad):
    """probs given without requires_grad (e.g. detached routing weights), and x with or
    without it (the chain's first op on data): the fused backward is asked for neither
    gradient it need not make, and the others still match."""
    seq = _mlp(mf.ScaledSwiGLU, True, None, 3)
    offsets, x, probs = _offsets([5, 12, 20]), torch.randn(20, H), torch.rand(20)
    dys = output_grads(seq, x, [offsets, probs])

    def go(mode):
        xl = x.clone().requires_grad_(x_grad)
        seq.zero_grad(set_to_none=True)
        ctx = fusions(disable=["all"]) if mode == "unfused" else fusions()
        with ctx:
            y = seq.reference(xl, offsets, probs) if mode == "ref" else seq(xl, offsets, probs)
        y.backward(dys[0])
        return [y, *((xl.grad,) if x_grad else ()), *(p.grad for p in seq.parameters())]

    want = go("ref")
    assert seq.plan(x).fused("backward") == ["grouped_mlp"]
    for mode in ("fused", "unfused"):
        got = go(mode)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            assert_close(a, b, f"{mode}: result {i}")


# --- add_rmsnorm + rmsnorm_residual_grad ----------------------------------------------------------


def _norm_chain(Hn: int, linear_in: int | None = None) -> mf.Sequential:
    ops = [] if linear_in is None else [mf.Linear(linear_in, Hn, bias=True)]
    ops += [mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(Hn)]
    seq = mf.Sequential(*ops)
    with torch.no_grad():  # a non-trivial norm weight, so its gradient is tested in earnest
        seq[-1].weight.copy_(1 + 0.2 * torch.randn(Hn))
    return seq


NORM_CASES = {
    "2d": ((7, 48), None),  # odd row count
    "3d": ((2, 5, 48), None),  # a batch dim: the fused op flattens and restores it
    "linear_before": ((6, 48), 32),  # a Linear whose input gradient comes through the norm
    "linear_before_3d": ((3, 2, 48), 16),
}


@pytest.mark.parametrize("case", list(NORM_CASES), ids=list(NORM_CASES))
def test_add_rmsnorm(case):
    shape, lin = NORM_CASES[case]
    seq = _norm_chain(shape[-1], lin)
    x = torch.randn(*shape[:-1], lin or shape[-1])
    residual = torch.randn(shape)
    assert seq.extra_input_names == ("residual",)
    assert seq.extra_output_names == ("residual_out",)
    fused, _, _ = check_all_modes(seq, x, [residual])
    assert fused.plan.fused("forward") == ["add_rmsnorm"]
    assert fused.plan.fused("backward") == ["add_rmsnorm"]
    assert fused.outs[0].shape == shape and fused.outs[1].shape == shape


@pytest.mark.parametrize("layout", ["x_transposed", "residual_transposed", "3d_permuted"])
def test_add_rmsnorm_non_contiguous(layout):
    """Inputs that are views with other strides: the fused op reads them as [T, H] rows and
    must give its outputs the caller's shape."""
    seq = _norm_chain(48)
    if layout == "x_transposed":
        x, residual = torch.randn(48, 5).t(), torch.randn(5, 48)
    elif layout == "residual_transposed":
        x, residual = torch.randn(5, 48), torch.randn(48, 5).t()
    else:
        x, residual = torch.randn(3, 48, 2).permute(0, 2, 1), torch.randn(3, 2, 48)
    assert not (x.is_contiguous() and residual.is_contiguous())
    fused, _, _ = check_all_modes(seq, x, [residual])
    assert fused.plan.fused("forward") == ["add_rmsnorm"]


def test_add_rmsnorm_main_output_only():
    """residual_out takes no part in the loss: its gradient never arrives (None), and the
    fused backward must treat it as zero rather than fail or read stale memory."""
    seq = _norm_chain(48)
    x, residual = torch.randn(5, 48), torch.randn(5, 48)
    dys = output_grads(seq, x, [residual], use={0})
    assert dys[1] is None
    ref = run(seq, "reference", x, [residual], dys)
    for mode in ("fused", "unfused"):
        got = run(seq, mode, x, [residual], dys)
        compare(got, ref, mode)
    assert got.plan is not None


def test_add_rmsnorm_mixed_passes():
    """Forward unfused, backward fused by rmsnorm_residual_grad alone: the fused backward must
    read RMSNorm's context as the basic forward left it."""
    off = "add_rmsnorm"
    seq = _norm_chain(48, linear_in=32)
    x, residual = torch.randn(6, 32), torch.randn(6, 48)
    dys = output_grads(seq, x, [residual])
    ref = run(seq, "reference", x, [residual], dys)
    with fusions(disable=[off]):
        got = run(seq, "fused", x, [residual], dys)
    compare(got, ref, f"{off} off")
    on = "rmsnorm_residual_grad"
    assert on in got.plan.fused("forward") + got.plan.fused("backward")
    assert off not in got.plan.fused("forward") + got.plan.fused("backward")
    assert any(d.rule == off and d.reason == "turned off" for d in got.plan.declined)


def test_add_rmsnorm_residual_read_inside_chain():
    """A transformer sub-block: residual_out is read again by a later AddExtraInput, so its
    gradient reaches the fused norm backward from inside the chain (not from the caller) and
    the chain returns no extra output."""
    Hn = 48
    seq = mf.Sequential(
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(Hn),
        mf.Linear(Hn, Hn), mf.AddExtraInput("residual_out"),
    )  # fmt: skip
    with torch.no_grad():
        seq[2].weight.copy_(1 + 0.2 * torch.randn(Hn))
    assert seq.extra_input_names == ("residual",) and seq.extra_output_names == ()
    fused, _, _ = check_all_modes(seq, torch.randn(2, 3, Hn), [torch.randn(2, 3, Hn)])
    assert fused.plan.fused("forward") == ["add_rmsnorm"]
    assert fused.plan.fused("backward") == ["add_rmsnorm"]


# --- moe -----------------------------------------------------------------------------------------

T, E, K = 24, 4, 2

# (activation, Unpermute weighted, fc biases, Permute kwargs) — why each exists:
MOE_CASES = {
    # the MoELayer path: probs scale the activation, plain unpermute
    "scaled": (mf.ScaledSwiGLU, False, False, {}),
    # probs at the unpermute: the rule moves them into the activation (fc2 has no bias)
    "weighted_unpermute": (mf.SwiGLU, True, False, {}),
    # padded segments (align=16): zero padding rows between experts, biases on both GEMMs
    "align16-bias": (mf.ScaledSwiGLU, False, True, {"align": 16}),
    # capacity C = ceil(0.75·T·k/E) = 9 rows per expert below the busiest expert's ≥ 12
    # (pigeonhole): slots are dropped and must contribute nothing, to the output or gradients
    "capacity": (mf.ScaledSwiGLU, False, False, {"capacity_factor": 0.75}),
    # the moved probs with padding and drops together (C = 6, rounded up to 8 < 12)
    "weighted-align8-capacity": (mf.SwiGLU, True, False, {"align": 8, "capacity_factor": 0.5}),
}


def _moe(act_cls, weighted: bool, bias: bool, permute_kw: dict, aux: float = 1.0):
    return mf.Sequential(
        mf.Router(H, E, K, RouterConfig(aux_loss_coeff=aux)), mf.Permute(E, **permute_kw),
        mf.GroupedLinear(E, H, 2 * F, bias=bias), act_cls(),
        mf.GroupedLinear(E, F, H, bias=bias), mf.Unpermute(weighted=weighted),
    )  # fmt: skip


@needs_interpret
@pytest.mark.parametrize("case", list(MOE_CASES), ids=list(MOE_CASES))
def test_moe(case):
    act_cls, weighted, bias, kw = MOE_CASES[case]
    seq = _moe(act_cls, weighted, bias, kw)
    x = torch.randn(T, H)
    assert seq.extra_input_names == () and seq.extra_output_names == ()
    fused, _, _ = check_all_modes(seq, x)
    # the whole chain is one step, and grouped_mlp (lower priority) did not take its middle
    assert fused.plan.fused("forward") == ["moe"] and fused.plan.fused("backward") == ["moe"]
    assert [(s.lo, s.hi) for s in fused.plan.forward] == [(0, 6)]
    if "capacity_factor" in kw:  # the case really drops slots
        with torch.no_grad():
            r = seq[0].route(x)
            d = seq[1].permute(x, r[1], r[2])
        assert (d.row_index < 0).any()
    if case == "scaled":
        # the router's aux loss rides on the main output's gradient; the reference includes
        # it, and without it the router's weight gradient differs (so the comparison above
        # would notice a fused path that dropped it)
        seq[0].aux_loss_coeff = 0.0
        without = run(seq, "fused", x, (), fused.dys)
        gw, g0 = fused.grads["param 0.weight"], without.grads["param 0.weight"]
        assert (gw - g0).norm() > 1e-2 * gw.norm(), ((gw - g0).norm(), gw.norm())


@needs_interpret
def test_moe_declines_when_its_extras_are_used_after_it():
    """An unscaled activation before an unweighted Unpermute leaves Permute's ``probs`` to the
    chain's outputs: the moe fused op keeps its extras inside, so it declines there (and the
    chain still runs, with grouped_mlp fusing the experts)."""
    seq = _moe(mf.SwiGLU, False, False, {})
    assert seq.extra_output_names == ("probs",)
    x = torch.randn(T, H)
    plan = seq.plan(x)
    assert "moe" not in plan.fused("forward")
    assert any(d.rule == "moe" and "probs" in d.reason for d in plan.declined)
    y, probs = seq(x)
    with fusions(disable=["all"]):
        y_ref, probs_ref = seq(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(probs, probs_ref)


@needs_interpret
@pytest.mark.parametrize("weighted", [False, True], ids=["scaled", "weighted_unpermute"])
def test_moe_off_grouped_mlp_on(weighted):
    """With only ``moe`` off, grouped_mlp fuses the expert MLP inside the basic routing ops
    (its probs come from Permute's extra; a weighted Unpermute keeps its own weighting)."""
    seq = _moe(mf.SwiGLU if weighted else mf.ScaledSwiGLU, weighted, False, {"align": 16})
    x = torch.randn(T, H)
    dys = output_grads(seq, x)
    ref = run(seq, "reference", x, (), dys)
    with fusions(disable=["moe"]):
        got = run(seq, "fused", x, (), dys)
    compare(got, ref, "moe off")
    assert got.plan.fused("forward") == ["grouped_mlp"]
    assert got.plan.fused("backward") == ["grouped_mlp"]
    assert [(s.lo, s.hi) for s in got.plan.forward if s.rule] == [(2, 5)]
