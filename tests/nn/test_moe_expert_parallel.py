"""MoELayer with expert parallelism (gloo, CPU, 2 and 4 processes) equals the single-process
layer holding every expert: outputs, input gradients, expert and router weight gradients."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.nn import MoELayer
from tests._multiproc import finish_worker

H, F, E, K, T = 16, 8, 8, 2, 11


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)
        full = MoELayer(H, F, E, K, shared_ffn_hidden_size=8)
        ep = MoELayer(H, F, E, K, shared_ffn_hidden_size=8, ep_group=dist.group.WORLD)
        El = E // world
        state = full.state_dict()
        for name in ("experts.fc1_weight", "experts.fc2_weight"):
            state[name] = state[name][rank * El : (rank + 1) * El].clone()
        ep.load_state_dict(state)
        # every rank's tokens (and output gradients) differ; one rank may route nothing to
        # some rank's experts
        gen = torch.Generator().manual_seed(100)
        xs = [torch.randn(T + r, H, generator=gen) for r in range(world)]
        gs = [torch.randn(T + r, H, generator=gen) for r in range(world)]
        x = xs[rank].clone().requires_grad_()
        y = ep(x)
        y.backward(gs[rank])
        xa = torch.cat(xs).requires_grad_()
        ya = full(xa)
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
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_single_process(world):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port), nprocs=world, join=True)


def test_expert_parallel_configuration_errors():
    class FakeGroup:
        def size(self):
            return 3

    with pytest.raises(ValueError, match="divisible by the ep_group size 3"):
        MoELayer(H, F, E, K, ep_group=FakeGroup())
    with pytest.raises(ValueError, match="not supported with ep_group"):
        MoELayer(H, F, E, K, ep_group=type("G", (), {"size": lambda self: 2})(), align=8)
