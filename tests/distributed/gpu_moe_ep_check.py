"""GPU checks of MoELayer's expert parallelism, under torchrun (one process per GPU).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node=2 tests/distributed/gpu_moe_ep_check.py

Checks (every rank; a failure raises):
1. the EP layer (dropless, and with a capacity limit) equals the single-GPU layer holding every
   expert: outputs, input gradients, expert and (summed) router weight gradients, bf16;
2. 1000 steps with uneven routing — token counts differing per rank, and every few steps a
   routing that sends all tokens to rank 0's experts (the other ranks receive none) — keep
   every rank in step (a step counter all-reduced at the end, no hang);
3. the capacity mode runs without a host sync (``set_sync_debug_mode("error")``) and a step
   captured in a CUDA graph replays with new data like an eager step.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moekit.nn import MoELayer
from tests._cuda_step import sync_free_capture

H, F, E, K = 1024, 512, 16, 4
DT = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def layers(rank: int, W: int, group, capacity_factor=None):
    torch.manual_seed(0)
    kw = dict(shared_expert_ffn_size=256, capacity_factor=capacity_factor, device="cuda", dtype=DT)
    full = MoELayer(H, F, E, K, **kw)
    ep = MoELayer(H, F, E, K, ep_group=group, **kw)
    El = E // W
    state = full.state_dict()
    for name in ("experts.fc1_weight", "experts.fc2_weight"):
        state[name] = state[name][rank * El : (rank + 1) * El].clone()
    ep.load_state_dict(state)
    return full, ep


def check_equals_single_gpu(rank: int, W: int, group, capacity_factor) -> None:
    full, ep = layers(rank, W, group, capacity_factor)
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes = [512 if capacity_factor else 300 + 97 * r for r in range(W)]
    xs = [torch.randn(n, H, device="cuda", generator=gen).to(DT) for n in sizes]
    gs = [torch.randn(n, H, device="cuda", generator=gen).to(DT) for n in sizes]
    x = xs[rank].clone().requires_grad_()
    y = ep(x)
    y.backward(gs[rank])
    xa = torch.cat(xs).requires_grad_()
    if capacity_factor is None:
        ya = full(xa)
    else:  # capacity drops are per rank: the full layer over each rank's tokens alone
        ya = torch.cat([full(p) for p in xa.split(sizes)])
    ya.backward(torch.cat(gs))
    lo = sum(sizes[:rank])
    assert rel(y, ya[lo : lo + sizes[rank]]) < 1e-2, "output"
    assert rel(x.grad, xa.grad[lo : lo + sizes[rank]]) < 1e-2, "input gradient"
    El = E // W
    for name in ("fc1_weight", "fc2_weight"):
        want = getattr(full.experts, name).grad[rank * El : (rank + 1) * El]
        assert rel(getattr(ep.experts, name).grad, want) < 2e-2, name
    g = ep.router.weight.grad.float()
    dist.all_reduce(g, group=group)
    assert rel(g, full.router.weight.grad) < 3e-2, "router gradient"


def check_many_uneven_steps(rank: int, W: int, group, steps: int) -> None:
    _, ep = layers(rank, W, group)
    bias = torch.zeros(E, H, device="cuda", dtype=DT)
    bias[: E // W] = 0.2  # with inputs of positive mean: everything to rank 0's experts
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    t0 = time.perf_counter()
    for s in range(steps):
        n = 1 + (s * 37 + rank * 101) % 700
        x = torch.randn(n, H, device="cuda", generator=gen).to(DT)
        skewed = s % 5 == 0
        if skewed:
            x = x.abs()
            ep.router.weight.data += bias
        x.requires_grad_()
        y = ep(x)
        y.backward(torch.ones_like(y))
        if skewed:
            ep.router.weight.data -= bias
            counts = ep.last_counts.clone()
            dist.all_reduce(counts, group=group)
            assert int(counts[E // W :].sum()) == 0, "the skewed routing reached other ranks"
        assert torch.isfinite(x.grad).all()
    done = torch.tensor([steps], device="cuda")
    dist.all_reduce(done, group=group)
    assert int(done) == steps * W
    log(rank, f"ok  {steps} uneven steps in step on {W} ranks ({time.perf_counter() - t0:.1f} s)")


def check_capacity_graph(rank: int, W: int, group) -> None:
    _, ep = layers(rank, W, group, capacity_factor=1.25)
    params = list(ep.parameters())
    x = torch.randn(256, H, device="cuda", dtype=DT, requires_grad=True)
    g = torch.randn_like(x)

    def step():
        return torch.autograd.grad(ep(x), [x, *params], g)

    graph, static = sync_free_capture(step)
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            g.copy_(torch.randn_like(g))
        graph.replay()
        eager = step()
        for got, want in zip(static, eager):
            assert rel(got, want) < 1e-2
    log(rank, "ok  capacity mode: no host sync; CUDA-graph step replays like eager")


def main() -> None:
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):  # fmt: skip
        if os.environ.get(var) != value:
            raise SystemExit(f"set {var}={value}: NVLink multicast must stay off")
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, W = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    steps = int(os.environ.get("MOEKIT_EP_CHECK_STEPS", "1000"))
    try:
        for cf in (None, 1.0):
            check_equals_single_gpu(rank, W, group, cf)
        log(rank, f"ok  EP layer equals the single-GPU layer (dropless, capacity) on {W} ranks")
        check_many_uneven_steps(rank, W, group, steps)
        check_capacity_graph(rank, W, group)
        dist.barrier()
        log(rank, f"ALL EP CHECKS PASSED on {W} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
