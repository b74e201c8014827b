"""Megatron-Core's expert parallelism driving moekit's experts, under torchrun (one process per
GPU; any world size that divides the 8 experts):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node=2 tests/integrations/gpu_megatron_ep_check.py

The tiny GPT-MoE of the GPU tests (2 layers, 8 experts, top-2, fp32, the alltoall dispatcher)
at expert parallelism = the world size (data parallel over the same ranks) against the same
model at EP 1 on every rank, from the same weights, each rank on its own batch:

1. logits and loss equal (fp32 tolerance);
2. every dense parameter's gradient equal to the EP 1 run's on the rank's batch;
3. each local expert's gradients equal to the EP 1 runs' summed over the ranks (an expert sees
   every rank's tokens);
4. the same model with SequentialMLP at the same EP equal to moekit's (the check's check).

A failure raises (torchrun exits non-zero); rank 0 prints one ``ok`` line per check.
"""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import megatron_gpt as mgpt  # noqa: E402

VOCAB, SEQ, BATCH, TOL = 128, 64, 4, 5e-3
_LOCAL = re.compile(r"^(?P<head>.*local_experts\.)(?P<i>\d+)(?P<tail>\..*)$")
_GROUPED = re.compile(r"^(?P<head>.*linear_fc[12]\.(weight|bias))(?P<i>\d+)$")


def shard(state: dict, first: int, count: int) -> dict:
    """A SequentialMLP state dict of every expert cut to experts [first, first + count),
    renumbered from 0 (what an expert-parallel rank holds)."""
    out = {}
    for key, value in state.items():
        m = _LOCAL.match(key)
        if m is None:
            out[key] = value
        elif first <= int(m["i"]) < first + count:
            out[f"{m['head']}{int(m['i']) - first}{m['tail']}"] = value
    return out


def step(model, data, first: int = 0) -> tuple:
    """``megatron_gpt.train_step``, the experts' gradients keyed by global expert number
    (local + ``first``)."""
    logits, loss, grads = mgpt.train_step(model, data)
    out = {}
    for key, g in grads.items():
        m = _GROUPED.match(key)
        out[f"{m['head']}{int(m['i']) + first}" if m else key] = g
    return logits, loss, out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, errors: dict) -> None:
    worst = max(errors.values())
    bad = {k: v for k, v in errors.items() if v > TOL}
    assert not bad, f"{name}: {len(bad)} over {TOL}: {sorted(bad.items())[:4]}"
    if dist.get_rank() == 0:
        print(f"ok {name}: {len(errors)} tensors, worst relative error {worst:.2e}", flush=True)


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    mgpt.set_expert_parallel(1)
    cfg1 = mgpt.gpt_config("tiny", 2, torch.float32)
    state = mgpt.build_gpt(cfg1, "sequential", VOCAB, SEQ).state_dict()
    for value in state.values():  # rank 0's weights everywhere
        if isinstance(value, torch.Tensor):
            dist.broadcast(value, 0)
    data = mgpt.batch(cfg1, VOCAB, BATCH, SEQ, seed=rank)
    want = step(mgpt.build_gpt(cfg1, "moekit", VOCAB, SEQ, state), data)
    experts = [k for k in want[2] if _GROUPED.match(k) and ".experts." in k]
    for k in experts:  # an expert's gradient at EP > 1 gathers every rank's tokens
        dist.all_reduce(want[2][k])

    mgpt.set_expert_parallel(world)
    cfg = mgpt.gpt_config("tiny", 2, torch.float32, ep=world)
    local = cfg.num_moe_experts // world
    first = rank * local
    mine = shard(state, first, local)
    got = step(mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ, mine), data, first)
    check(f"EP {world} logits and loss", {"logits": rel(got[0], want[0]),
                                          "loss": rel(got[1], want[1])})  # fmt: skip
    dense = [k for k in got[2] if k not in experts]
    check(f"EP {world} dense gradients", {k: rel(got[2][k], want[2][k]) for k in dense})
    held = [k for k in got[2] if k in experts]
    assert len(held) == len(experts) // world, (len(held), len(experts))
    check(f"EP {world} expert gradients", {k: rel(got[2][k], want[2][k]) for k in held})
    seq = step(mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ, mine), data, first)
    errors = {"logits": rel(got[0], seq[0]), "loss": rel(got[1], seq[1])}
    errors.update({k: rel(got[2][k], seq[2][k]) for k in got[2]})
    check(f"EP {world} moekit against SequentialMLP", errors)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
