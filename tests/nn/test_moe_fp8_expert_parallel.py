"""MoELayer(fp8=) with expert parallelism: the tokens travel as e4m3 rows and scales
(``ExpertExchange.dispatch_fp8``) and the layer equals the single-process FP8 layer holding every
expert: outputs, input gradients, router and fc2 weight gradients to fp32 rounding; fc1's weight
gradient within one more rounding (its rows quantized along the tokens again from the received
e4m3 rows, where the single process quantizes them from the tokens). On CPU with gloo, 2 ranks:
the all-to-all exchange; under ``TRITON_INTERPRET=1`` also the symmetric exchange, its kernels in
the interpreter over file-backed shared buffers."""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit import Fp8Recipe
from moekit.distributed import set_pool
from moekit.kernels.exchange import exchange_layout
from moekit.nn import DispatchConfig, ExpertParallelConfig, MoELayer
from moekit.ops.expert_exchange import pool_use
from tests._multiproc import finish_worker, load_local_experts, steps_ep_and_full
from tests._shared_pool import SharedFilePool, make_files

H, F, E, K, T = 32, 32, 4, 2, 11
MAX_T = T + 9


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _worker(rank, world, port, capacity_factor, paths=None) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    warnings.simplefilter("ignore")  # F = 32 runs the MLP's composition, which says so
    try:
        torch.manual_seed(0)
        kw = dict(fp8=Fp8Recipe(), dispatch=DispatchConfig(capacity_factor))
        full = MoELayer(H, F, E, K, **kw)
        cfg = ExpertParallelConfig(backend="all_to_all")
        if paths is not None:
            nbytes = exchange_layout(world, MAX_T, H, 4, K).nbytes
            set_pool(SharedFilePool(dist.group.WORLD, paths, nbytes), use=pool_use(0))
            cfg = ExpertParallelConfig(backend="symmetric", max_tokens=MAX_T)
        ep = MoELayer(H, F, E, K, ep_group=dist.group.WORLD, ep_config=cfg, **kw)
        El = E // world
        load_local_experts(full, ep, rank, world)
        y, x, ya, xa_grad = steps_ep_and_full(ep, full, rank, world, T, capacity_factor)
        assert _rel(y, ya) < 1e-5 and _rel(x.grad, xa_grad) < 1e-5
        experts = slice(rank * El, (rank + 1) * El)
        # e4m3 rounds to 3 mantissa bits: a second rounding moves each operand by < 2^-4. So
        # does another grouping into 128-token blocks: with capacity drops the reference runs
        # each rank's tokens alone, its weight gradients' blocks then holding other tokens.
        same_blocks = 1e-5 if capacity_factor is None else 0.08
        assert _rel(ep.experts.fc2_weight.grad, full.experts.fc2_weight.grad[experts]) < same_blocks
        assert _rel(ep.experts.fc1_weight.grad, full.experts.fc1_weight.grad[experts]) < 0.08
        router_grad = ep.router.weight.grad.clone()
        dist.all_reduce(router_grad)
        assert _rel(router_grad, full.router.weight.grad) < 1e-4
        assert ep.ep.last_exchanges[0].backend == ("symmetric" if paths else "all_to_all")
        finish_worker()
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity"])
def test_fp8_expert_parallel_equals_single_process(capacity_factor):
    mp.spawn(_worker, args=(2, _port(), capacity_factor), nprocs=2, join=True)


@pytest.mark.dist
def test_fp8_symmetric_exchange_in_interpreter(interpret):
    if not interpret:
        pytest.skip("runs the exchange kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    world = 2
    with tempfile.TemporaryDirectory() as d:
        paths = make_files(d, world, exchange_layout(world, MAX_T, H, 4, K).nbytes)
        mp.spawn(_worker, args=(world, _port(), None, paths), nprocs=world, join=True)
    assert not os.path.exists(d)
