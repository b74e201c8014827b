"""MoELayer and a moekit.fusion chain under data parallelism (FSDP2's ``fully_shard`` and DDP;
gloo, CPU, 2 processes): optimizer steps on each rank's own tokens give the parameters of the
plain module trained on the mean of the ranks' losses, and under FSDP2 the output carries its
hooks (no view-output warning). The chain also under autocast (its per-call parameter casts
must be made from the parameters FSDP2 registers for the call)."""

from __future__ import annotations

import contextlib
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moekit.fusion as mf
from moekit.nn import MoELayer
from moekit.ops import RouterConfig
from tests._multiproc import finish_worker

H, F, E, K, B, S, STEPS = 16, 8, 8, 2, 2, 7, 3


def _build(kind: str) -> torch.nn.Module:
    if kind == "moe":
        kw = dict(
            router=RouterConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01), shared_expert_ffn_size=8
        )
        return MoELayer(H, F, E, K, **kw)
    return mf.Sequential(mf.Linear(H, H, bias=True), mf.Bias(H), mf.LayerNorm(H), mf.RMSNorm(H))


def _worker(rank: int, world: int, port: int, wrapper: str, kind: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        ref = _build(kind.removesuffix("_autocast"))
        model = _build(kind.removesuffix("_autocast"))
        model.load_state_dict(ref.state_dict())
        autocast = kind.endswith("_autocast")

        def region():
            if not autocast:
                return contextlib.nullcontext()
            return torch.autocast("cpu", dtype=torch.bfloat16)

        if wrapper == "fsdp2":
            fully_shard(model)
            wrapped = model
        else:
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        # Both average gradients over ranks, the router's losses' included: the reference
        # takes the mean of the ranks' losses and gives the losses' gradient that 1/W too.
        if kind == "moe":
            ref.aux_loss_grad_scale = 1.0 / world
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randn(STEPS, world, B, S, H, generator=gen) for _ in range(2)]
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for step in range(STEPS):
            x, g = xs[0][step], xs[1][step]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with region():
                    y = wrapped(x[rank])
            fsdp_warnings = [str(w.message) for w in caught if "FSDP" in str(w.message)]
            assert not fsdp_warnings, fsdp_warnings  # e.g. "returned a view tensor"
            y.backward(g[rank].to(y.dtype))
            opt.step()
            opt.zero_grad()
            for r in range(world):
                with region():
                    y_ref = ref(x[r])
                (y_ref.float() * g[r].to(y_ref.dtype).float()).sum().div(world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        state = model.state_dict()
        for name, want in ref.state_dict().items():
            got = state[name]
            got = got.full_tensor() if hasattr(got, "full_tensor") else got
            tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got, want, **tol, msg=name)
            if STEPS:  # trained: the parameters moved from their start
                assert not torch.equal(got, _build_state(kind)[name]), name
        finish_worker()
    finally:
        dist.destroy_process_group()


def _build_state(kind: str) -> dict:
    torch.manual_seed(0)
    return _build(kind.removesuffix("_autocast")).state_dict()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("wrapper", "kind"),
    [("fsdp2", "moe"), ("ddp", "moe"), ("fsdp2", "fusion"), ("ddp", "fusion"),
     ("fsdp2", "fusion_autocast")],
)  # fmt: skip
def test_data_parallel_training_equals_the_plain_module(wrapper, kind):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, wrapper, kind), nprocs=2, join=True)
