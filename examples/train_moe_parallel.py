"""Data and expert parallelism for the training example, on PyTorch's own parallelism.

W processes (torchrun) form a ``DeviceMesh`` of shape (dp, ep) = (W / N, N) for ``--ep N``:
each MoE layer's experts are split over the ``ep`` dimension (``MoELayer(ep_group=...)``), each
rank trains on 1/W of every batch, and the replicated weights (attention, norms, router,
embedding) are sharded over all W ranks by FSDP2 (``fully_shard``), which also averages their
gradients. Expert weights are each rank's own; their gradients already hold every token of the
ep group (the exchange brings them), so they are averaged like the rest: summed over ``dp`` and
divided by W. Checkpoints go through ``torch.distributed.checkpoint`` with the expert weights
(and their optimizer state) as DTensors sharded over ``ep``, so a run saved at one EP size
reloads at another. A single process (no torchrun) is the group of one: no mesh, plain tensors.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

EXPERT_WEIGHTS = ("experts.fc1_weight", "experts.fc2_weight")


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_WEIGHTS)


class Parallel:
    """The process layout of a run: ``size`` ranks, ``ep`` of them per expert group."""

    def __init__(self, ep: int, device: str) -> None:
        self.size, self.rank, self.ep = int(os.environ.get("WORLD_SIZE", "1")), 0, ep
        self.mesh = self.ep_group = None
        if self.size == 1:
            if ep > 1:
                raise SystemExit(f"--ep {ep} needs torchrun with a multiple of {ep} processes")
            return
        if self.size % ep:
            raise SystemExit(f"--ep {ep} must divide the number of processes ({self.size})")
        from torch.distributed.device_mesh import init_device_mesh

        from moekit.distributed import init_distributed

        init_distributed()
        self.rank = dist.get_rank()
        kind = "cuda" if device == "cuda" else "cpu"
        self.mesh = init_device_mesh(kind, (self.size // ep, ep), mesh_dim_names=("dp", "ep"))
        self.world = init_device_mesh(kind, (self.size,), mesh_dim_names=("world",))
        self.ep_group = self.mesh["ep"].get_group() if ep > 1 else None
        self.dp_group = self.mesh["dp"].get_group()

    @property
    def ep_rank(self) -> int:
        return self.mesh["ep"].get_local_rank() if self.mesh is not None else 0

    def shard_model(self, model: nn.Module) -> nn.Module:
        """FSDP2 over all ranks for every weight but the experts."""
        if self.size == 1:
            return model
        from torch.distributed.fsdp import fully_shard

        experts = {p for n, p in model.named_parameters() if is_expert(n)}
        return fully_shard(model, mesh=self.world, ignored_params=experts)

    def local_experts(self, state: dict, num_experts: int) -> dict:
        """A full model's state with each expert weight cut to this rank's share."""
        n = num_experts // self.ep
        lo = self.ep_rank * n
        return {k: (v[lo : lo + n].clone() if is_expert(k) else v) for k, v in state.items()}

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        n = x.shape[0] // self.size
        return x[self.rank * n : (self.rank + 1) * n], y[self.rank * n : (self.rank + 1) * n]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t = t.detach().clone()
            dist.all_reduce(t)
            t /= self.size
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t = t.detach().clone()
            dist.all_reduce(t)
        return t

    def finish_grads_and_clip(self, model: nn.Module, max_norm: float) -> None:
        """Average the expert gradients (FSDP2 did the rest), then clip by the global norm."""
        if self.size == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return
        expert_sq = shared_sq = None
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if is_expert(name):
                if self.size > self.ep:
                    dist.all_reduce(p.grad, group=self.dp_group)
                p.grad /= self.size
                sq = p.grad.float().square().sum()
                expert_sq = sq if expert_sq is None else expert_sq + sq
            else:  # a DTensor shard: the squares of this rank's part
                sq = p.grad.to_local().float().square().sum()
                shared_sq = sq if shared_sq is None else shared_sq + sq
        zero = torch.zeros((), device=next(model.parameters()).device)
        expert_sq = zero if expert_sq is None else expert_sq
        shared_sq = zero if shared_sq is None else shared_sq
        if self.ep > 1:
            dist.all_reduce(expert_sq, group=self.ep_group)  # each ep rank holds other experts
        dist.all_reduce(shared_sq)  # FSDP2 shards are disjoint over all ranks
        scale = (max_norm / ((expert_sq + shared_sq).sqrt() + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))

    # -- checkpoints ---------------------------------------------------------------------------

    def _wrapped(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        """The expert entries as DTensors sharded over ``ep`` (replicated over ``dp``)."""
        if self.size == 1:
            return model_sd, optim_sd
        from torch.distributed.tensor import DTensor, Replicate, Shard

        def wrap(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t, self.mesh, [Replicate(), Shard(0)], run_check=False)

        model_sd = {k: wrap(v) if is_expert(k) else v for k, v in model_sd.items()}
        state = {}
        for k, s in optim_sd["state"].items():
            if is_expert(k):
                s = {n: wrap(v) if n != "step" else v for n, v in s.items()}
            state[k] = s
        return model_sd, {**optim_sd, "state": state}

    def save(self, path: str, model, opt, sched, extra: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = self._wrapped(*get_state_dict(model, opt))
        state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict(), **extra}
        with _quiet_checkpoint():  # --stop-after then --resume saves over the same folder
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True))

    def load(self, path: str, model, opt, sched, extra: dict) -> dict:
        """Load a checkpoint saved at any EP size into this run's layout; ``extra`` names the
        other entries with a template value each. Returns those entries."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        _init_optimizer_state(opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        wrapped_model, wrapped_optim = self._wrapped(model_sd, optim_sd)
        state = {"model": wrapped_model, "optim": wrapped_optim, "sched": sched.state_dict(),
                 **extra}  # fmt: skip
        with _quiet_checkpoint():
            dcp.load(state, checkpoint_id=path)  # into the (wrapped) tensors, in place
        set_state_dict(
            model, opt, model_state_dict=model_sd,
            optim_state_dict={**optim_sd, "param_groups": state["optim"]["param_groups"]},
        )  # fmt: skip
        sched.load_state_dict(state["sched"])
        return {k: state[k] for k in extra}


@contextlib.contextmanager
def _quiet_checkpoint():
    """torch.distributed.checkpoint warns that it saves in a single process without torchrun,
    and that it replaces the folder's checkpoint when told to: both are the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        yield


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (a step with zero gradients and no learning
    rate, which changes no weight), so that a checkpoint has tensors to load into."""
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, saved):
        g["lr"] = lr
