"""RowParallelLinear (+ fused RMSNorm) on two gloo ranks vs the unsharded layer."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._multiproc import finish_worker

WORLD = 2


def _worker(rank: int, store: str) -> None:
    from moekit.nn.rmsnorm import RMSNorm
    from moekit.nn.row_parallel_linear import RowParallelLinear
    from moekit.reference.rmsnorm import add_rmsnorm_ref

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        T, IN, OUT = 5, 12, 16
        g = torch.Generator().manual_seed(0)  # same full tensors on every rank
        full_w = torch.randn(OUT, IN, generator=g)
        x = torch.randn(2, T, IN, generator=g)  # batch dim: [B, T, in]
        residual = torch.randn(2, T, OUT, generator=g)
        norm_w = 1 + 0.1 * torch.randn(OUT, generator=g)
        dn, dro = torch.randn(2, T, OUT, generator=g), torch.randn(2, T, OUT, generator=g)

        norm = RMSNorm(OUT, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(norm_w)
        layer = RowParallelLinear(IN, OUT, norm=norm, algo="nccl")
        layer.load_full_weight(full_w)
        lo = rank * IN // WORLD
        x_local = x[..., lo : lo + IN // WORLD].clone().requires_grad_()
        res = residual.clone().requires_grad_()
        n, ro = layer(x_local, res)
        (n * dn + ro * dro).sum().backward()

        # unsharded oracle
        xf = x.clone().requires_grad_()
        wf = full_w.clone().requires_grad_()
        rf = residual.clone().requires_grad_()
        nw = norm_w.clone().requires_grad_()
        n2, ro2, _ = add_rmsnorm_ref(xf @ wf.t(), rf, nw, 1e-6)
        (n2 * dn + ro2 * dro).sum().backward()
        tol = dict(atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(n, n2, **tol)
        torch.testing.assert_close(ro, ro2, **tol)
        torch.testing.assert_close(x_local.grad, xf.grad[..., lo : lo + IN // WORLD], **tol)
        torch.testing.assert_close(layer.weight.grad, wf.grad[:, lo : lo + IN // WORLD], **tol)
        torch.testing.assert_close(res.grad, rf.grad, **tol)
        torch.testing.assert_close(norm.weight.grad, nw.grad, **tol)

        # without residual / without norm
        plain = RowParallelLinear(IN, OUT, algo="reference")
        plain.load_full_weight(full_w)
        torch.testing.assert_close(plain(x_local.detach()), x @ full_w.t(), **tol)
        torch.testing.assert_close(plain(x_local.detach(), residual), x @ full_w.t() + residual,
                                   **tol)  # fmt: skip
        with pytest.raises(ValueError, match="divisible by the group size"):
            RowParallelLinear(IN + 1, OUT)
        with pytest.raises(ValueError, match=r"x\.shape"):
            plain(x)
        with pytest.raises(ValueError, match=r"norm\.hidden_size"):
            RowParallelLinear(IN, OUT, norm=RMSNorm(OUT + 1))

        # initialisation: nn.Linear's for the full weight, this rank's columns of it (ranks
        # seeded alike hold different slices, within the full fan-in's bound)
        torch.manual_seed(1)
        big = RowParallelLinear(4096, 64)
        assert big.weight.abs().max() <= 4096**-0.5
        shards = [torch.empty_like(big.weight) for _ in range(WORLD)]
        dist.all_gather(shards, big.weight.detach().contiguous())
        assert not torch.equal(shards[0], shards[1])
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_row_parallel_linear_matches_unsharded():
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(os.path.join(d, "store"),), nprocs=WORLD, join=True)


def test_construction_errors_and_single_process_without_distributed():
    from moekit.nn.rmsnorm import RMSNorm
    from moekit.nn.row_parallel_linear import RowParallelLinear
    from moekit.reference.rmsnorm import add_rmsnorm_ref

    for kw, exc, match in (
        (dict(in_features=0, out_features=4), ValueError, "in_features must be a positive int"),
        (dict(in_features=4, out_features=4.0), ValueError, "out_features must be a positive"),
        (dict(in_features=4, out_features=4, algo="foo"), ValueError, "algo must be one of"),
        (dict(in_features=4, out_features=4, group="x"), TypeError, "group must be a"),
    ):
        with pytest.raises(exc, match=match):
            RowParallelLinear(**kw)
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    # built and called without torch.distributed: one rank, the all-reduce is the identity
    torch.manual_seed(0)
    norm = RMSNorm(8)
    layer = RowParallelLinear(6, 8, norm=norm)
    x, r = torch.randn(3, 6), torch.randn(3, 8)
    n, ro = layer(x, r)
    n2, ro2, _ = add_rmsnorm_ref(x @ layer.weight.t(), r, norm.weight, norm.eps)
    torch.testing.assert_close(n, n2)
    torch.testing.assert_close(ro, ro2)
    plain = RowParallelLinear(6, 8)
    torch.testing.assert_close(plain(x), x @ plain.weight.t())
    torch.testing.assert_close(plain(x, r), x @ plain.weight.t() + r)
