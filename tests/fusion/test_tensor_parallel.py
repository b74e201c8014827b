"""Tensor-parallel chains on two gloo ranks (CPU, fp32) against a single-process dense
reference built from the full weights: the ``allreduce_add_rmsnorm`` rule (applied, and with
every rule off), column- then row-parallel Linears, and sequence parallelism's
ReduceScatter / AllGather. Ranks are spawned with torch.multiprocessing like
tests/ops/test_allreduce.py; every rank draws the same full tensors from one seed and keeps
its own slice, so each can build the dense reference itself.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moekit.fusion as mf
from moekit.fusion import fusions
from tests._multiproc import finish_worker, run_gpu_check_under_torchrun
from tests.fusion._check import assert_close, column_row_chain, run

WORLD = 2
H, F_ = 32, 48


def _spawn(fn, *args) -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(fn, args=(os.path.join(d, "store"), *args), nprocs=WORLD, join=True)


def _init(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def _norm_chain(group=None) -> mf.Sequential:
    return mf.Sequential(
        mf.Linear(H, H, mode="row", group=group), mf.AllReduce(group),
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"), mf.RMSNorm(H),
    )  # fmt: skip


def _worker_row_allreduce_norm(rank: int, store: str) -> None:
    _init(rank, store)
    try:
        S = H // WORLD
        cols = slice(rank * S, (rank + 1) * S)  # this rank's columns of the full weight
        g = torch.Generator().manual_seed(1234)  # the same full tensors on every rank
        w_full = torch.randn(H, H, generator=g) / H**0.5
        norm_w = 1 + 0.2 * torch.randn(H, generator=g)
        seq = _norm_chain()
        with torch.no_grad():
            seq[0].weight.copy_(w_full[:, cols])
            seq[4].weight.copy_(norm_w)
        assert seq[0].weight.shape == (H, S)
        # [T, H] rows, and a batch dim (the fused op flattens and restores it)
        for lead in ((6,), (2, 3)):
            x_full = torch.randn(*lead, H, generator=g)
            residual = torch.randn(*lead, H, generator=g)
            dys = [torch.randn(*lead, H, generator=g) for _ in range(2)]
            # dense single-process reference
            xd, wd, rd, nd = _leaves(x_full, w_full, residual, norm_w)
            ro = xd @ wd.t() + rd
            y = _rms(ro, nd)
            torch.autograd.backward([y, ro], dys)
            for mode in ("fused", "unfused", "reference"):
                r = run(seq, mode, x_full[..., cols], [residual], dys)
                if mode == "fused":
                    assert r.plan.fused("forward") == ["allreduce_add_rmsnorm"], str(r.plan)
                    assert r.plan.fused("backward") == ["allreduce_add_rmsnorm"], str(r.plan)
                elif mode == "unfused":
                    assert r.plan.fused("forward") == r.plan.fused("backward") == []
                what = f"rank {rank} {mode} {lead}"
                assert_close(r.outs[0], y, f"{what}: output")
                assert_close(r.outs[1], ro, f"{what}: residual_out")
                assert_close(r.grads["x"], xd.grad[..., cols], f"{what}: dx slice")
                assert_close(r.grads["residual"], rd.grad, f"{what}: d residual")
                assert_close(r.grads["param 0.weight"], wd.grad[:, cols], f"{what}: dW slice")
                assert_close(r.grads["param 4.weight"], nd.grad, f"{what}: d norm weight")
        # under autocast the residual (the output's width, not x's) is cast with x: fused and
        # unfused both equal the dense model within fp16 rounding, gradients in fp32
        for mode in ("fused", "unfused"):
            xa = x_full[..., cols].clone().requires_grad_()
            ra = residual.clone().requires_grad_()
            seq.zero_grad(set_to_none=True)
            off = fusions(disable=["all"]) if mode == "unfused" else fusions()
            with off, torch.autocast("cpu", dtype=torch.float16):
                y16, ro16 = seq(xa, ra)
            assert y16.dtype == ro16.dtype == torch.float16
            torch.autograd.backward([y16, ro16], [d.half() for d in dys])
            what = f"rank {rank} {mode} under autocast"
            assert_close(y16, y, f"{what}: output", 5e-3)
            assert_close(ro16, ro, f"{what}: residual_out", 5e-3)
            for got, want, name in (
                (xa.grad, xd.grad[..., cols], "dx"),
                (ra.grad, rd.grad, "d residual"),
                (seq[0].weight.grad, wd.grad[:, cols], "dW"),
                (seq[4].weight.grad, nd.grad, "dnorm"),
            ):  # fmt: skip
                assert got.dtype == torch.float32, f"{what}: {name} is {got.dtype}"
                assert_close(got, want, f"{what}: {name}", 5e-3)
        # both passes run the same steps, each with an autograd form (F.linear, then
        # moekit.ops.allreduce_add_rmsnorm): no pipeline node; a weight with a main_grad
        # makes the Linear run its own backward (in a pipeline node), which adds into it
        x = x_full[..., cols].clone().requires_grad_()
        y, _ = seq(x, residual)
        nodes = {type(n).__name__ for n in (y.grad_fn, y.grad_fn.next_functions[0][0])}
        assert "_PipelineFnBackward" not in nodes, nodes
        seq.zero_grad(set_to_none=True)
        seq[0].weight.main_grad = torch.zeros_like(seq[0].weight)
        y, ro = seq(x, residual)
        torch.autograd.backward([y, ro], dys)
        assert seq[0].weight.grad is None
        assert_close(seq[0].weight.main_grad, wd.grad[:, cols], f"rank {rank}: main_grad")
        del seq[0].weight.main_grad
        # a group of one rank: allreduce_add_rmsnorm declines and add_rmsnorm fuses the rest
        own = [dist.new_group([i]) for i in range(WORLD)][rank]  # every rank makes both
        seq1 = _norm_chain(own)
        plan = seq1.plan(torch.randn(4, H))
        assert plan.fused("forward") == ["add_rmsnorm"], str(plan)
        assert "allreduce_add_rmsnorm (a group of one rank" in str(plan)
        x, res = torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)
        with torch.no_grad():
            got = seq1(x, res)
            want = seq1.reference(x, res)
        assert_close(got[0], want[0], "group of one: output")
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


def _worker_column_row(rank: int, store: str, mode_list: tuple) -> None:
    _init(rank, store)
    try:
        Fs = F_ // WORLD
        part = slice(rank * Fs, (rank + 1) * Fs)  # this rank's slice of the F features
        seq, (w1, b1, w2, b2), g = column_row_chain(H, F_, rank, WORLD)
        x = torch.randn(5, H, generator=g)
        dy = torch.randn(5, H, generator=g)
        xd, w1d, b1d, w2d, b2d = _leaves(x, w1, b1, w2, b2)
        y = (xd @ w1d.t() + b1d) @ w2d.t() + b2d
        y.backward(dy)
        for mode in mode_list:
            r = run(seq, mode, x, (), [dy])
            if r.plan is not None:
                assert r.plan.fused("forward") == r.plan.fused("backward") == []
            what = f"rank {rank} {mode}"
            assert_close(r.outs[0], y, f"{what}: output")
            # column mode all-reduces the input gradient: every rank has the full dx
            assert_close(r.grads["x"], xd.grad, f"{what}: dx")
            assert_close(r.grads["param 0.weight"], w1d.grad[part], f"{what}: dW1 rows")
            assert_close(r.grads["param 0.bias"], b1d.grad[part], f"{what}: db1 rows")
            assert_close(r.grads["param 1.weight"], w2d.grad[:, part], f"{what}: dW2 cols")
            assert_close(r.grads["param 3.bias"], b2d.grad, f"{what}: db2")
        finish_worker()
    finally:
        dist.destroy_process_group()


def _worker_scatter_gather(rank: int, store: str) -> None:
    _init(rank, store)
    try:
        T = 6  # divisible by the group size
        g = torch.Generator().manual_seed(7)
        w = torch.randn(H, H, generator=g) / H**0.5
        norm_w = 1 + 0.2 * torch.randn(H, generator=g)
        xs = [torch.randn(T, H, generator=g) for _ in range(WORLD)]  # each rank's input
        dys = [torch.randn(T, H, generator=g) for _ in range(WORLD)]  # each rank's loss
        # sequence parallel: replicated Linear on each rank's input, the sum scattered by
        # rows, a norm on this rank's rows, gathered back
        seq = mf.Sequential(mf.Linear(H, H), mf.ReduceScatter(), mf.RMSNorm(H), mf.AllGather())
        with torch.no_grad():
            seq[0].weight.copy_(w)
            seq[2].weight.copy_(norm_w)
        # dense: one loss Σ_r <y, dy_r> over y = norm(Σ_r x_r Wᵀ)
        xd = _leaves(*xs)
        wd, nd = _leaves(w, norm_w)
        y = _rms(sum(x @ wd.t() for x in xd), nd)
        y.backward(sum(dys))
        for mode in ("fused", "unfused", "reference"):
            r = run(seq, mode, xs[rank], (), [dys[rank]])
            what = f"rank {rank} {mode}"
            assert r.outs[0].shape == (T, H)
            assert_close(r.outs[0], y, f"{what}: output")
            # AllGather's backward reduce-scatters (sums every rank's dy), ReduceScatter's
            # gathers: this rank's input gradient is the dense one
            assert_close(r.grads["x"], xd[rank].grad, f"{what}: dx")
            # replicated parameters: each rank holds its part, their sum is the dense grad
            for name, want in (("param 0.weight", wd.grad), ("param 2.weight", nd.grad)):
                total = r.grads[name].clone()
                dist.all_reduce(total)
                assert_close(total, want, f"{what}: all-reduced {name}")
        # the bare round trip: gather(scatter(x)) is the sum, its input gradient the sum of
        # every rank's dy
        rt = mf.Sequential(mf.ReduceScatter(), mf.AllGather())
        for mode in ("fused", "unfused", "reference"):
            r = run(rt, mode, xs[rank], (), [dys[rank]])
            assert_close(r.outs[0], sum(xs), f"round trip {mode}: output")
            assert_close(r.grads["x"], sum(dys), f"round trip {mode}: dx")
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_row_parallel_allreduce_add_rmsnorm():
    _spawn(_worker_row_allreduce_norm)


@pytest.mark.dist
def test_column_then_row_parallel():
    _spawn(_worker_column_row, ("fused", "unfused"))


@pytest.mark.dist
def test_column_parallel_reference():
    """The oracle of a column-parallel Linear must all-reduce its input gradient like the op
    (Linear.reference was once a plain F.linear: each rank got its partial dx)."""
    _spawn(_worker_column_row, ("reference",))


@pytest.mark.dist
def test_reduce_scatter_all_gather():
    _spawn(_worker_scatter_gather)


@pytest.mark.gpu
@pytest.mark.dist
def test_gpu_fusion_tp_check_torchrun():
    """tests/distributed/gpu_fusion_tp_check.py on every local GPU (2+): the same chains over
    NCCL and symmetric memory, fp32 and bf16, every all-reduce algorithm, CUDA-graph capture."""
    run_gpu_check_under_torchrun("gpu_fusion_tp_check.py", "ALL FUSION TP CHECKS PASSED")


def test_allreduce_rule_declines_without_distributed():
    """Without torch.distributed the rule declines with its reason, and add_rmsnorm still
    fuses the three ops after the AllReduce (plans only: the AllReduce cannot run)."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a default group exists in this process")
    plan = _norm_chain().plan(torch.randn(3, H))
    assert plan.fused("forward") == ["add_rmsnorm"]
    assert plan.fused("backward") == ["add_rmsnorm"]
    assert (
        "declined in forward at [1:5]: allreduce_add_rmsnorm (torch.distributed is not "
        "initialised)" in str(plan)
    )
    with fusions(disable=["allreduce_add_rmsnorm"]):
        assert "allreduce_add_rmsnorm (turned off)" in str(_norm_chain().plan(torch.randn(3, H)))
