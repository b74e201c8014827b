"""MoELayer with expert parallelism (gloo, CPU, 2 and 4 processes) equals the single-process
layer holding every expert: outputs, input gradients, expert and router weight gradients;
dropless (host split sizes) and with a capacity limit (static sizes, drops per rank)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.nn import MoELayer
from tests._multiproc import finish_worker, run_gpu_check_under_torchrun

H, F, E, K, T = 16, 8, 8, 2, 11


def _worker(rank: int, world: int, port: int, capacity_factor) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)
        kw = dict(shared_expert_ffn_size=8, capacity_factor=capacity_factor)
        full = MoELayer(H, F, E, K, **kw)
        ep = MoELayer(H, F, E, K, ep_group=dist.group.WORLD, **kw)
        El = E // world
        state = full.state_dict()
        for name in ("experts.fc1_weight", "experts.fc2_weight"):
            state[name] = state[name][rank * El : (rank + 1) * El].clone()
        ep.load_state_dict(state)
        # every rank's tokens (and output gradients) differ; one rank may route nothing to
        # some rank's experts
        # (with a capacity limit every rank passes the same number of tokens)
        gen = torch.Generator().manual_seed(100)
        sizes = [T + (0 if capacity_factor else r) for r in range(world)]
        xs = [torch.randn(n, H, generator=gen) for n in sizes]
        gs = [torch.randn(n, H, generator=gen) for n in sizes]
        x = xs[rank].clone().requires_grad_()
        y = ep(x)
        y.backward(gs[rank])
        xa = torch.cat(xs).requires_grad_()
        if capacity_factor is None:
            ya = full(xa)
        else:  # drops are decided per rank: the full layer over each rank's tokens alone
            ya = torch.cat([full(part) for part in xa.split(sizes)])
        ya.backward(torch.cat(gs))
        lo = sum(t.shape[0] for t in xs[:rank])
        torch.testing.assert_close(y, ya[lo : lo + xs[rank].shape[0]], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, xa.grad[lo : lo + x.shape[0]], rtol=1e-4, atol=1e-5)
        for name in ("fc1_weight", "fc2_weight"):
            got = getattr(ep.experts, name).grad
            want = getattr(full.experts, name).grad[rank * El : (rank + 1) * El]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # replicated router: its gradient sums over ranks
        torch.testing.assert_close(router_grad, full.router.weight.grad, rtol=1e-4, atol=1e-5)
        if capacity_factor is not None:  # unequal token counts: every rank gets a clear error
            with pytest.raises(ValueError, match="same number of tokens on every rank"):
                ep(torch.randn(T + 1 + rank, H))
            # A count already checked on rank 0 meets new counts elsewhere: every rank takes
            # part in the same check (no hang); rank 0's is the device-side assert.
            n, err = (T, RuntimeError) if rank == 0 else (T + 5, ValueError)
            with pytest.raises(err, match=r"token counts differ|same number of tokens"):
                ep(torch.randn(n, H))
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world, capacity_factor):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, capacity_factor), nprocs=world, join=True)


def test_expert_parallel_configuration_errors():
    class FakeGroup:
        def size(self):
            return 3

    with pytest.raises(ValueError, match="divisible by the ep_group size 3"):
        MoELayer(H, F, E, K, ep_group=FakeGroup())
    with pytest.raises(ValueError, match="align is not supported with ep_group"):
        MoELayer(H, F, E, K, ep_group=type("G", (), {"size": lambda self: 2})(), align=8)


@pytest.mark.gpu
@pytest.mark.dist
def test_gpu_expert_parallel_check_torchrun():
    """tests/distributed/gpu_moe_ep_check.py on every local GPU (2+)."""
    run_gpu_check_under_torchrun("gpu_moe_ep_check.py", "ALL EP CHECKS PASSED")
