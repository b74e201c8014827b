"""GPU checks of ``moekit.fusion``'s tensor-parallel chains over NCCL, under torchrun.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node=2 tests/distributed/gpu_fusion_tp_check.py

Checks (every rank, failures raise), against a dense single-process reference that every rank
builds from the full weights in float64:

- row-parallel Linear → AllReduce → AddExtraInput → MakeExtraOutput → RMSNorm, fused
  (``allreduce_add_rmsnorm`` in both passes), unfused and as its reference, in
  fp32 and bf16, for each all-reduce algorithm, 2-D and 3-D inputs: outputs and every gradient;
  the fused outputs bit-identical on every rank;
- column- then row-parallel Linears, and ReduceScatter → RMSNorm → AllGather (NCCL);
- the fused chain's forward + backward captured in a CUDA graph and replayed on new data;
- a warm fused step under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import moekit.fusion as mf
from moekit.distributed import init_distributed
from moekit.fusion import fusions
from tests.fusion._check import column_row_chain

# relative-norm tolerances against the float64 dense reference
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _close(got, want, what: str, tol: float) -> None:
    assert got is not None, f"{what}: missing"
    err = _rel(got, want)
    assert err <= tol, f"rank {dist.get_rank()} {what}: relative error {err:.3e} > {tol:.0e}"


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(got[0], g) for g in got[1:])


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _step(seq, mode: str, x, extras, dys):
    """Forward + backward of ``seq`` on fresh leaves; (outputs, {name: grad}, plan)."""
    xl, ex = _leaf(x), [_leaf(e) for e in extras]
    seq.zero_grad(set_to_none=True)
    ctx = fusions(disable=["all"]) if mode == "unfused" else contextlib.nullcontext()
    plan = None
    with ctx:
        if mode == "reference":
            out = seq.reference(xl, *ex)
        else:
            plan = seq.plan(xl)
            out = seq(xl, *ex)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(list(outs), dys)
    grads = {"x": xl.grad, **{f"extra {i}": e.grad for i, e in enumerate(ex)}}
    grads.update({f"param {n}": p.grad for n, p in seq.named_parameters()})
    return tuple(o.detach() for o in outs), grads, plan


def _row_chain(H: int, dtype: torch.dtype, algo: str, dev) -> mf.Sequential:
    return mf.Sequential(
        mf.Linear(H, H, mode="row", device=dev, dtype=dtype), mf.AllReduce(algo=algo),
        mf.AddExtraInput("residual"), mf.MakeExtraOutput("residual_out"),
        mf.RMSNorm(H, device=dev, dtype=dtype),
    )  # fmt: skip


def check_row_parallel_norm(dev: torch.device) -> None:
    W, rank = dist.get_world_size(), dist.get_rank()
    n = 0
    for H in (64, 4096):
        S = H // W
        cols = slice(rank * S, (rank + 1) * S)
        g = torch.Generator().manual_seed(H)  # the same full tensors on every rank
        w_full = torch.randn(H, H, generator=g) / H**0.5
        norm_w = 1 + 0.2 * torch.randn(H, generator=g)
        for lead in ((1,), (6,), (2, 3), (300,)):
            x_full = torch.randn(*lead, H, generator=g)
            res = torch.randn(*lead, H, generator=g)
            dys = [torch.randn(*lead, H, generator=g) for _ in range(2)]
            # dense float64 reference
            xd, wd, rd, nd = (_leaf(t.double()) for t in (x_full, w_full, res, norm_w))
            ro = xd @ wd.t() + rd
            y = _rms(ro, nd)
            torch.autograd.backward([y, ro], [d.double() for d in dys])
            want = {
                "output": y, "residual_out": ro, "x": xd.grad[..., cols], "extra 0": rd.grad,
                "param 0.weight": wd.grad[:, cols], "param 4.weight": nd.grad,
            }  # fmt: skip
            for dtype in (torch.float32, torch.bfloat16):
                tol = TOL[dtype]
                algos = ("auto", "one_shot", "two_shot", "lamport", "nccl")
                for algo in algos if (H, lead) == (4096, (6,)) else ("auto",):
                    seq = _row_chain(H, dtype, algo, dev)
                    with torch.no_grad():
                        seq[0].weight.copy_(w_full[:, cols])
                        seq[4].weight.copy_(norm_w)
                    args = (x_full[..., cols].to(dev, dtype), [res.to(dev, dtype)])
                    d = [t.to(dev, dtype) for t in dys]
                    for mode in ("fused", "unfused", "reference"):
                        outs, grads, plan = _step(seq, mode, *args, d)
                        what = f"H={H} lead={lead} {dtype} algo={algo} {mode}"
                        if mode == "fused":
                            assert plan.fused("forward") == ["allreduce_add_rmsnorm"], str(plan)
                            assert plan.fused("backward") == ["allreduce_add_rmsnorm"], str(plan)
                            for o, name in zip(outs, ("output", "residual_out")):
                                assert _same_on_all_ranks(o), f"{what}: {name} differs by rank"
                        elif mode == "unfused":
                            assert plan.fused("forward") == plan.fused("backward") == []
                        _close(outs[0], want["output"], f"{what}: output", tol)
                        _close(outs[1], want["residual_out"], f"{what}: residual_out", tol)
                        for name in ("x", "extra 0", "param 0.weight", "param 4.weight"):
                            _close(grads[name], want[name], f"{what}: grad of {name}", tol)
                        n += 1
    _log(f"ok  row-parallel Linear + all-reduce + add + RMSNorm: {n} runs (fp32, bf16, 5 algos)")


def check_column_row_and_sequence_parallel(dev: torch.device) -> None:
    W, rank = dist.get_world_size(), dist.get_rank()
    H, F = 256, 512
    part = slice(rank * (F // W), (rank + 1) * (F // W))
    seq, (w1, b1, w2, b2), g = column_row_chain(H, F, rank, W, dev)
    x, dy = torch.randn(40, H, generator=g), torch.randn(40, H, generator=g)
    xd, w1d, b1d, w2d, b2d = (_leaf(t.double()) for t in (x, w1, b1, w2, b2))
    y = (xd @ w1d.t() + b1d) @ w2d.t() + b2d
    y.backward(dy.double())
    for mode in ("fused", "unfused", "reference"):
        outs, grads, _ = _step(seq, mode, x.to(dev), [], [dy.to(dev)])
        what, tol = f"column→row {mode}", TOL[torch.float32]
        _close(outs[0], y, f"{what}: output", tol)
        _close(grads["x"], xd.grad, f"{what}: dx", tol)
        _close(grads["param 0.weight"], w1d.grad[part], f"{what}: dW1", tol)
        _close(grads["param 0.bias"], b1d.grad[part], f"{what}: db1", tol)
        _close(grads["param 1.weight"], w2d.grad[:, part], f"{what}: dW2", tol)
        _close(grads["param 3.bias"], b2d.grad, f"{what}: db2", tol)

    T = 8 * W
    w, nw = torch.randn(H, H, generator=g) / H**0.5, 1 + 0.2 * torch.randn(H, generator=g)
    xs = [torch.randn(T, H, generator=g) for _ in range(W)]
    dys = [torch.randn(T, H, generator=g) for _ in range(W)]
    sp = mf.Sequential(
        mf.Linear(H, H, device=dev), mf.ReduceScatter(), mf.RMSNorm(H, device=dev),
        mf.AllGather(),
    )  # fmt: skip
    with torch.no_grad():
        sp[0].weight.copy_(w)
        sp[2].weight.copy_(nw)
    xds = [_leaf(t.double()) for t in xs]
    wd, nd = _leaf(w.double()), _leaf(nw.double())
    y = _rms(sum(t @ wd.t() for t in xds), nd)
    y.backward(sum(dys).double())
    for mode in ("fused", "unfused", "reference"):
        outs, grads, _ = _step(sp, mode, xs[rank].to(dev), [], [dys[rank].to(dev)])
        what, tol = f"sequence parallel {mode}", TOL[torch.float32]
        _close(outs[0], y, f"{what}: output", tol)
        _close(grads["x"], xds[rank].grad, f"{what}: dx", tol)
        for name, want in (("param 0.weight", wd.grad), ("param 2.weight", nd.grad)):
            total = grads[name].clone()
            dist.all_reduce(total)
            _close(total, want, f"{what}: all-reduced {name}", tol)
    _log("ok  column→row Linears and ReduceScatter → RMSNorm → AllGather over NCCL")


def _fused_step(seq, x, r, dy, dro):
    """Output, residual_out and the gradients of x, residual and both parameters."""
    y, ro = seq(x, r)
    grads = torch.autograd.grad([y, ro], [x, r, *seq.parameters()], [dy, dro])
    return (y, ro, *grads)


def check_cuda_graph_and_no_sync(dev: torch.device) -> None:
    W, rank = dist.get_world_size(), dist.get_rank()
    T, H, dt = 64, 4096, torch.bfloat16
    seq = _row_chain(H, dt, "auto", dev)
    g = torch.Generator(device=dev).manual_seed(rank)

    def fresh():
        return (
            torch.randn(T, H // W, device=dev, dtype=dt, generator=g),
            torch.randn(T, H, device=dev, dtype=dt, generator=g),
            torch.randn(T, H, device=dev, dtype=dt, generator=g),
            torch.randn(T, H, device=dev, dtype=dt, generator=g),
        )

    x, r, dy, dro = fresh()
    x.requires_grad_()
    r.requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, creates the pool, caches the plans
        for _ in range(3):
            _fused_step(seq, x, r, dy, dro)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        _fused_step(seq, x, r, dy, dro)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _log("ok  a warm fused forward + backward makes no host sync")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _fused_step(seq, x, r, dy, dro)
    for rep in range(20):
        with torch.no_grad():
            for t, new in zip((x, r, dy, dro), fresh()):
                t.copy_(new)
        graph.replay()
        want = _fused_step(seq, x, r, dy, dro)  # eager, same data
        for i, (a, b) in enumerate(zip(outs, want)):
            _close(a, b, f"graph replay {rep}: output {i} against eager", 1e-3)
    torch.cuda.synchronize()
    _log(
        "ok  the fused chain's forward + backward captured in a CUDA graph, 20 replays match eager"
    )


def main() -> None:
    info = init_distributed()
    if info.device.type != "cuda" or info.world_size < 2:
        raise SystemExit("needs >= 2 GPUs under torchrun")
    _log(f"world={info.world_size} torch={torch.__version__} device={torch.cuda.get_device_name()}")
    t0 = time.perf_counter()
    try:
        check_row_parallel_norm(info.device)
        check_column_row_and_sequence_parallel(info.device)
        check_cuda_graph_and_no_sync(info.device)
        torch.cuda.synchronize()
        dist.barrier()
        _log(f"ALL FUSION TP CHECKS PASSED ({time.perf_counter() - t0:.1f} s)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
