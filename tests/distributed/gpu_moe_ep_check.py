"""GPU checks of MoELayer's expert parallelism, under torchrun (one process per GPU).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node=2 tests/distributed/gpu_moe_ep_check.py

Checks (every rank; a failure raises):
0. the symmetric exchange equals ``all_to_all_single`` on the same routing: received rows, ids
   and probs exactly, the combine's sums and both passes' gradients within bf16 rounding;
   several rounds, with ranks that send or receive nothing;
1. the EP layer equals the single-GPU layer holding every expert: outputs, input gradients,
   expert and (summed) router weight gradients, bf16; dropless and with a capacity limit, each
   with the symmetric exchange (what ``auto`` picks here) and with ``all_to_all_single``;
2. 1000 steps with uneven routing on the symmetric exchange — token counts differing per rank,
   and every few steps a routing that sends all tokens to rank 0's experts (the other ranks
   receive none) — keep every rank in step (a step counter all-reduced at the end, no hang)
   and match the all-to-all exchange on the same inputs every 100 steps;
3. dropless and capacity steps run without a host sync (``set_sync_debug_mode("error")``) and
   a step captured in a CUDA graph replays with new data like an eager step, in one chunk and
   in two (the exchanges on a side stream, overlapping the experts);
4. a chunked layer (2 and 3 chunks, exchanges overlapping the experts) equals the unchunked
   one: outputs and input gradients, expert and router weight gradients (summed over chunks);
5. FP8 (``fp8=Fp8Recipe()``: the tokens travel as e4m3 rows and scales): the EP layer equals
   the single-GPU FP8 layer on both exchanges (fc1's weight gradient within one more e4m3
   rounding), and its step is sync-free and replays from a CUDA graph.

Checks 1 and 2 also run chunked (3 chunks in check 1; 2 in the uneven steps, whose one-token
steps leave a chunk empty).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moekit import Fp8Recipe
from moekit.nn import DispatchConfig, ExpertParallelConfig, MoELayer
from moekit.ops.expert_exchange import ExpertExchange
from tests._cuda_step import sync_free_capture

H, F, E, K = 1024, 512, 16, 4
SIZES = (1, 37, 129, 256, 300, 511, 640, 700)  # token counts of the uneven steps
DT = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def log(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def layers(rank: int, W: int, group, capacity_factor=None, config=None, fp8=None):
    torch.manual_seed(0)
    kw = dict(
        shared_expert_ffn_size=256, dispatch=DispatchConfig(capacity_factor), device="cuda",
        dtype=DT, fp8=fp8,
    )  # fmt: skip
    full = MoELayer(H, F, E, K, **kw)
    ep = MoELayer(H, F, E, K, ep_group=group, ep_config=config, **kw)
    El = E // W
    state = full.state_dict()
    for name in ("experts.fc1_weight", "experts.fc2_weight"):
        state[name] = state[name][rank * El : (rank + 1) * El].clone()
    ep.load_state_dict(state)
    return full, ep


def check_equals_single_gpu(rank, W, group, capacity_factor, backend, chunks=None,
                            fp8=None) -> None:  # fmt: skip
    config = ExpertParallelConfig(backend=backend, chunks=chunks)
    full, ep = layers(rank, W, group, capacity_factor, config, fp8)
    gen = torch.Generator(device="cuda").manual_seed(7)
    sizes = [300 + 97 * r for r in range(W)]
    xs = [torch.randn(n, H, device="cuda", generator=gen).to(DT) for n in sizes]
    gs = [torch.randn(n, H, device="cuda", generator=gen).to(DT) for n in sizes]
    x = xs[rank].clone().requires_grad_()
    y = ep(x)
    y.backward(gs[rank])
    used = ep.ep.last_exchanges[0].backend
    assert used == ("symmetric" if backend == "auto" else backend), used
    xa = torch.cat(xs).requires_grad_()
    if capacity_factor is None:
        ya = full(xa)
    else:  # capacity drops are per rank: the full layer over each rank's tokens alone
        ya = torch.cat([full(p) for p in xa.split(sizes)])
    ya.backward(torch.cat(gs))
    lo = sum(sizes[:rank])
    err = rel(y, ya[lo : lo + sizes[rank]])
    assert err < 1e-2, f"{backend} cf={capacity_factor}: output rel {err:.3g}"
    err = rel(x.grad, xa.grad[lo : lo + sizes[rank]])
    assert err < 1e-2, f"{backend} cf={capacity_factor}: input gradient rel {err:.3g}"
    El = E // W
    for name in ("fc1_weight", "fc2_weight"):
        want = getattr(full.experts, name).grad[rank * El : (rank + 1) * El]
        # FP8: fc1's rows quantized along the tokens again from the received e4m3 rows
        tol = 8e-2 if fp8 is not None and (name == "fc1_weight" or capacity_factor) else 2e-2
        assert rel(getattr(ep.experts, name).grad, want) < tol, name
    g = ep.router.weight.grad.float()
    dist.all_reduce(g, group=group)
    assert rel(g, full.router.weight.grad) < 3e-2, "router gradient"


def check_exchange_backends(rank: int, W: int, group, rounds: int = 6) -> None:
    El = E // W
    for i in range(rounds):
        gen = torch.Generator(device="cuda").manual_seed(50 + i)
        T = [0, 1, 257, 700][(i + rank) % 4]
        ids = torch.randint(0, E, (T, K), device="cuda", generator=gen)
        if i % 3 == 1:
            ids = ids % El  # every token to rank 0's experts
        if i % 3 == 2:
            ids[torch.rand(T, K, device="cuda", generator=gen) < 0.3] = -1  # dropped slots
        x = torch.randn(T, H, device="cuda", generator=gen).to(DT)
        p = torch.rand(T, K, device="cuda", generator=gen)
        g = torch.randn(T, H, device="cuda", generator=gen).to(DT)
        got = {}
        for backend in ("symmetric", "all_to_all"):
            xb, pb = x.clone().requires_grad_(), p.clone().requires_grad_()
            ex = ExpertExchange(ids, E, group, 700, backend)
            rows, probs, rid = ex.dispatch(xb, pb)
            out = ex.combine(rows.float().mul(1.5).to(DT))  # a row per received token
            gx, gpx = torch.autograd.grad([out, probs], [xb, pb], [g, torch.ones_like(probs)])
            got[backend] = (rows, probs, rid, out, gx, gpx)
        n = got["all_to_all"][0].shape[0]
        s, a = got["symmetric"], got["all_to_all"]
        for name, i_ in (("rows", 0), ("probs", 1), ("ids", 2)):
            assert torch.equal(s[i_][:n], a[i_]), f"round {i}: dispatch {name} differ"
        assert (s[2][n:] == -1).all(), f"round {i}: the bound's tail routes somewhere"
        for name, i_ in (("combine", 3), ("x gradient", 4), ("probs gradient", 5)):
            err = rel(s[i_], a[i_]) if a[i_].numel() else 0.0
            assert err < 1e-2, f"round {i}: {name} differs, rel {err:.3g}"
    log(rank, f"ok  symmetric exchange equals all_to_all_single ({rounds} rounds, {W} ranks)")


def check_many_uneven_steps(rank: int, W: int, group, steps: int) -> None:
    config = ExpertParallelConfig("symmetric", max_tokens=700, chunks=2)
    _, ep = layers(rank, W, group, config=config)
    _, a2a = layers(rank, W, group, config=ExpertParallelConfig("all_to_all"))
    bias = torch.zeros(E, H, device="cuda", dtype=DT)
    bias[: E // W] = 0.2  # with inputs of positive mean: everything to rank 0's experts
    gen = torch.Generator(device="cuda").manual_seed(100 + rank)
    t0 = time.perf_counter()
    for s in range(steps):
        n = SIZES[(s + rank) % len(SIZES)]  # every rank a different count each step
        x = torch.randn(n, H, device="cuda", generator=gen).to(DT)
        skewed = s % 5 == 0
        if skewed:
            x = x.abs()
            ep.router.weight.data += bias
        x.requires_grad_()
        y = ep(x)
        y.backward(torch.ones_like(y))
        if s % 250 == 0:
            log(rank, f"    step {s} ({time.perf_counter() - t0:.0f} s)")
        if s % 100 == 0:  # the same step over all_to_all_single
            a2a.router.weight.data.copy_(ep.router.weight.data)
            xb = x.detach().clone().requires_grad_()
            yb = a2a(xb)
            yb.backward(torch.ones_like(yb))
            assert rel(y, yb) < 1e-2 and rel(x.grad, xb.grad) < 1e-2, f"step {s}: backends differ"
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


def check_sync_free_graph(rank: int, W: int, group, capacity_factor, chunks, fp8=None) -> None:
    config = ExpertParallelConfig(chunks=chunks)
    _, ep = layers(rank, W, group, capacity_factor=capacity_factor, config=config, fp8=fp8)
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
    mode = ("dropless" if capacity_factor is None else "capacity") + (", fp8" if fp8 else "")
    log(rank, f"ok  {mode}, {chunks} chunk(s): no host sync; CUDA-graph step replays like eager")


def check_chunks_equal_unchunked(rank: int, W: int, group, chunks: int) -> None:
    _, one = layers(rank, W, group, config=ExpertParallelConfig(chunks=1))
    _, many = layers(rank, W, group, config=ExpertParallelConfig(chunks=chunks))
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    T = 3000 + 113 * rank
    x = torch.randn(T, H, device="cuda", generator=gen).to(DT)
    g = torch.randn(T, H, device="cuda", generator=gen).to(DT)
    got = {}
    for name, layer in (("one", one), ("many", many)):
        xb = x.clone().requires_grad_()
        y = layer(xb)
        y.backward(g)
        assert len(layer.ep.last_exchanges) == (1 if name == "one" else chunks)
        got[name] = [y, xb.grad, *(p.grad for p in layer.parameters())]
    for i, (a, b) in enumerate(zip(got["many"], got["one"])):
        err = rel(a, b)
        assert err < 1e-2, f"{chunks} chunks: tensor {i} differs from one chunk, rel {err:.3g}"
    log(rank, f"ok  {chunks} overlapped chunks equal one chunk (outputs, all gradients)")


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
        check_exchange_backends(rank, W, group)
        for backend in ("auto", "all_to_all"):
            for cf in (None, 1.0):
                check_equals_single_gpu(rank, W, group, cf, backend)
        for cf in (None, 1.0):
            check_equals_single_gpu(rank, W, group, cf, "auto", chunks=3)
        log(rank, f"ok  EP layer equals the single-GPU layer (dropless, capacity; symmetric, "
                  f"all_to_all; symmetric in 3 chunks) on {W} ranks")  # fmt: skip
        for chunks in (2, 3):
            check_chunks_equal_unchunked(rank, W, group, chunks)
        check_many_uneven_steps(rank, W, group, steps)
        for cf in (None, 1.25):
            for chunks in (1, 2):
                check_sync_free_graph(rank, W, group, cf, chunks)
        for backend in ("auto", "all_to_all"):
            for cf in (None, 1.0):
                check_equals_single_gpu(rank, W, group, cf, backend, fp8=Fp8Recipe())
        log(rank, f"ok  FP8 EP layer equals the single-GPU FP8 layer on {W} ranks")
        check_sync_free_graph(rank, W, group, None, 1, fp8=Fp8Recipe())
        dist.barrier()
        log(rank, f"ALL EP CHECKS PASSED on {W} ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
