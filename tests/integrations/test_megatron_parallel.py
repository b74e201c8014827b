"""moekit's Megatron-Core experts under Megatron's expert parallelism and expert tensor
parallelism (2 gloo ranks, CPU), against ``SequentialMLP`` built by the same Megatron parallel
state: each rank's outputs and gradients; under expert tensor parallelism the ranks' partial
outputs summed equal the unsplit experts' output (what Megatron's dispatcher reduces), so
moekit reads each rank's fc1 shard as Megatron splits it; and each rank's sharded state dict
equals SequentialMLP's, tensor by tensor."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests._multiproc import finish_worker

pytestmark = pytest.mark.dist
pytest.importorskip("megatron.core")
pytest.importorskip("moekit.integrations.megatron")

WORLD, E, H, FFN = 2, 4, 32, 48
COUNTS = [5, 0, 7, 3]  # rows per local expert


def _config(ep: int, etp: int, bias: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
        moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=bias, use_cpu_initialization=True,
        moe_router_topk=2, params_dtype=torch.float32, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )  # fmt: skip


def _gather_fc1(w: torch.Tensor) -> torch.Tensor:
    """The unsplit [E, 2F, H] fc1 from the ranks' [E, 2F/tp, H] shards, each [gate | up]."""
    parts = [torch.empty_like(w) for _ in range(WORLD)]
    dist.all_gather(parts, w.contiguous())
    gates = torch.cat([p.chunk(2, dim=1)[0] for p in parts], dim=1)
    ups = torch.cat([p.chunk(2, dim=1)[1] for p in parts], dim=1)
    return torch.cat([gates, ups], dim=1)


def _gather_fc2(w: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(w) for _ in range(WORLD)]
    dist.all_gather(parts, w.contiguous())
    return torch.cat(parts, dim=2)


def _unsplit(x, counts, probs, w1, w2):
    out = []
    for e, (xe, pe) in enumerate(zip(x.split(counts), probs.split(counts))):
        g, u = (xe @ w1[e].t()).chunk(2, dim=-1)
        out.append((F.silu(g) * u * pe[:, None]) @ w2[e].t())
    return torch.cat(out)


def _sharded(module) -> dict:
    """{(key, global offset): (global shape, replica id, data)} of the module's sharded
    tensors, factories built (objects: key and type)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = module.sharded_state_dict(prefix="decoder.layers.0.mlp.experts.")
    apply_factories(sharded)
    out = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            out[sh.key, sh.global_offset] = (sh.global_shape, sh.replica_id, sh.data.tolist())
        else:
            out[sh.key, type(sh).__name__] = sh.replica_id
    return out


def _check(rank: int, ep: int, etp: int, bias: bool) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    import moekit.integrations.megatron as mg

    parallel_state.initialize_model_parallel(
        1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    try:
        cfg, pg = _config(ep, etp, bias), get_default_pg_collection()
        local = E // ep
        torch.manual_seed(0)  # the same master weights on both ranks (CPU initialisation)
        seq = SequentialMLP(local, cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                            linear_fc2=RowParallelLinear), pg_collection=pg)  # fmt: skip
        torch.manual_seed(0)
        ours = mg.MoekitExperts(local, cfg, pg_collection=pg)
        # the same shards of the same master weights as Megatron's CPU initialisation
        want = mg.sequential_to_grouped(seq.state_dict())
        assert all(torch.equal(v, want[k]) for k, v in ours.state_dict().items())
        assert all(p.allreduce == (ep == 1) for p in ours.parameters())
        assert _sharded(ours) == _sharded(seq)
        if bias:
            return  # SequentialMLP's expert bias cannot run a backward here (test_megatron.py)
        counts = COUNTS[:local]
        g = torch.Generator().manual_seed(1 + rank * (etp == 1))
        x = torch.randn(sum(counts), H, generator=g)
        probs = torch.rand(sum(counts), generator=g)
        results = []
        for module in (seq, ours):
            xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
            y, _ = module(xi, torch.tensor(counts), pi)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            results.append((y.detach(), xi.grad, pi.grad))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        if etp > 1:
            total = results[1][0].clone()
            dist.all_reduce(total)
            w1, w2 = _gather_fc1(ours.fc1_weight.detach()), _gather_fc2(ours.fc2_weight.detach())
            want = _unsplit(x, counts, probs, w1, w2)
            torch.testing.assert_close(total, want, rtol=1e-4, atol=1e-5)
    finally:
        parallel_state.destroy_model_parallel()


def _worker(rank: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    for ep, etp, bias in ((1, 2, False), (2, 1, False), (2, 1, True)):  # no bias at ETP > 1
        _check(rank, ep, etp, bias)  # (Megatron allows expert biases only at ETP 1)
    finish_worker()


def test_expert_and_expert_tensor_parallel_match_sequential():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port,), nprocs=WORLD, join=True)
