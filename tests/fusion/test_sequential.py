"""moekit.fusion.Sequential's API: plans (deterministic, cached, declines with reasons), state
dicts, extra inputs and outputs, no_grad, main_grad, the rule settings (``MOEKIT_FUSIONS`` and
:func:`moekit.fusion.fusions`), the registry (``register_fusion`` / ``unregister_fusion``,
priorities, forward- and backward-only rules), and chains no rule fuses against their
reference. fp32 on the CPU; the grouped-MLP kernels run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import re
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moekit.fusion as mf
from moekit.config import interpret_mode
from moekit.fusion import (
    Decline,
    FusedOp,
    fusions,
    register_fusion,
    registered_rules,
    unregister_fusion,
)
from moekit.ops import RouterConfig
from moekit.runtime.state import STATE
from tests.fusion._check import assert_close, check_all_modes, compare, output_grads, run

# the router kernel's masked lanes divide by zero in Triton's interpreter (numpy warns; the
# lanes are discarded)
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in divide"),
]

needs_interpret = pytest.mark.skipif(
    not interpret_mode(), reason="the grouped MLP kernels need TRITON_INTERPRET=1 on the CPU"
)

H, F_, E = 32, 48, 3


def _offsets(ends) -> torch.Tensor:
    return torch.tensor(ends, dtype=torch.int32)


def _mlp(act=None, inter=None, bias=False, fc2_out=H) -> mf.Sequential:
    act = act or mf.ScaledSwiGLU
    return mf.Sequential(
        mf.GroupedLinear(E, H, 2 * F_, bias=bias), act(glu_interleave=inter),
        mf.GroupedLinear(E, F_, fc2_out, bias=bias),
    )  # fmt: skip


def _norm_chain(lin_in: int = 16, Hn: int = H) -> mf.Sequential:
    seq = mf.Sequential(
        mf.Linear(lin_in, Hn, bias=True), mf.AddExtraInput("residual"),
        mf.MakeExtraOutput("residual_out"), mf.RMSNorm(Hn),
    )  # fmt: skip
    with torch.no_grad():
        seq[3].weight.copy_(1 + 0.2 * torch.randn(Hn))
    return seq


def _mlp_then_norm() -> mf.Sequential:
    """Two independent fusion sites: grouped_mlp on [0:3], add_rmsnorm on [3:6]."""
    return mf.Sequential(
        mf.GroupedLinear(E, H, 2 * F_), mf.SwiGLU(), mf.GroupedLinear(E, F_, H),
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(H),
    )  # fmt: skip


def _fused(plan) -> tuple[list, list]:
    return plan.fused("forward"), plan.fused("backward")


NORM_PLAN = """\
forward:
  [0] Linear
  [1:4] add_rmsnorm(AddExtraInput, MakeExtraOutput, RMSNorm)
backward:
  [0] Linear
  [1:4] add_rmsnorm(AddExtraInput, MakeExtraOutput, RMSNorm)"""


@pytest.fixture
def add_rule():
    """register_fusion for the test; every rule it added is unregistered afterwards (even on
    failure) so the registry other tests see is the built-in one."""
    added: list[str] = []

    def add(fn, **kw):
        register_fusion(fn, **kw)
        added.append(kw["name"])
        return fn

    yield add
    for name in added:
        with contextlib.suppress(ValueError):  # a test may have unregistered it itself
            unregister_fusion(name)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """The forced-rule warnings are once per (rule, reason) per process: start from none."""
    monkeypatch.setattr(STATE, "warned", set())


# --- plans ------------------------------------------------------------------------------------


def test_plan_text_is_deterministic_and_cached():
    a, b = _norm_chain(), _norm_chain()
    x = torch.randn(5, 16)
    assert str(a.plan(x)) == str(b.plan(x)) == NORM_PLAN
    a(x.clone().requires_grad_(), torch.randn(5, H))
    pa = a.plan(x)
    # a second call runs the cached plan, whatever its token count
    a(torch.randn(9, 16, requires_grad=True), torch.randn(9, H))
    assert a.plan(x) is pa
    assert a.plan(torch.randn(11, 16)) is pa
    # another rule setting is another plan; leaving and re-entering the block finds it again
    with fusions(disable=["all"]):
        off = a.plan(x)
    assert off is not pa and _fused(off) == ([], [])
    with fusions(disable=["all"]):
        assert a.plan(x) is off
    assert a.plan(x) is pa
    # a different rank (3-d input) is a separate, equally fused plan
    p3 = a.plan(torch.randn(2, 5, 16))
    assert p3 is not pa and str(p3) == NORM_PLAN


def test_plan_cache_survives_building_another_module():
    """Sequential re-collects its parameters when some module registered one since, but a
    parameter of an unrelated module (here a new nn.Linear) must not drop its cached plans
    (it once did: any registration anywhere cleared every chain's cache)."""
    a = _norm_chain()
    x, r = torch.randn(5, 16, requires_grad=True), torch.randn(5, H)
    a(x, r)
    pa = a.plan(x)
    nn.Linear(4, 4)  # unrelated to a
    a(x, r)
    assert a.plan(x) is pa


@needs_interpret
def test_plan_with_declines_is_deterministic():
    """Two identically built chains whose planning passes through a decline print the same
    plan, declines included, in a fixed format."""

    def build():
        return mf.Sequential(
            mf.Router(H, E, 2), mf.Permute(E), mf.GroupedLinear(E, H, 2 * F_), mf.ScaledSwiGLU(),
            mf.GroupedLinear(E, F_, H), mf.Unpermute(weighted=True),
        )  # fmt: skip

    x = torch.randn(4, H)
    s1, s2 = str(build().plan(x)), str(build().plan(x))
    assert s1 == s2
    assert "  [2:5] grouped_mlp(GroupedLinear, ScaledSwiGLU, GroupedLinear)" in s1
    assert (
        "declined in forward at [0:6]: moe (the probs scale both the activation and the "
        "unpermute)" in s1
    )


@needs_interpret
@pytest.mark.parametrize("case", ["interleave4", "widths", "experts", "three_d"], ids=lambda c: c)
def test_grouped_mlp_declines_with_reason_and_still_runs(case):
    """A declined grouped_mlp is listed with its reason, and the basic ops it leaves to run
    still compute the chain (checked against the reference where the chain can run)."""
    if case == "interleave4":  # a GLU layout finer than the smallest GEMM tile
        seq, reason = _mlp(mf.SwiGLU, inter=4), "glu_interleave = 4 is not a multiple of 16"
    elif case == "widths":  # fc2 does not map back to fc1's input width
        seq, reason = _mlp(mf.GeGLU, fc2_out=2 * H), "widths do not chain"
    elif case == "experts":
        seq = mf.Sequential(
            mf.GroupedLinear(E, H, 2 * F_), mf.SwiGLU(), mf.GroupedLinear(E + 1, F_, H)
        )
        reason = f"fc1 has {E} experts, fc2 {E + 1}"
    else:  # rows given as [B, S, H]: the fused kernels take [R, H]
        seq, reason = _mlp(mf.SwiGLU), "the rows must be [R, H], got a 3-d input"
    x = torch.randn(2, 7, H) if case == "three_d" else torch.randn(14, H)
    plan = seq.plan(x)
    assert _fused(plan) == ([], [])
    declined = [d for d in plan.declined if d.rule == "grouped_mlp"]
    assert [(d.pass_, d.lo, d.hi) for d in declined] == [("forward", 0, 3)]
    assert reason in declined[0].reason
    assert f"declined in forward at [0:3]: grouped_mlp ({declined[0].reason})" in str(plan)
    if case in ("interleave4", "widths"):
        check_all_modes(seq, x, [_offsets([4, 4, 12])])


@needs_interpret
def test_moe_decline_probs_read_twice():
    """moe declines ScaledSwiGLU + Unpermute(weighted=True) (the probs would scale twice);
    grouped_mlp fuses the middle, and the gradient of Permute's probs, read by two ops, is
    the sum of both (checked against the reference)."""
    seq = mf.Sequential(
        mf.Router(H, 4, 2), mf.Permute(4), mf.GroupedLinear(4, H, 2 * F_), mf.ScaledSwiGLU(),
        mf.GroupedLinear(4, F_, H), mf.Unpermute(weighted=True),
    )  # fmt: skip
    fused, _, _ = check_all_modes(seq, torch.randn(12, H))
    assert _fused(fused.plan) == (["grouped_mlp"], ["grouped_mlp"])
    d = [d for d in fused.plan.declined if d.rule == "moe"]
    assert len(d) == 1 and "scale both" in d[0].reason


@needs_interpret
def test_moe_decline_fc2_bias_with_weighted_unpermute():
    seq = mf.Sequential(
        mf.Router(H, E, 2), mf.Permute(E), mf.GroupedLinear(E, H, 2 * F_), mf.SwiGLU(),
        mf.GroupedLinear(E, F_, H, bias=True), mf.Unpermute(weighted=True),
    )  # fmt: skip
    plan = seq.plan(torch.randn(4, H))
    assert "moe (fc2 has a bias" in str(plan)
    assert _fused(plan) == (["grouped_mlp"], ["grouped_mlp"])


def test_plan_without_arguments_and_repr():
    seq = _norm_chain()
    p = seq.plan()  # an input of the parameters' dtype and device, the first op's width
    assert p.facts.dtype == torch.float32 and p.facts.hidden == 16 and p.facts.ndim == 2
    assert str(p) == NORM_PLAN
    text = repr(seq)
    assert "plan:\n    forward:\n      [0] Linear" in text
    assert "[1:4] add_rmsnorm(AddExtraInput, MakeExtraOutput, RMSNorm)" in text
    assert "(3): RMSNorm(32, eps=1e-06)" in text
    if interpret_mode():  # a Router first: its hidden size
        E4 = 4
        moe = mf.Sequential(
            mf.Router(H, E4, 2), mf.Permute(E4), mf.GroupedLinear(E4, H, 2 * F_),
            mf.ScaledSwiGLU(), mf.GroupedLinear(E4, F_, H), mf.Unpermute(),
        )  # fmt: skip
        assert moe.plan().facts.hidden == H
        assert _fused(moe.plan()) == (["moe"], ["moe"])
    # a chain with no parameter at all still plans
    bare = mf.Sequential(mf.AddExtraInput("r"), mf.MakeExtraOutput("o"))
    assert _fused(bare.plan()) == ([], [])


def test_repr_does_not_raise_on_bad_settings(monkeypatch):
    seq = _norm_chain()
    monkeypatch.setenv("MOEKIT_FUSIONS", "-no_such_rule")
    text = repr(seq)
    assert "no plan:" in text and "no_such_rule" in text


# --- state dicts and naming -------------------------------------------------------------------


def test_state_dict_keys_and_round_trip():
    a, b = _norm_chain(), _norm_chain()
    keys = list(a.state_dict())
    assert keys == ["0.weight", "0.bias", "3.weight"]
    assert keys == list(nn.Sequential(*a.ops).state_dict())  # nn.Sequential's naming
    x, residual = torch.randn(6, 16), torch.randn(6, H)
    dys = output_grads(a, x, [residual])
    ra = run(a, "unfused", x, [residual], dys)
    # running fused or unfused adds nothing to the state dict
    run(a, "fused", x, [residual], dys)
    assert list(a.state_dict()) == keys
    # b differs before loading a's state, equals it after (fused b against unfused a)
    assert (run(b, "fused", x, [residual], dys).outs[0] - ra.outs[0]).norm() > 1e-2
    b.load_state_dict(a.state_dict())
    rb = run(b, "fused", x, [residual], dys)
    assert "add_rmsnorm" in rb.plan.fused("forward")
    compare(rb, ra, "loaded state")
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v), k


@needs_interpret
def test_state_dict_grouped_mlp_fused_or_not():
    """Fused ops own no parameters: the state dict saved with fusions off loads into a chain
    that runs fused, and gives the same outputs."""
    a, b = _mlp(bias=True), _mlp(bias=True)
    x, offs, probs = torch.randn(10, H), _offsets([3, 3, 10]), torch.rand(10)
    with fusions(disable=["all"]):
        sd = a.state_dict()
        ya = a(x, offs, probs)
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    b.load_state_dict(sd)
    yb = b(x, offs, probs)
    assert b.plan(x).fused("forward") == ["grouped_mlp"]
    assert_close(yb, ya, "fused after load")


def test_ordered_dict_of_named_ops():
    ops = OrderedDict(
        proj=mf.Linear(16, H, bias=True), add=mf.AddExtraInput("residual"),
        keep=mf.MakeExtraOutput("residual_out"), norm=mf.RMSNorm(H),
    )  # fmt: skip
    seq = mf.Sequential(ops)
    assert list(seq.state_dict()) == ["proj.weight", "proj.bias", "norm.weight"]
    assert seq.norm is ops["norm"] and seq[3] is ops["norm"] and len(seq) == 4
    fused, _, _ = check_all_modes(seq, torch.randn(4, 16), [torch.randn(4, H)])
    assert _fused(fused.plan) == (["add_rmsnorm"], ["add_rmsnorm"])
    with pytest.raises(TypeError, match="'bad'"):
        mf.Sequential(OrderedDict(ok=mf.Bias(4), bad=nn.Linear(4, 4)))


def test_replaced_parameter_gets_the_gradient():
    """A parameter object replaced after the chain ran (``op.weight = Parameter(...)``, or
    ``load_state_dict(assign=True)``) is the one the next call uses and differentiates."""
    seq = _norm_chain()
    x, residual = torch.randn(4, 16), torch.randn(4, H)
    run(seq, "fused", x, [residual], output_grads(seq, x, [residual]))
    old = seq[3].weight
    old.grad = None  # from the first call
    seq[3].weight = nn.Parameter(torch.full((H,), 2.0))
    dys = output_grads(seq, x, [residual])
    got = run(seq, "fused", x, [residual], dys)
    compare(got, run(seq, "reference", x, [residual], dys), "replaced weight")
    assert old.grad is None and seq[3].weight.grad is not None
    seq.load_state_dict(_norm_chain().state_dict(), assign=True)
    got = run(seq, "fused", x, [residual], dys)
    compare(got, run(seq, "reference", x, [residual], dys), "assigned state")
    assert all(p.grad is not None for p in seq.parameters())


def test_parameter_registered_later_is_used():
    """A parameter registered under a new name after the chain ran (a bias given to a Linear
    built without one) is the one the next call computes with and differentiates."""
    seq = mf.Sequential(mf.Linear(8, 8), mf.RMSNorm(8))
    x = torch.randn(3, 8)
    run(seq, "fused", x, (), output_grads(seq, x))
    seq[0].bias = nn.Parameter(torch.randn(8))
    dys = output_grads(seq, x)
    compare(run(seq, "fused", x, (), dys), run(seq, "reference", x, (), dys), "added bias")
    assert seq[0].bias.grad is not None


class _Probe(mf.BasicOp):
    """``y = x · weight``; records, per forward, whether ``self.weight`` was still the
    registered Parameter and the dtype of the weight it was handed."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.seen: list = []

    def op_forward(self, ctx, x, extras, params):
        self.seen.append((type(self.weight) is nn.Parameter, params["weight"].dtype))
        ctx.x = x
        return x * params["weight"], None

    def op_backward(self, ctx, dy, grads, params):
        return dy * params["weight"], {}, {"weight": (dy * ctx.x).reshape(-1, dy.shape[-1]).sum(0)}

    def reference(self, x, extras):
        return x * self.weight, {}


def test_parameters_are_handed_in_never_swapped():
    """The ops compute with the tensors a call hands them (here per-call casts under
    autocast) while their modules keep their own parameters registered."""
    seq = mf.Sequential(_Probe(8))
    x = torch.randn(3, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        seq(x).float().sum().backward()
    seq(x).sum().backward()
    assert seq[0].seen == [(True, torch.float16), (True, torch.float32)]
    assert seq[0].weight.grad.dtype == torch.float32


def test_gradient_for_an_unknown_parameter_raises():
    class Wrong(_Probe):
        def op_backward(self, ctx, dy, grads, params):
            return dy, {}, {"wieght": dy.sum(0)}

    seq = mf.Sequential(Wrong(4))
    with pytest.raises(RuntimeError, match="'wieght', not one of its parameters"):
        seq(torch.randn(2, 4, requires_grad=True)).sum().backward()


def test_a_copy_computes_with_its_own_parameters():
    """A deep copy of a chain that has run (plans cached) computes with the copy's
    parameters, not the original's."""
    seq = _norm_chain()
    x, r = torch.randn(4, 16), torch.randn(4, H)
    with fusions(disable=["add_rmsnorm"]):
        seq(x.requires_grad_(), r)
    seq(x, r)
    twin = copy.deepcopy(seq)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    for ctx in (fusions(disable=["add_rmsnorm"]), contextlib.nullcontext()):
        with ctx:
            got = twin(x, r)
        for a, b in zip(got, twin.reference(x, r)):
            assert_close(a, b, "copy")


# --- extra inputs and outputs -------------------------------------------------------------------


def _two_extras() -> mf.Sequential:
    # reads "b" first, then "a": the caller's order is the order of first use, not sorted
    return mf.Sequential(mf.AddExtraInput("b"), mf.Linear(8, 8), mf.AddExtraInput("a"))


def test_extra_inputs_by_position_and_name():
    seq = _two_extras()
    assert seq.extra_input_names == ("b", "a")
    x, a, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 8)
    want = seq.reference(x, b, a)
    assert_close(want, F.linear(x + b, seq[1].weight) + a, "reference")
    for got in (seq(x, b, a), seq(x, a=a, b=b), seq(x, b, a=a)):
        assert_close(got, want, "call")
    # positional order matters: swapping gives a different result
    assert (seq(x, a, b) - want).norm() > 1e-3


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), {}, r"missing extra input\(s\) \['b', 'a'\]"),
        (("B",), {}, r"missing extra input\(s\) \['a'\]"),
        (("B", "A"), {"c": 1}, "unexpected extra input 'c'"),
        (("B",), {"b": 1, "a": 1}, "extra input 'b' given both by position and by name"),
        (("B", "A", "C"), {}, r"takes 2 extra input\(s\) \('b', 'a'\), got 3"),
    ],
    ids=["none", "one_missing", "unexpected", "duplicate", "too_many"],
)
def test_extra_input_errors(args, kwargs, match):
    seq = _two_extras()
    t = torch.randn(3, 8)
    args = tuple(t if isinstance(v, str) else v for v in args)
    kwargs = {k: t for k in kwargs}
    with pytest.raises(TypeError, match=match):
        seq(t, *args, **kwargs)
    with pytest.raises(TypeError, match=match):  # the reference checks the same way
        seq.reference(t, *args, **kwargs)


def test_extras_given_to_a_chain_that_reads_none():
    seq = mf.Sequential(mf.Linear(8, 8))
    with pytest.raises(TypeError, match=r"takes 0 extra input\(s\)"):
        seq(torch.randn(2, 8), torch.randn(2, 8))
    with pytest.raises(TypeError, match="unexpected extra input 'r'"):
        seq(torch.randn(2, 8), r=torch.randn(2, 8))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        seq([1.0] * 8)


def test_construction_errors():
    with pytest.raises(ValueError, match="extra 'r' is made by op 0 and again by op 1"):
        mf.Sequential(mf.MakeExtraOutput("r"), mf.MakeExtraOutput("r"))
    with pytest.raises(ValueError, match=r"extra 'r' is read before op 1 \(MakeExtraOutput\)"):
        mf.Sequential(mf.AddExtraInput("r"), mf.MakeExtraOutput("r"))
    with pytest.raises(TypeError, match=r"op '1' must be a moekit\.fusion basic op, got Linear"):
        mf.Sequential(mf.Bias(4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="at least one op"):
        mf.Sequential()
    with pytest.raises(TypeError, match="Linear is a basic op"):
        mf.Linear(4, 4)(torch.randn(2, 4))
    with pytest.raises(TypeError, match="RMSNorm is a basic op"):
        mf.RMSNorm(4)(torch.randn(2, 4))


@pytest.mark.parametrize("use", [None, {0}, {1}], ids=["both", "main_only", "extra_only"])
def test_unread_extra_output_is_returned(use):
    """MakeExtraOutput at the end: nothing reads its extra, so the chain returns it; it is the
    main output itself, yet the two come back as separate outputs whose gradients add (and
    either alone may take part in the loss: the main one's missing gradient is zeros)."""
    seq = mf.Sequential(mf.Linear(8, 16, bias=True), mf.MakeExtraOutput("h"))
    assert seq.extra_output_names == ("h",)
    fused, _, ref = check_all_modes(seq, torch.randn(5, 8), use=use)
    y, h = fused.outs
    assert torch.equal(y, h)
    assert ref.grads["x"].abs().max() > 0


def test_extra_output_in_the_middle_is_returned():
    seq = mf.Sequential(mf.Linear(8, H), mf.MakeExtraOutput("pre"), mf.RMSNorm(H))
    assert seq.extra_output_names == ("pre",)
    check_all_modes(seq, torch.randn(2, 3, 8), use={1})  # only the extra in the loss
    check_all_modes(seq, torch.randn(2, 3, 8))


def test_extra_output_that_is_a_tensor_subclass():
    """An extra output that is a Tensor subclass (the nn.Parameter passed as x, exposed by
    MakeExtraOutput): forward and backward must pair outputs with gradients the same way
    (backward once matched by ``type(v) is Tensor``, dropping this output's gradient)."""
    seq = mf.Sequential(mf.MakeExtraOutput("h"), mf.Linear(8, 8))
    x = nn.Parameter(torch.randn(3, 8))
    dy, dh = torch.randn(3, 8), torch.randn(3, 8)
    y, h = seq(x)
    torch.autograd.backward([y, h], [dy, dh])
    assert_close(x.grad, dy @ seq[1].weight.detach() + dh, "dx")


def test_same_tensor_as_main_and_extra_input():
    """x passed as its own residual: its gradient is the sum over both uses."""
    seq = _norm_chain(lin_in=H)
    x = torch.randn(4, H)
    dys = output_grads(seq, torch.randn(4, H), [torch.randn(4, H)])

    def go(mode):
        xl = x.clone().requires_grad_()
        seq.zero_grad(set_to_none=True)
        with fusions(disable=["all"]) if mode == "unfused" else contextlib.nullcontext():
            out = (seq.reference if mode == "ref" else seq)(xl, xl)
            torch.autograd.backward(list(out), dys)
        return xl.grad

    want = go("ref")
    assert_close(go("fused"), want, "fused dx")
    assert_close(go("unfused"), want, "unfused dx")


@needs_interpret
def test_non_tensor_and_integer_extra_outputs():
    """Router → Permute ends the chain: it returns Permute's extras, an integer tensor
    (offsets, no gradient), the rows' probs (differentiable) and the Dispatch (no tensor)."""
    seq = mf.Sequential(
        mf.Router(H, 4, 2, RouterConfig(aux_loss_coeff=0.1)), mf.Permute(4, align=8)
    )
    assert seq.extra_output_names == ("offsets", "probs", "dispatch")
    x = torch.randn(10, H)
    ref = run(seq, "reference", x)
    hidden, probs = ref.outs[0], ref.outs[2]
    dys = [torch.randn_like(hidden), torch.randn_like(probs)]
    ref = run(seq, "reference", x, (), dys)
    for mode in ("fused", "unfused"):
        got = run(seq, mode, x, (), dys)
        compare(got, ref, mode)
        assert torch.equal(got.outs[1], ref.outs[1]) and got.outs[1].dtype == torch.int32
        assert isinstance(got.outs[3], type(ref.outs[3]))
        assert torch.equal(got.outs[3].row_index, ref.outs[3].row_index)


# --- no_grad, partial gradients, main_grad, retain_graph ------------------------------------------


@pytest.mark.parametrize("chain", ["norm", pytest.param("mlp", marks=needs_interpret)])
def test_no_grad_equals_grad_mode(chain):
    if chain == "norm":
        seq, x, extras = _norm_chain(), torch.randn(2, 5, 16), [torch.randn(2, 5, H)]
    else:  # the fused forward stores no pre-activation without grad: another kernel variant
        seq, x, extras = _mlp(bias=True), torch.randn(12, H), [_offsets([5, 5, 9]), torch.rand(12)]
    with_grad = seq(x.clone().requires_grad_(), *extras)
    with torch.no_grad():
        plain = seq(x, *extras)
    assert seq.plan(x, requires_grad=False).fused("forward") == seq.plan(x).fused("forward")
    assert seq.plan(x).fused("forward")  # a rule runs in both
    w = with_grad if isinstance(with_grad, tuple) else (with_grad,)
    p = plain if isinstance(plain, tuple) else (plain,)
    for a, b in zip(p, w):
        assert not a.requires_grad and a.grad_fn is None
        assert_close(a, b, "no_grad output", tol=1e-6)


@needs_interpret
def test_no_grad_routing_outputs_need_no_grad():
    """Ops whose backward is a RecordedGraph (Router, Permute, Unpermute, the moe op) must not
    record a graph when no backward will run: under no_grad their outputs once came back with
    requires_grad=True and a grad_fn (holding every activation alive)."""
    seq = mf.Sequential(mf.Router(H, 4, 2), mf.Permute(4), mf.Unpermute())
    assert seq.extra_output_names == ("offsets", "probs")  # unread: returned
    with torch.no_grad():
        y, _, probs = seq(torch.randn(6, H))
    assert y.shape == (6, H)
    for t in (y, probs):
        assert not t.requires_grad and t.grad_fn is None


def test_partial_requires_grad():
    """Only the residual needs a gradient (x is data, the norm weight frozen): the residual's
    gradient is right and frozen parameters get none."""
    seq = _norm_chain()
    seq[3].weight.requires_grad_(False)
    x, residual = torch.randn(3, 16), torch.randn(3, H)
    dys = output_grads(seq, x, [residual])
    for mode in ("reference", "fused", "unfused"):
        seq.zero_grad(set_to_none=True)
        r = residual.clone().requires_grad_()
        with fusions(disable=["all"]) if mode == "unfused" else contextlib.nullcontext():
            out = (seq.reference if mode == "reference" else seq)(x, r)
            torch.autograd.backward(list(out), dys)
        if mode == "reference":
            want = r.grad, seq[0].weight.grad
        else:
            assert_close(r.grad, want[0], f"{mode}: residual grad")
            assert_close(seq[0].weight.grad, want[1], f"{mode}: linear weight grad")
            assert seq[3].weight.grad is None


@pytest.mark.parametrize(
    "chain",
    [pytest.param("mlp", marks=needs_interpret), pytest.param("moe", marks=needs_interpret)],
)
def test_main_grad_accumulates(chain):
    """GroupedLinear weights carrying an fp32 ``main_grad`` get their gradient added there,
    fused and unfused, and ``.grad`` stays None; biases still get ``.grad``."""
    if chain == "mlp":
        seq, x = _mlp(bias=True), torch.randn(12, H)
        extras = [_offsets([0, 7, 12]), torch.rand(12)]
        weights = (seq[0].weight, seq[2].weight)
    else:
        seq = mf.Sequential(
            mf.Router(H, E, 2), mf.Permute(E), mf.GroupedLinear(E, H, 2 * F_, bias=True),
            mf.ScaledSwiGLU(), mf.GroupedLinear(E, F_, H), mf.Unpermute(),
        )  # fmt: skip
        x, extras, weights = torch.randn(8, H), [], (seq[2].weight, seq[4].weight)
    dys = output_grads(seq, x, extras)
    ref = run(seq, "reference", x, extras, dys)
    names = [n for n, p in seq.named_parameters() if any(p is w for w in weights)]
    for mode in ("fused", "unfused"):
        start = [torch.randn_like(w) for w in weights]  # accumulate, not overwrite
        for w, s in zip(weights, start):
            w.main_grad = s.clone()
        try:
            got = run(seq, mode, x, extras, dys)
            assert got.plan.fused("forward") == (
                []
                if mode == "unfused"
                else [chain[:3]] and ["grouped_mlp" if chain == "mlp" else "moe"]
            )
            for w, s, n in zip(weights, start, names):
                assert got.grads[f"param {n}"] is None, f"{mode}: {n}.grad set"
                assert_close(w.main_grad - s, ref.grads[f"param {n}"], f"{mode}: {n}.main_grad")
            for n, g in got.grads.items():
                if n.startswith("param") and n[6:] not in names:
                    assert_close(g, ref.grads[n], f"{mode}: {n}")
        finally:
            for w in weights:
                del w.main_grad


@pytest.mark.parametrize("bad", ["shape", "broadcast", "not_a_tensor"])
def test_bad_residual_raises_the_same_fused_or_not(bad):
    """AddExtraInput checks its extra against the main tensor: the same ValueError, naming
    the extra, whether add_rmsnorm runs it or the op itself."""
    seq = mf.Sequential(
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(H)
    )
    r = {"shape": torch.randn(4, H + 1), "broadcast": torch.randn(1, H), "not_a_tensor": 1.0}
    x = torch.randn(4, H)
    for off in ([], ["all"]):
        with fusions(disable=off), pytest.raises(ValueError, match="extra input 'residual'"):
            seq(x, r[bad])


def test_residual_of_another_dtype_raises_the_same_fused_or_not():
    seq = mf.Sequential(
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(H)
    )
    x, r = torch.randn(4, H), torch.randn(4, H, dtype=torch.float16)
    for off in ([], ["all"]):
        with fusions(disable=off), pytest.raises(ValueError, match="extra input 'residual'"):
            seq(x, r)


def test_double_backward_raises():
    """create_graph=True would need a differentiable backward: refused, not silently wrong."""
    seq = _norm_chain()
    x = torch.randn(3, 16, requires_grad=True)
    y, _ = seq(x, torch.randn(3, H))
    with pytest.raises(RuntimeError):  # at create_graph time, or at the second backward
        (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
        g.sum().backward()


def test_second_backward_through_the_pipeline_node_raises():
    seq = _norm_chain()
    x = torch.randn(3, 16, requires_grad=True)
    with fusions(disable=["add_rmsnorm"]):  # basic ops without autograd forms: the pipeline
        y, ro = seq(x, torch.randn(3, H))
    assert type(y.grad_fn).__name__ == "_PipelineFnBackward"
    (y.sum() + ro.sum()).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        (y.sum() + ro.sum()).backward()


def test_double_backward_through_the_pipeline_node_raises():
    seq = _norm_chain()
    x = torch.randn(3, 16, requires_grad=True)
    with fusions(disable=["add_rmsnorm"]):
        y, _ = seq(x, torch.randn(3, H))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)


def test_steps_with_autograd_forms_run_without_the_pipeline_node():
    """Linear then add_rmsnorm in both passes: F.linear and moekit's add_rmsnorm run one after
    the other under autograd (no pipeline node), with the reference's outputs and gradients;
    a second backward then works as it does for those ops."""
    seq = _norm_chain()
    x = torch.randn(3, 16)
    assert [s.rule for s in seq.plan(x).forward] == [None, "add_rmsnorm"]
    check_all_modes(seq, x, [torch.randn(3, H)])
    xg = x.clone().requires_grad_()
    y, ro = seq(xg, torch.randn(3, H))
    assert type(y.grad_fn).__name__ == "_AddRMSNormFnBackward"
    (y.sum() + ro.sum()).backward(retain_graph=True)
    first = xg.grad.clone()
    (y.sum() + ro.sum()).backward()
    assert_close(xg.grad, 2 * first, "second backward", tol=1e-6)


def test_linear_with_main_grad_runs_its_own_backward():
    """F.linear would leave the weight's gradient in .grad: a Linear whose weight carries a
    main_grad runs its own forward and backward (in a pipeline node), which add it there,
    while add_rmsnorm after it still runs as moekit's op."""
    seq = _norm_chain()
    x, r = torch.randn(3, 16), torch.randn(3, H)
    dys = output_grads(seq, x, [r])
    want = run(seq, "reference", x, [r], dys).grads
    seq.zero_grad(set_to_none=True)
    w = seq[0].weight
    w.main_grad = torch.zeros_like(w, dtype=torch.float32)
    try:
        xl = x.clone().requires_grad_()
        y, ro = seq(xl, r)
        assert type(y.grad_fn).__name__ == "_AddRMSNormFnBackward"
        torch.autograd.backward([y, ro], dys)
        assert w.grad is None
        assert_close(w.main_grad, want["param 0.weight"], "main_grad")
        assert_close(xl.grad, want["x"], "dx")
        assert_close(seq[0].bias.grad, want["param 0.bias"], "bias grad")
    finally:
        del w.main_grad
        seq.zero_grad(set_to_none=True)


# --- MOEKIT_FUSIONS and fusions() ----------------------------------------------------------


@needs_interpret
def test_env_turns_rules_off(monkeypatch):
    seq = _mlp_then_norm()
    x = torch.randn(6, H)
    assert _fused(seq.plan(x)) == (
        ["grouped_mlp", "add_rmsnorm"], ["grouped_mlp", "add_rmsnorm"],
    )  # fmt: skip
    monkeypatch.setenv("MOEKIT_FUSIONS", " -grouped_mlp ")  # read at each planning
    plan = seq.plan(x)
    assert _fused(plan) == (["add_rmsnorm"], ["add_rmsnorm"])
    assert "declined in forward at [0:3]: grouped_mlp (turned off)" in str(plan)
    monkeypatch.setenv("MOEKIT_FUSIONS", "-grouped_mlp,-add_rmsnorm")
    assert _fused(seq.plan(x)) == ([], ["rmsnorm_residual_grad"])  # the backward alone
    monkeypatch.setenv("MOEKIT_FUSIONS", "-all")
    plan = seq.plan(x)
    assert _fused(plan) == ([], [])
    assert {d.rule for d in plan.declined} == {
        "grouped_mlp", "add_rmsnorm", "rmsnorm_residual_grad",
    }  # fmt: skip
    # the unfused run under -all still computes the chain
    extras = [_offsets([2, 2, 6]), torch.randn(6, H)]
    dys = output_grads(seq, x, extras)
    compare(run(seq, "fused", x, extras, dys), run(seq, "reference", x, extras, dys), "-all")
    monkeypatch.delenv("MOEKIT_FUSIONS")
    assert seq.plan(x).fused("forward") == ["grouped_mlp", "add_rmsnorm"]


@needs_interpret
def test_env_force_warns_once_with_reason(monkeypatch, fresh_warnings):
    monkeypatch.setenv("MOEKIT_FUSIONS", "+grouped_mlp")
    seq = _mlp(mf.SwiGLU, inter=4)
    x, offs = torch.randn(8, H), _offsets([3, 5, 8])
    with pytest.warns(RuntimeWarning, match="forced rule 'grouped_mlp' declined") as rec:
        y = seq(x, offs)
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "not a multiple of 16" in msgs[0], msgs
    assert_close(y, seq.reference(x, offs), "forced but declined")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        # once: neither the cached plan nor a new chain of the same kind warns again
        seq(x, offs)
        _mlp(mf.SwiGLU, inter=4).plan(x)
        # a forced rule that applies does not warn
        assert _mlp(mf.SwiGLU, inter=16).plan(x).fused("forward") == ["grouped_mlp"]
    assert not [w for w in rec if "forced rule" in str(w.message)]


@needs_interpret
def test_fusions_force_warns(fresh_warnings):
    seq = _mlp(mf.GeGLU, fc2_out=2 * H)
    with pytest.warns(RuntimeWarning, match="widths do not chain"), fusions(force=["grouped_mlp"]):
        seq.plan(torch.randn(2, H))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("-no_such_rule", "unknown fusion rule 'no_such_rule'"),
        ("+no_such_rule", "unknown fusion rule 'no_such_rule'"),
        ("grouped_mlp", "entries must look like '-name' or '\\+name', got 'grouped_mlp'"),
        ("-add_rmsnorm,add_rmsnorm", "got 'add_rmsnorm'"),
        ("-", "got '-'"),
    ],
)
def test_env_errors(monkeypatch, spec, match):
    seq = _norm_chain()
    monkeypatch.setenv("MOEKIT_FUSIONS", spec)
    with pytest.raises(ValueError, match=match):
        seq(torch.randn(2, 16), torch.randn(2, H))


def test_fusions_nests_and_restores():
    seq = _norm_chain()
    x = torch.randn(3, 16)
    on = (["add_rmsnorm"], ["add_rmsnorm"])
    assert _fused(seq.plan(x)) == on
    with fusions(disable=["add_rmsnorm"]):
        assert _fused(seq.plan(x)) == ([], ["rmsnorm_residual_grad"])
        with fusions(disable=["rmsnorm_residual_grad"]):
            assert _fused(seq.plan(x)) == ([], [])
        assert _fused(seq.plan(x)) == ([], ["rmsnorm_residual_grad"])
        with pytest.raises(KeyError), fusions(disable=["all"]):
            assert _fused(seq.plan(x)) == ([], [])
            raise KeyError("leaves the block by an exception")
        assert _fused(seq.plan(x)) == ([], ["rmsnorm_residual_grad"])
    assert _fused(seq.plan(x)) == on
    with pytest.raises(ValueError, match="unknown fusion rule 'nope'"), fusions(disable=["nope"]):
        pass
    assert _fused(seq.plan(x)) == on  # the failed block left no setting behind
    with fusions(disable="add_rmsnorm"):  # one name, not its letters
        assert _fused(seq.plan(x)) == ([], ["rmsnorm_residual_grad"])
    with pytest.raises(ValueError, match="'all' forces nothing"), fusions(force="all"):
        pass


def test_env_plus_all_is_an_error(monkeypatch):
    monkeypatch.setenv("MOEKIT_FUSIONS", "+all")
    with pytest.raises(ValueError, match="'\\+all' forces nothing"):
        _norm_chain().plan(torch.randn(2, 16))


def test_module_casts_plan_afresh():
    """A cast keeps the parameter objects; the plans, which the rules made for the old dtype,
    must not survive it."""
    seq = _norm_chain()
    x = torch.randn(3, 16)
    seq.plan(x)
    assert seq._programs
    seq.half()
    assert not seq._programs
    y = seq(x.half(), torch.randn(3, H, dtype=torch.float16))
    assert all(t.dtype == torch.float16 for t in (y if isinstance(y, tuple) else (y,)))


def test_fp64_bias_gradients_accumulate_in_fp64():
    torch.manual_seed(0)
    seq = mf.Sequential(
        mf.Linear(8, 8, bias=True, dtype=torch.float64), mf.Bias(8, dtype=torch.float64)
    )
    x = torch.randn(1000, 8, dtype=torch.float64)
    dy = torch.randn(1000, 8, dtype=torch.float64)
    with fusions(disable=["all"]):
        (seq(x) * dy).sum().backward()
    want = dy.sum(0)
    for p in (seq[0].bias, seq[1].bias):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-12)


def test_backward_runs_the_plan_of_its_forward():
    """The forward picks the program; a backward run outside the fusions() block that
    shaped the forward still runs that program's backward (forward unfused, backward fused
    by rmsnorm_residual_grad in the call's plan) and matches the reference."""
    seq = _norm_chain()
    x, residual = torch.randn(4, 16), torch.randn(4, H)
    dys = output_grads(seq, x, [residual])
    ref = run(seq, "reference", x, [residual], dys)
    xl = x.clone().requires_grad_()
    seq.zero_grad(set_to_none=True)
    with fusions(disable=["add_rmsnorm"]):
        out = seq(xl, residual)
    with fusions(disable=["all"]):
        torch.autograd.backward(list(out), dys)
    assert_close(xl.grad, ref.grads["x"], "dx")
    for n, p in seq.named_parameters():
        assert_close(p.grad, ref.grads[f"param {n}"], n)


# --- the registry ------------------------------------------------------------------------------


class _AddBiases(FusedOp):
    """Both passes of Bias → Bias; counts its calls."""

    def __init__(self, ops, tag: str, calls: list) -> None:
        super().__init__(ops)
        self.tag, self.calls = tag, calls

    def fuser_forward(self, ctxs, x, extras, params):
        self.calls.append((self.tag, "forward"))
        return x + (params[0]["bias"] + params[1]["bias"]), None

    def fuser_backward(self, ctxs, dy, grads, params):
        self.calls.append((self.tag, "backward"))
        db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dy, {}, ({"bias": db}, {"bias": db})


def _bias_rule(tag: str, calls: list, decline: str | None = None):
    def rule(ops, facts):
        return Decline(decline) if decline is not None else _AddBiases(ops, tag, calls)

    return rule


def _bias_chain() -> mf.Sequential:
    seq = mf.Sequential(mf.Linear(8, 8), mf.Bias(8), mf.Bias(8))
    with torch.no_grad():
        seq[1].bias.normal_()
        seq[2].bias.normal_()
    return seq


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"name": "grouped_mlp"}, ValueError, "already registered"),
        ({"name": "all"}, ValueError, "reserved"),
        ({"name": "+x"}, ValueError, "without '\\+', '-' or ','"),
        ({"name": "-x"}, ValueError, "without"),
        ({"name": "a,b"}, ValueError, "without"),
        ({"name": ""}, ValueError, "non-empty"),
        ({"name": "t_bad", "passes": ("backward", "forward")}, ValueError, "passes must be"),
        ({"name": "t_bad", "passes": ("sideways",)}, ValueError, "passes must be"),
        ({"name": "t_bad", "passes": ()}, ValueError, "passes must be"),
        ({"name": "t_bad", "pattern": ()}, ValueError, "at least one op type"),
        ({"name": "t_bad", "priority": 1.5}, TypeError, "priority must be an int"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_register_errors(kw, exc, match):
    before = [r.name for r in registered_rules("forward") + registered_rules("backward")]
    args = {"pattern": (mf.Bias, mf.Bias), **kw}
    with pytest.raises(exc, match=match):
        register_fusion(lambda ops, facts: None, **args)
    after = [r.name for r in registered_rules("forward") + registered_rules("backward")]
    assert after == before  # nothing half-registered
    with pytest.raises(TypeError, match="rule must be callable"):
        register_fusion(42, name="t_not_callable", pattern=(mf.Bias,))
    assert "t_not_callable" not in [r.name for r in registered_rules("forward")]


def test_unregister_unknown_raises():
    with pytest.raises(ValueError, match="no fusion rule named 'no_such_rule'"):
        unregister_fusion("no_such_rule")


def test_custom_rule_priorities_and_unregister(add_rule):
    calls: list = []
    seq = _bias_chain()
    x = torch.randn(5, 8)
    base = seq.plan(x)
    assert _fused(base) == ([], [])
    add_rule(_bias_rule("lo", calls), name="t_lo", pattern=(mf.Bias, mf.Bias), priority=1)
    # registering invalidates cached plans
    assert _fused(seq.plan(x)) == (["t_lo"], ["t_lo"])
    add_rule(_bias_rule("hi", calls), name="t_hi", pattern=(mf.Bias, mf.Bias), priority=5)
    plan = seq.plan(x)
    assert _fused(plan) == (["t_hi"], ["t_hi"])
    assert [s.describe(seq.ops) for s in plan.forward] == ["[0] Linear", "[1:3] t_hi(Bias, Bias)"]
    fused, _, _ = check_all_modes(seq, x)
    assert calls == [("hi", "forward"), ("hi", "backward")]
    assert fused.plan is plan
    unregister_fusion("t_hi")
    assert _fused(seq.plan(x)) == (["t_lo"], ["t_lo"])
    unregister_fusion("t_lo")
    assert str(seq.plan(x)) == str(base)


def test_custom_rule_ties_break_by_registration_order(add_rule):
    calls: list = []
    seq = _bias_chain()
    x = torch.randn(5, 8)
    add_rule(_bias_rule("first", calls), name="t_first", pattern=(mf.Bias, mf.Bias), priority=3)
    add_rule(_bias_rule("second", calls), name="t_second", pattern=(mf.Bias, mf.Bias), priority=3)
    assert _fused(seq.plan(x)) == (["t_first"], ["t_first"])
    # turning the winner off lets the next one in, and the plan says why
    with fusions(disable=["t_first"]):
        plan = seq.plan(x)
    assert _fused(plan) == (["t_second"], ["t_second"])
    assert "declined in forward at [1:3]: t_first (turned off)" in str(plan)


def test_custom_rule_declines_fall_through(add_rule):
    calls: list = []
    seq = _bias_chain()
    x = torch.randn(5, 8)
    add_rule(_bias_rule("lo", calls), name="t_lo", pattern=(mf.Bias, mf.Bias), priority=1)
    add_rule(_bias_rule("x", calls, "not today"), name="t_no", pattern=(mf.Bias, mf.Bias),
             priority=9)  # fmt: skip
    add_rule(lambda ops, facts: None, name="t_none", pattern=(mf.Bias, mf.Bias), priority=8)
    plan = seq.plan(x)
    assert _fused(plan) == (["t_lo"], ["t_lo"])
    text = str(plan)
    assert "declined in forward at [1:3]: t_no (not today)" in text
    assert "declined in forward at [1:3]: t_none (declined without a reason)" in text


def test_custom_rule_beats_builtin_only_with_higher_priority(add_rule):
    """A custom forward rule on add_rmsnorm's window: at the same priority the built-in,
    registered first, wins; above it the custom one does. The custom op leaves each op's
    context as its forward would, so the built-in backward rule still applies."""
    calls: list = []

    class Chained(FusedOp):
        def fuser_forward(self, ctxs, x, extras, params):
            calls.append("forward")
            made: dict = {}
            for op, c, p in zip(self.ops, ctxs, params):
                x, m = op.op_forward(c, x, {**extras, **made}, p)
                made.update(m or {})
            return x, made

    pattern = (mf.AddExtraInput, mf.MakeExtraOutput, mf.RMSNorm)
    add_rule(lambda ops, facts: Chained(ops), name="t_same", pattern=pattern,
             passes=("forward",))  # fmt: skip
    seq = _norm_chain()
    x = torch.randn(3, 16)
    assert seq.plan(x).fused("forward") == ["add_rmsnorm"]
    unregister_fusion("t_same")
    add_rule(lambda ops, facts: Chained(ops), name="t_above", pattern=pattern, priority=1,
             passes=("forward",))  # fmt: skip
    fused, _, _ = check_all_modes(seq, x, [torch.randn(3, H)])
    assert _fused(fused.plan) == (["t_above"], ["rmsnorm_residual_grad"])
    assert calls == ["forward"]


def test_backward_only_custom_rule(add_rule):
    calls: list = []

    class LinearBiasBackward(FusedOp):
        def fuser_backward(self, ctxs, dy, grads, params):
            calls.append(("backward", ctxs[0].needs_input_grad))
            x = ctxs[0].x  # left by Linear's own forward
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            dx = dy @ params[0]["weight"] if ctxs[0].needs_input_grad else None
            return dx, {}, ({"weight": dy2.t() @ x2}, {"bias": dy2.sum(0)})

    add_rule(lambda ops, facts: LinearBiasBackward(ops), name="t_lin_bias_bwd",
             pattern=(mf.Linear, mf.Bias), passes=("backward",))  # fmt: skip
    # a higher-priority backward-only rule that declines: recorded for the backward pass
    add_rule(lambda ops, facts: Decline("not this one"), name="t_bwd_no",
             pattern=(mf.Linear, mf.Bias), passes=("backward",), priority=2)  # fmt: skip
    seq = mf.Sequential(mf.Linear(8, 16), mf.Bias(16), mf.LayerNorm(16))
    with torch.no_grad():
        seq[1].bias.normal_()
    fused, _, _ = check_all_modes(seq, torch.randn(2, 3, 8))
    assert _fused(fused.plan) == ([], ["t_lin_bias_bwd"])
    assert "declined in backward at [0:2]: t_bwd_no (not this one)" in str(fused.plan)
    assert "declined in forward" not in str(fused.plan)
    assert calls == [("backward", True)]
    # x without a gradient: the fused backward is told (needs_input_grad) and the weights
    # still get theirs
    calls.clear()
    x = torch.randn(4, 8)
    dys = output_grads(seq, x)
    seq.zero_grad(set_to_none=True)
    seq(x).backward(dys[0])
    got = [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad(set_to_none=True)
    seq.reference(x).backward(dys[0])
    for g, p in zip(got, seq.parameters()):
        assert_close(g, p.grad, "weights without dx")
    assert calls == [("backward", False)]


# --- chains no rule fuses ------------------------------------------------------------------


@pytest.mark.parametrize("ln_bias", [True, False])
def test_unfused_basic_ops_match_reference(ln_bias):
    """Linear (with bias) → SwiGLU → Linear → Bias → LayerNorm on a 3-d input: no rule
    applies; every gradient matches. A frozen parameter gets no gradient."""
    seq = mf.Sequential(
        mf.Linear(16, 64, bias=True), mf.SwiGLU(), mf.Linear(32, 24), mf.Bias(24),
        mf.LayerNorm(24, bias=ln_bias),
    )  # fmt: skip
    with torch.no_grad():
        seq[3].bias.normal_()
        seq[4].weight.copy_(1 + 0.3 * torch.randn(24))
    fused, _, _ = check_all_modes(seq, torch.randn(2, 5, 16))
    assert _fused(fused.plan) == ([], [])
    seq[0].bias.requires_grad_(False)
    fused, _, ref = check_all_modes(seq, torch.randn(7, 16))
    assert fused.grads["param 0.bias"] is None and ref.grads["param 0.bias"] is None


def test_glu_interleave_activation_matches_reference():
    """SwiGLU with an interleaved gate/up layout on its own (no grouped MLP around it)."""
    seq = mf.Sequential(mf.Linear(8, 32), mf.SwiGLU(glu_interleave=4), mf.Linear(16, 8))
    check_all_modes(seq, torch.randn(6, 8))
    assert re.search(r"'swiglu', scaled=False, glu_interleave=4", repr(seq))


def _graph_in_cycles(step) -> list[str]:
    """Names of the autograd nodes and pipeline call states made by ``step()`` that only Python's
    cycle collector would free (Triton's interpreter makes cycles of its own: not counted).

    Objects that existed before the step are held for its duration and left out: a cycle an
    earlier test left behind (a compiled graph's nodes, say) that a cache lets go of during the
    step is not the step's."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    before = gc.get_objects()  # held, so no id below is reused by a new object
    try:
        step()
        gc.collect()
        old = {id(o) for o in before}
        names = {type(o).__name__ for o in gc.garbage if id(o) not in old}
        return sorted(n for n in names if n == "_Call" or n.endswith("Backward"))
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
        del before


@pytest.mark.parametrize("mode", ["fused", "unfused"])
@pytest.mark.parametrize("chain", ["norm", "linear_norm", "mlp_then_norm"])
def test_a_step_frees_its_graph_without_the_cycle_collector(chain, mode):
    """Autograd points each tensor the pipeline returns at the pipeline's node; state kept from
    the forward that referred back to such a tensor would keep the whole graph (activations,
    the leaves' gradient accumulators) alive until a garbage collection."""
    R = 9
    if chain == "norm":
        seq = mf.Sequential(mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"),
                            mf.RMSNorm(H))  # fmt: skip
        args = (torch.randn(R, H, requires_grad=True), torch.randn(R, H, requires_grad=True))
    elif chain == "linear_norm":
        seq = _norm_chain()
        args = (torch.randn(R, 16, requires_grad=True), torch.randn(R, H, requires_grad=True))
    else:
        seq = _mlp_then_norm()
        x = torch.randn(R, H, requires_grad=True)
        args = (x, _offsets([3, 3, R]), torch.randn(R, H, requires_grad=True))

    def step():
        with fusions(disable=["all"]) if mode == "unfused" else contextlib.nullcontext():
            outs = seq(*args)
            sum(o.float().sum() for o in outs).backward()

    step()  # plans and first-call state are built outside the measured step
    assert _graph_in_cycles(step) == []


def test_an_extra_output_that_is_the_input_is_a_copy():
    """MakeExtraOutput first hands x itself on: the chain returns a tensor of its own, so an
    in-place update of it leaves the caller's x alone (a detached alias would rewrite it)."""
    chain = mf.Sequential(mf.MakeExtraOutput("residual_out"), mf.RMSNorm(H))
    x = torch.randn(2, 3, H, requires_grad=True)
    x0 = x.detach().clone()
    _, residual_out = chain(x)
    torch.testing.assert_close(residual_out, x0, rtol=0, atol=0)
    residual_out.add_(1.0)
    torch.testing.assert_close(x.detach(), x0, rtol=0, atol=0)


def test_checkpointed_chain_under_autocast_keeps_its_parameters():
    """Non-reentrant activation checkpointing recomputes the chain inside the backward of
    the autograd nodes the chain made: the recompute computes with the registered parameters
    cast afresh (nothing ever stands in for a parameter, so it cannot adopt a cast as one, keep
    it alive after the step or plan later calls on its dtype), and the gradients equal the
    plain call's."""
    import torch.utils.checkpoint as checkpoint

    torch.manual_seed(0)
    h, e = 16, 4
    chain = mf.Sequential(
        mf.Router(h, e, 2),
        mf.Permute(e),
        mf.GroupedLinear(e, h, 16),
        mf.ScaledSwiGLU(),
        mf.GroupedLinear(e, 8, h),
        mf.Unpermute(),
        mf.RMSNorm(h),
    )  # fmt: skip  (RMSNorm has no autograd form: the pipeline node runs, in every mode)
    plain = copy.deepcopy(chain)
    x = torch.randn(10, h)
    grads = []
    for c, ckpt in ((chain, True), (plain, False)):
        xa = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16):
            y = checkpoint.checkpoint(c, xa, use_reentrant=False) if ckpt else c(xa)
        y.float().sum().backward()
        grads.append([xa.grad, *(p.grad for p in c.parameters())])
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in chain.parameters())
    assert chain.plan().facts.dtype == torch.float32
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _autocast_chains():
    E, H, F_ = 4, 16, 8
    return {
        "grouped_mlp": mf.Sequential(
            mf.GroupedLinear(E, H, 2 * F_), mf.ScaledSwiGLU(), mf.GroupedLinear(E, F_, H)
        ),
        "linear_rmsnorm": mf.Sequential(mf.Linear(H, H), mf.RMSNorm(H)),
    }


@pytest.mark.parametrize("path", ["fused", "unfused"])
@pytest.mark.parametrize("name", ["grouped_mlp", "linear_rmsnorm"])
def test_autocast_casts_the_parameters_per_call(name, path):
    """Under torch.autocast an fp32 chain runs in the region's dtype, as the chain converted
    with .half() runs outside it (x and the parameters cast per call, autocast off inside), in
    both passes; the gradients reach the fp32 parameters through the casts."""
    if name == "grouped_mlp" and path == "fused" and not interpret_mode():
        pytest.skip("the fused MLP on CPU needs TRITON_INTERPRET=1")
    torch.manual_seed(0)
    R = 20
    x = torch.randn(R, 16)
    extras = (torch.tensor([5, 5, 12, R], dtype=torch.int32), torch.rand(R))
    chain = _autocast_chains()[name]
    args = extras if name == "grouped_mlp" else ()
    half = copy.deepcopy(chain).half()
    ctx = fusions(disable=["all"]) if path == "unfused" else contextlib.nullcontext()
    with ctx:
        xa = x.clone().requires_grad_()
        with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.float16):
            warnings.simplefilter("error", UserWarning)  # no warning: nothing to warn about
            y = chain(xa, *args)
            plan = chain.plan(xa)
        assert y.dtype == torch.float16
        g = torch.randn_like(y)
        y.backward(g)
        xh = x.half().requires_grad_()
        want = half(xh, *args)
        want.backward(g)
        assert str(plan) == str(half.plan(xh))
    if name == "grouped_mlp":  # the casts have the input's dtype: the rule applies
        assert ("grouped_mlp" in plan.fused("forward")) == (path == "fused"), plan
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, xh.grad.float(), rtol=0, atol=0)
    for p, q in zip(chain.parameters(), half.parameters()):
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        if name == "grouped_mlp" and path == "fused":  # written in fp32 (the test below)
            torch.testing.assert_close(p.grad.half(), q.grad)
        else:
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=0, atol=0)
    # the parameters are the chain's own again after the call
    assert all(isinstance(p, torch.nn.Parameter) for p in chain.parameters())
    assert chain(x, *args).dtype == torch.float32


@pytest.mark.skipif(not interpret_mode(), reason="the fused MLP on CPU needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("path", ["alone", "with_pipeline_node"])
def test_autocast_fused_mlp_writes_fp32_weight_gradients(path):
    """Under autocast the fused grouped MLP writes fp32 weights' gradients in fp32 from its
    fp32 accumulators (values an fp16 gradient cannot hold, within fp16 rounding of the
    .half() chain's): it runs inside the region on the registered parameters, whether it is
    the whole chain or followed by ops that run as a pipeline node on per-call casts; every
    other value and gradient equals the .half() chain's."""
    torch.manual_seed(0)
    R = 20
    ops = [mf.GroupedLinear(E, H, 2 * F_), mf.SwiGLU(), mf.GroupedLinear(E, F_, H)]
    if path == "with_pipeline_node":
        ops.append(mf.RMSNorm(H))  # RMSNorm alone has no autograd form: a pipeline node runs
    chain = mf.Sequential(*ops)
    half = copy.deepcopy(chain).half()
    x = torch.randn(R, H)
    offsets = _offsets([5, 12, R])
    xa = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.float16):
        y = chain(xa, offsets)
    g = torch.randn_like(y)
    y.backward(g)
    if path == "with_pipeline_node":
        assert type(y.grad_fn).__name__ == "_PipelineFnBackward"
    xh = x.half().requires_grad_()
    want = half(xh, offsets)
    want.backward(g)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, xh.grad.float(), rtol=0, atol=0)
    for (name, p), q in zip(chain.named_parameters(), half.parameters()):
        assert p.grad.dtype == torch.float32, name
        if name in ("0.weight", "2.weight"):
            assert not torch.equal(p.grad, p.grad.half().float()), name
            torch.testing.assert_close(p.grad.half(), q.grad, msg=name)
        else:
            torch.testing.assert_close(p.grad, q.grad.float(), rtol=0, atol=0, msg=name)


def test_autocast_leaves_a_chain_of_the_region_dtype_alone():
    """Parameters already in the region's dtype: no casts; x is cast to it."""
    torch.manual_seed(0)
    chain = _autocast_chains()["linear_rmsnorm"].half()
    x = torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        y = chain(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, chain(x.half()), rtol=0, atol=0)


def test_autocast_casts_shared_parameters_once_per_call():
    """A parameter registered in two ops (tied) is one cast; its gradient sums both uses."""
    torch.manual_seed(0)
    a, b = mf.Linear(16, 16), mf.Linear(16, 16)
    b.weight = a.weight
    chain = mf.Sequential(a, b)
    assert len(list(chain.parameters())) == 1
    x = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        chain(x).float().sum().backward()
    half = copy.deepcopy(chain).half()
    half(x.half()).float().sum().backward()
    torch.testing.assert_close(a.weight.grad, half[0].weight.grad.float(), rtol=0, atol=0)


def test_autocast_casts_a_residual_travelling_with_the_input():
    """A residual of x's shape and dtype is cast with x to the region's dtype (an fp32
    residual stream under autocast)."""
    torch.manual_seed(0)
    chain = mf.Sequential(mf.Linear(16, 16), mf.AddExtraInput("residual"),
                          mf.MakeExtraOutput("residual_out"), mf.RMSNorm(16))  # fmt: skip
    x, r = torch.randn(6, 16), torch.randn(6, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        y, r_out = chain(x, r)
    assert y.dtype == r_out.dtype == torch.float16
    want = copy.deepcopy(chain).half()(x.half(), r.half())
    torch.testing.assert_close(y, want[0], rtol=0, atol=0)
    torch.testing.assert_close(r_out, want[1], rtol=0, atol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_parameters_replaced_without_the_hook_are_the_ones_used(autocast):
    """torch.func.functional_call (like FSDP2's unshard) writes ``_parameters`` directly: the
    call computes with those tensors, casts them under autocast, and sends them the
    gradients."""
    torch.manual_seed(0)
    chain = mf.Sequential(mf.Linear(16, 16), mf.Bias(16), mf.RMSNorm(16))
    x = torch.randn(4, 16)
    chain(x)  # plans and parameter slots made with the registered parameters
    new = {k: torch.randn_like(v).requires_grad_() for k, v in chain.named_parameters()}
    region = torch.autocast("cpu", dtype=torch.float16) if autocast else contextlib.nullcontext()
    with region:
        y = torch.func.functional_call(chain, new, (x,))
    twin = copy.deepcopy(chain)
    twin.load_state_dict({k: v.detach() for k, v in new.items()})
    with region:
        want = twin(x)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    g = torch.randn_like(y)
    got = torch.autograd.grad(y, list(new.values()), g)
    want_grads = torch.autograd.grad(want, list(twin.parameters()), g)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(p.grad is None for p in chain.parameters())


def _spy_casts(monkeypatch) -> list:
    """(parameter, cast) for every cast the chains make under autocast from now on."""
    import moekit.fusion.sequential as sequential

    made, cast = [], sequential.autocast_weight

    def spy(p, dtype, master=True):
        out = cast(p, dtype, master)
        made.append((p, out[0]))
        return out

    monkeypatch.setattr(sequential, "autocast_weight", spy)
    return made


def test_autocast_casts_are_freed_by_the_backward(monkeypatch):
    """The per-call casts of a chain (here a pipeline node after F.linear) go with its
    backward, not with the output graph (which a training loop keeps until the next step)."""
    import weakref

    chain = mf.Sequential(mf.Linear(64, 64), mf.Bias(64), mf.RMSNorm(64))
    made = _spy_casts(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chain(torch.randn(8, 64)).float().sum()
    refs = [weakref.ref(c) for p, c in made if c is not p]
    made.clear()
    assert len(refs) == 3
    loss.backward()
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_autocast_casts_a_tied_parameter_once(monkeypatch):
    """A parameter registered in two ops is cast once per call, and both ops compute with
    that one cast."""
    a, b = mf.Linear(16, 16), mf.Linear(16, 16)
    b.weight = a.weight
    chain = mf.Sequential(a, mf.Bias(16), b)
    made = _spy_casts(monkeypatch)
    used = []
    for op in (a, b):
        form = op.autograd_forward
        op.autograd_forward = lambda x, e, p, f=form: (used.append(p["weight"]), f(x, e, p))[1]
    with torch.autocast("cpu", dtype=torch.float16):
        chain(torch.randn(3, 16)).float().sum().backward()
    assert sum(p is a.weight for p, _ in made) == 1
    assert len(used) == 2 and used[0] is used[1] and used[0].dtype == torch.float16


def test_outputs_in_the_input_shape_are_not_views():
    """A chain's outputs for an N-D input are tensors of their own (FSDP2's output hooks warn
    on views, and an in-place residual on a view would drop them)."""
    chain = mf.Sequential(mf.Linear(16, 16), mf.Bias(16), mf.AddExtraInput("residual"),
                          mf.MakeExtraOutput("residual_out"), mf.RMSNorm(16))  # fmt: skip
    x, r = torch.randn(2, 3, 16, requires_grad=True), torch.randn(2, 3, 16)
    for ctx in (contextlib.nullcontext(), fusions(disable=["all"])):
        with ctx:
            y, ro = chain(x, r)
        assert y.shape == ro.shape == x.shape
        assert not y._is_view() and not ro._is_view()
        y += 1  # an in-place residual update, then the backward
        (y.sum() + ro.sum()).backward()
