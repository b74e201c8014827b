"""Shared helpers of the fusion tests: run a chain fused, unfused or as its reference, and
compare outputs and every gradient by relative norm."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import moekit.fusion as mf
from moekit.fusion import Plan, Sequential, fusions

TOL = 1e-4  # fp32 relative-norm tolerance


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 (exact zeros on both sides give 0)."""
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_close(got, want, what: str, tol: float = TOL) -> None:
    assert want is not None, f"{what}: the reference has no value"
    assert got is not None, f"{what}: missing (None) where the reference has one"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e}"


@dataclasses.dataclass
class Run:
    outs: tuple  # every output of the chain (main first)
    grads: dict  # "x", each differentiable extra input's name, "param <name>" → grad
    plan: Plan | None  # the plan the call ran (None for the reference)
    dys: list | None  # the output gradients of the backward


def _leaf(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        return v.detach().clone().requires_grad_()
    return v


def run(seq: Sequential, mode: str, x, extras=(), dys=None, *, kw: bool = False) -> Run:
    """One forward + backward of ``seq`` on fresh leaf copies of ``x`` and the extras.

    mode: "fused" (rules as registered), "unfused" (every rule off) or "reference".
    ``extras``: positional extra inputs (a dict with ``kw=True``: by name). ``dys``: one
    gradient per floating output (None: that output takes no part in the loss); default
    none, i.e. forward only."""
    xl = _leaf(x)
    if kw:
        ex = {k: _leaf(v) for k, v in extras.items()}
        named = dict(ex)
    else:
        ex = [_leaf(v) for v in extras]
        named = dict(zip(seq.extra_input_names, ex))
    seq.zero_grad(set_to_none=True)
    ctx = fusions(disable=["all"]) if mode == "unfused" else contextlib.nullcontext()
    plan = None
    with ctx:
        if mode == "reference":
            out = seq.reference(xl, **ex) if kw else seq.reference(xl, *ex)
        else:
            plan = seq.plan(xl)
            out = seq(xl, **ex) if kw else seq(xl, *ex)
        outs = out if isinstance(out, tuple) else (out,)
        if dys is not None:
            fl = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
            assert len(fl) == len(dys)
            pairs = [(o, g) for o, g in zip(fl, dys) if g is not None]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    grads = {"x": xl.grad}
    for n, v in named.items():
        if isinstance(v, torch.Tensor) and v.requires_grad:
            grads[n] = v.grad
    for n, p in seq.named_parameters():
        grads[f"param {n}"] = None if p.grad is None else p.grad.clone()
    outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
    return Run(outs, grads, plan, dys)


def output_grads(seq: Sequential, x, extras=(), use=None) -> list:
    """Random gradients for each floating output of ``seq`` (None where ``use`` says the
    output takes no part in the loss)."""
    with torch.no_grad():
        out = seq.reference(x, *extras)
    outs = out if isinstance(out, tuple) else (out,)
    fl = [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return [torch.randn_like(o) if use is None or i in use else None for i, o in enumerate(fl)]


def compare(got: Run, want: Run, label: str, tol: float = TOL) -> None:
    """Every output and every gradient of ``got`` against ``want``."""
    assert len(got.outs) == len(want.outs), label
    for i, (a, b) in enumerate(zip(got.outs, want.outs)):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            assert_close(a, b, f"{label}: output {i}", tol)
    assert got.grads.keys() == want.grads.keys(), label
    for name, g in want.grads.items():
        if g is None:  # not reached by the reference's graph: none, or zeros, is right
            h = got.grads[name]
            assert h is None or torch.all(h == 0), f"{label}: {name} nonzero, reference none"
        else:
            assert_close(got.grads[name], g, f"{label}: grad of {name}", tol)


def check_all_modes(seq: Sequential, x, extras=(), *, use=None, tol: float = TOL):
    """Fused and unfused runs against the reference; returns (fused, unfused, reference)."""
    dys = output_grads(seq, x, extras, use)
    ref = run(seq, "reference", x, extras, dys)
    fused = run(seq, "fused", x, extras, dys)
    unfused = run(seq, "unfused", x, extras, dys)
    compare(fused, ref, "fused", tol)
    compare(unfused, ref, "unfused", tol)
    assert unfused.plan.fused("forward") == [] and unfused.plan.fused("backward") == []
    return fused, unfused, ref


def column_row_chain(H: int, F: int, rank: int, world: int, device=None, seed: int = 99):
    """``Linear(H, F, bias, column) → Linear(F, H, row) → AllReduce → Bias(H)`` holding this
    rank's shards of full weights that every rank draws from ``seed`` (on the CPU). Returns
    ``(seq, (w1, b1, w2, b2), g)``: the full weights, for a dense reference, and the generator,
    for more tensors drawn alike on every rank."""
    part = slice(rank * (F // world), (rank + 1) * (F // world))  # this rank's F features
    g = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(F, H, generator=g) / H**0.5, torch.randn(F, generator=g)
    w2, b2 = torch.randn(H, F, generator=g) / F**0.5, torch.randn(H, generator=g)
    seq = mf.Sequential(
        mf.Linear(H, F, bias=True, mode="column", device=device),
        mf.Linear(F, H, mode="row", device=device), mf.AllReduce(), mf.Bias(H, device=device),
    )  # fmt: skip
    with torch.no_grad():
        seq[0].weight.copy_(w1[part])
        seq[0].bias.copy_(b1[part])
        seq[1].weight.copy_(w2[:, part])
        seq[3].bias.copy_(b2)
    return seq, (w1, b1, w2, b2), g
