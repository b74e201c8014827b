"""MoELayer with expert parallelism equals the single-process layer holding every expert:
outputs, input gradients, expert and router weight gradients; dropless and with a capacity limit
(drops per rank), with and without per-expert alignment; ranks pass different token counts.

On CPU with gloo, 2 and 4 processes: the all-to-all exchange; under ``TRITON_INTERPRET=1`` also
the symmetric exchange, its kernels in the interpreter over file-backed shared buffers
(``tests/_shared_pool.py``), for several calls in a row."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.distributed import set_pool
from moekit.kernels.exchange import exchange_layout
from moekit.nn import DispatchConfig, ExpertParallelConfig, MoELayer
from moekit.ops.expert_exchange import pool_use
from tests._multiproc import (
    finish_worker,
    load_local_experts,
    run_gpu_check_under_torchrun,
    steps_ep_and_full,
)
from tests._shared_pool import SharedFilePool, make_files

H, F, E, K, T = 16, 8, 8, 2, 11


MAX_T = T + 9 * 3  # the most tokens a rank passes (the symmetric exchange's bound)


def _worker(rank, world, port, capacity_factor, align, chunks=None, paths=None) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.manual_seed(0)
        kw = dict(shared_expert_ffn_size=8, dispatch=DispatchConfig(capacity_factor, align))
        full = MoELayer(H, F, E, K, **kw)
        cfg = ExpertParallelConfig(chunks=chunks)
        if paths is not None:  # a pool per channel (chunk), each large enough for all tokens
            nbytes = exchange_layout(world, MAX_T, H, 4, K).nbytes
            for channel, files in enumerate(paths):
                set_pool(SharedFilePool(dist.group.WORLD, files, nbytes), use=pool_use(channel))
            cfg = ExpertParallelConfig(backend="symmetric", max_tokens=MAX_T, chunks=chunks)
        ep = MoELayer(H, F, E, K, ep_group=dist.group.WORLD, ep_config=cfg, **kw)
        El = E // world
        load_local_experts(full, ep, rank, world)
        # every rank's tokens (and output gradients) and token counts differ; one rank may
        # route nothing to some rank's experts
        y, x, ya, xa_grad = steps_ep_and_full(ep, full, rank, world, T, capacity_factor)
        torch.testing.assert_close(y, ya, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, xa_grad, rtol=1e-4, atol=1e-5)
        for name in ("fc1_weight", "fc2_weight"):
            got = getattr(ep.experts, name).grad
            want = getattr(full.experts, name).grad[rank * El : (rank + 1) * El]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad)  # replicated router: its gradient sums over ranks
        torch.testing.assert_close(router_grad, full.router.weight.grad, rtol=1e-4, atol=1e-5)
        if paths is not None:
            assert [ex.backend for ex in ep.ep.last_exchanges] == ["symmetric"] * (chunks or 1)
            # more calls in a row, other token counts (with chunks: chunks without tokens):
            # the barriers' epochs stay in step
            for n in (1, MAX_T, 3 + rank):
                xr = torch.randn(n, H, requires_grad=True)
                ep(xr).sum().backward()
                assert torch.isfinite(xr.grad).all()
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize(
    "world, capacity_factor, align, chunks",
    [(2, None, None, None), (2, 0.75, None, 2), (2, None, 8, None), (4, None, None, 3),
     (4, 0.75, None, None)],
    ids=["2-dropless", "2-capacity-2chunks", "2-aligned", "4-dropless-3chunks", "4-capacity"],
)  # fmt: skip
def test_expert_parallel_equals_single_process(world, capacity_factor, align, chunks):
    """Chunked calls (each chunk exchanged on its own) give the unchunked results too."""
    args = (world, _port(), capacity_factor, align, chunks)
    mp.spawn(_worker, args=args, nprocs=world, join=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.parametrize(
    "capacity_factor, align, chunks",
    [(0.75, 8, None), (None, None, 3)],  # one chunk, capacity; dropless in three chunks
    ids=["capacity-aligned", "dropless-3chunks"],
)
def test_symmetric_exchange_layer_in_interpreter(capacity_factor, align, chunks, interpret):
    if not interpret:
        pytest.skip("runs the exchange kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    world = 2
    with tempfile.TemporaryDirectory() as d:
        nbytes = exchange_layout(world, MAX_T, H, 4, K).nbytes
        paths = []
        for channel in range(chunks or 1):
            os.mkdir(os.path.join(d, str(channel)))
            paths.append(make_files(os.path.join(d, str(channel)), world, nbytes))
        args = (world, _port(), capacity_factor, align, chunks, paths)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    assert not os.path.exists(d)


def test_expert_parallel_configuration_errors():
    class FakeGroup:
        def size(self):
            return 3

    with pytest.raises(ValueError, match="divisible by the ep_group size 3"):
        MoELayer(H, F, E, K, ep_group=FakeGroup())
    with pytest.raises(ValueError, match="ep_config needs ep_group"):
        MoELayer(H, F, E, K, ep_config=ExpertParallelConfig())
    with pytest.raises(TypeError, match="ep_config must be an ExpertParallelConfig"):
        MoELayer(H, F, E, K, ep_group=type("G", (), {"size": lambda self: 2})(), ep_config={})
    with pytest.raises(ValueError, match="backend must be one of"):
        ExpertParallelConfig(backend="nvshmem")
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        ExpertParallelConfig(max_tokens=0)
    with pytest.raises(ValueError, match="rows_factor must be a finite float"):
        ExpertParallelConfig(rows_factor=-1.0)
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        ExpertParallelConfig(chunks=0)


@pytest.mark.gpu
@pytest.mark.dist
def test_gpu_expert_parallel_check_torchrun():
    """tests/distributed/gpu_moe_ep_check.py on every local GPU (2+)."""
    run_gpu_check_under_torchrun("gpu_moe_ep_check.py", "ALL EP CHECKS PASSED")
