"""Where an expert-parallel MoELayer step goes, and what the exchange's kernels reach alone.

    torchrun --nproc_per_node=4 experiments/ep_exchange_profile.py [qwen3_30b_a3b|deepseek_v3]

Prints, for the benchmark's layer at EP W: each rank's received tokens and expert rows, the
GPU time of the step's kernels on the busiest and the least busy rank (torch.profiler), and a
sweep of the pull kernels' launch shapes: GB/s per GPU of the bytes read from peers (the slowest
rank's time), against the GPU1→GPU0 copy-engine rate.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from benchmark_moe_layer import EP_SHAPES, make_layer, p2p_copy_gb_per_s
from common import fixed_count_ms

from moekit.kernels import exchange as kx
from moekit.ops.expert_exchange import ExpertExchange
from moekit.tuning.exchange import PullConfig


def say(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def gather(v: float) -> list[float]:
    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(o) for o in out]


def kernel_table(fn, top: int = 14) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key[:60], e.device_time_total / 1e3) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3_30b_a3b"
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    W, rank = dist.get_world_size(), dist.get_rank()
    T, E, k, H, Fd, opts, _ = EP_SHAPES[name]
    layer, x, dy = make_layer(T, E, k, H, Fd, opts, "cuda", torch.bfloat16, 0, dist.group.WORLD)
    params = [x, layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]

    def step():
        return torch.autograd.grad(layer(x), params, dy)

    step()
    p2p = p2p_copy_gb_per_s()
    ms = fixed_count_ms(step, 3, 10)
    ex = layer.ep.last_exchanges[0]
    table = ex.table.long()
    with torch.no_grad():
        ids = layer.router(x.detach()).indices
    El = E // W
    rows_here = [int(((ids // El) == d).sum()) for d in range(W)]
    rows_all = torch.tensor(rows_here, device="cuda")
    dist.all_reduce(rows_all)
    say(
        f"{name} EP{W}: step ms per rank {[round(v, 2) for v in gather(ms)]}; "
        f"expert rows per rank {rows_all.tolist()}; tokens received per rank "
        f"{table.sum(0).tolist()}; p2p copy {p2p:.0f} GB/s"
    )
    kt = kernel_table(step)
    busiest = int(rows_all.argmax())
    idlest = int(rows_all.argmin())
    for who in (busiest, idlest):
        if rank == who:
            print(f"-- rank {rank} kernels (ms):", flush=True)
            for key, t in kt:
                print(f"   {t:8.3f}  {key}", flush=True)
        dist.barrier()
        torch.cuda.synchronize()
    # the pull kernels alone, on the staged data of one dispatch (read-only loops)
    with torch.no_grad():
        r = layer.router(x.detach())
    e2 = ExpertExchange(r.indices, E, dist.group.WORLD, layer.ep.max_tokens, "symmetric")
    rows, _, _ = e2.dispatch(x.detach(), r.probs)
    pool, lay = e2._pool, e2._layout
    bound = e2.bound
    out = torch.empty(bound, H, device="cuda", dtype=x.dtype)
    ids_o = torch.empty(bound, k, device="cuda", dtype=torch.int32)
    pr_o = torch.empty(bound, k, device="cuda", dtype=torch.float32)
    remote = int(table[:, rank].sum() - table[rank, rank]) * H * 2
    say("pull_tokens sweep (GB/s per GPU of peer bytes, slowest rank):")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block_r in (4, 8, 16, 32):
        for per_sm in (1, 2, 4, 8):
            cfg = PullConfig(block_r, min(H, 16384 // block_r), per_sm)
            progs = per_sm * sms

            def pull(cfg=cfg):
                kx.pull_tokens(pool.peer_bases, e2.table, lay, rank, out, ids_o, pr_o, El, sms,
                               cfg)  # fmt: skip

            t = max(gather(fixed_count_ms(pull, 3, 20)))
            gb = sum(gather(remote)) / W / t / 1e6
            say(f"   block_r {block_r:3d} programs {progs:5d}: {t:7.3f} ms {gb:6.0f} GB/s")
    # pull_sum alone: stage rows as the combine would, then read-only loops
    e2.combine(rows)
    tok_out = torch.empty(T, H, device="cuda", dtype=x.dtype)
    remote_back = int(table[rank].sum() - table[rank, rank]) * H * 2
    say("pull_sum sweep:")
    for block_r in (4, 8, 16):
        for per_sm in (1, 2, 4, 8):
            cfg = PullConfig(block_r, min(H, 8192 // block_r), per_sm)
            progs = per_sm * sms

            def psum(cfg=cfg):
                kx.pull_sum(pool.peer_bases, e2.table, lay, rank, e2.routes.rank_index,
                            tok_out, None, sms, cfg)  # fmt: skip

            t = max(gather(fixed_count_ms(psum, 3, 20)))
            gb = sum(gather(remote_back)) / W / t / 1e6
            say(f"   block_r {block_r:3d} programs {progs:5d}: {t:7.3f} ms {gb:6.0f} GB/s")

    def barrier():
        kx.exchange_barrier(pool.peer_bases, pool.epochs, rank)

    say(f"barrier alone: {max(gather(fixed_count_ms(barrier, 10, 50))) * 1e3:.1f} us")

    def routes():
        ExpertExchange(r.indices, E, dist.group.WORLD, layer.ep.max_tokens, "symmetric")

    say(f"routes alone: {max(gather(fixed_count_ms(routes, 3, 20))) * 1e3:.1f} us")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
