"""GPU correctness checks for the symmetric-memory all-reduce (+ add)(+ RMSNorm), under torchrun.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node=2 tests/distributed/gpu_allreduce_check.py

Checks (every rank, failures raise): each algo vs the reference (residual_out bit-exact for the
symmetric kernels, which sum in the reference's order), bit-identical outputs on every rank,
1000 calls with changing data / shapes / algos (no stale reads, no deadlock), launch replay and a
misaligned input, CUDA-graph capture and replay, the Lamport sentinel, the NCCL fallback when the
pool is too small (one warning), bad input, group of size 1, backward, and
``torch.compile(fullgraph=True)`` forward + backward.
``benchmarks/benchmark_allreduce_rmsnorm.py`` runs :func:`run_checks` first.
"""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from moekit.distributed import SymmetricPool, get_pool, init_distributed, set_pool
from moekit.kernels import allreduce as kar
from moekit.ops.allreduce import (
    allreduce,
    allreduce_add,
    allreduce_add_rmsnorm,
    workspace_of,
)
from moekit.ops.rmsnorm import add_rmsnorm
from moekit.reference.allreduce import gather_allreduce_ref
from moekit.reference.rmsnorm import add_rmsnorm_ref
from moekit.runtime.cache import cache_entries
from moekit.tuning.allreduce import PLAN_CACHE_KIND

ALGOS = ("one_shot", "two_shot", "lamport", "lamport_two_shot", "nccl", "auto")
SYMM = ("one_shot", "two_shot", "lamport", "lamport_two_shot")


def _log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _inputs(T: int, H: int, dtype: torch.dtype, seed: int, device: torch.device):
    """x differs per rank; residual and weight are replicated (same seed on every rank)."""
    rank = dist.get_rank()
    g = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x = torch.randn(T, H, device=device, generator=g).to(dtype)
    g.manual_seed(seed * 7919 + 4099)
    residual = torch.randn(T, H, device=device, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(H, device=device, generator=g)).to(dtype)
    return x, residual, weight


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(got[0], g) for g in got[1:])


def _norm_tol(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


def check_algos_vs_reference(device: torch.device) -> None:
    shapes = [(1, 4096), (8, 7168), (64, 4096), (300, 7168), (1024, 4096), (333, 2048), (5, 8)]
    for dtype in (torch.bfloat16, torch.float16):
        for T, H in shapes:
            x, residual, weight = _inputs(T, H, dtype, seed=T + H, device=device)
            ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
            _, ref_sum = gather_allreduce_ref(x, None, None)
            tol = _norm_tol(dtype)
            for algo in ALGOS:
                n, ro = allreduce_add_rmsnorm(x, residual, weight, algo=algo)
                tag = f"{algo} T={T} H={H} {dtype}"
                assert _same_on_all_ranks(n) and _same_on_all_ranks(ro), f"ranks differ: {tag}"
                if algo in SYMM:
                    assert torch.equal(ro, ref_ro), f"residual_out not bit-exact: {tag}"
                    assert torch.equal(allreduce(x, algo=algo), ref_sum), f"allreduce: {tag}"
                    assert torch.equal(allreduce_add(x, residual, algo=algo), ref_ro), tag
                else:
                    torch.testing.assert_close(ro, ref_ro, atol=tol * 4, rtol=tol, msg=tag)
                torch.testing.assert_close(n, ref_n, atol=tol * 4, rtol=tol, msg=tag)
    _log("ok  every algo vs reference; identical on every rank (bf16, fp16, 7 shapes)")


def check_repeated_calls(device: torch.device, iters: int = 1000) -> None:
    """Changing data, token counts (grid sizes) and algorithms every call: a stale read or a
    barrier that lets a rank run ahead shows up as a mismatch, a lost signal as a hang."""
    H = 4096
    Ts = (1, 7, 64, 129, 512, 3)
    bad = torch.zeros((), dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    for i in range(iters):
        T = Ts[i % len(Ts)]
        algo = SYMM[(i // len(Ts)) % len(SYMM)]
        x, residual, weight = _inputs(T, H, torch.bfloat16, seed=10_000 + i, device=device)
        n, ro = allreduce_add_rmsnorm(x, residual, weight, algo=algo)
        ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
        bad += (ro != ref_ro).sum()
        bad += ((n.float() - ref_n.float()).abs() > 6e-2 + 1.6e-2 * ref_n.float().abs()).sum()
    torch.cuda.synchronize()
    assert int(bad) == 0, f"{int(bad)} mismatching elements over {iters} repeated calls"
    dt = time.perf_counter() - t0
    _log(f"ok  {iters} repeated calls, changing data/shape/algo, no stale reads ({dt:.1f} s)")


def check_back_to_back(device: torch.device, calls: int = 240) -> None:
    """Calls issued back to back with no host sync in between, while one rank at a time is held
    back on the GPU (``torch.cuda._sleep``): the faster ranks run up to one launch ahead and
    overwrite the other half of their buffers while the slow one still reads the first. A missing
    exit barrier done wrong shows up here as a mismatch (or a hang)."""
    H = 4096
    Ts = (1, 64, 7, 129, 16, 300)
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs, outs = [], []
    weight = _inputs(1, H, torch.bfloat16, seed=1, device=device)[2]
    for i in range(calls):
        T = Ts[i % len(Ts)]
        x, residual, _ = _inputs(T, H, torch.bfloat16, seed=20_000 + i, device=device)
        inputs.append((x, residual))
    torch.cuda.synchronize()
    dist.barrier()
    for i, (x, residual) in enumerate(inputs):
        if (i // 3) % world == rank:
            torch.cuda._sleep(50_000)  # hold this rank back on the GPU; the others run ahead
        algo = (*SYMM, "auto")[i % (len(SYMM) + 1)]
        outs.append(allreduce_add_rmsnorm(x, residual, weight, algo=algo))
    torch.cuda.synchronize()
    bad = 0
    for (x, residual), (n, ro) in zip(inputs, outs):
        ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
        bad += int((ro != ref_ro).sum())
        bad += int(((n.float() - ref_n.float()).abs() > 6e-2 + 1.6e-2 * ref_n.float().abs()).sum())
    assert bad == 0, f"{bad} mismatching elements over {calls} back-to-back calls"
    _log(f"ok  {calls} back-to-back calls with one rank delayed in turn (double buffering)")


def check_cached_plans_and_alignment(device: torch.device) -> None:
    """Repeated calls reuse one launch plan per shape (and replay the recorded launch); an input
    at a 2-byte offset (same shape, other pointer specialisation) must take the normal launch
    path and get its own compiled kernel, not replay the aligned one."""
    T, H = 24, 4096
    x, residual, weight = _inputs(T, H, torch.bfloat16, seed=77, device=device)
    for algo in SYMM:
        for _ in range(3):
            allreduce_add_rmsnorm(x, residual, weight, algo=algo)
    n_plans = len(cache_entries(PLAN_CACHE_KIND))
    for algo in SYMM:
        for rep in range(5):
            x, residual, _ = _inputs(T, H, torch.bfloat16, seed=78 + rep, device=device)
            ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
            n, ro = allreduce_add_rmsnorm(x, residual, weight, algo=algo)
            assert torch.equal(ro, ref_ro), f"cached plan {algo} rep {rep}"
            torch.testing.assert_close(n, ref_n, atol=6e-2, rtol=1.6e-2)
            big = torch.empty(T * H + 1, dtype=torch.bfloat16, device=device)
            xm = big[1:].view(T, H)  # contiguous, data_ptr ≡ 2 (mod 16)
            xm.copy_(x)
            n2, ro2 = allreduce_add_rmsnorm(xm, residual, weight, algo=algo)
            assert torch.equal(ro2, ref_ro), f"misaligned x {algo} rep {rep}"
            torch.testing.assert_close(n2, ref_n, atol=6e-2, rtol=1.6e-2)
    now = len(cache_entries(PLAN_CACHE_KIND))
    assert now == n_plans, f"plans grew {n_plans} → {now}"
    _log(f"ok  cached launch plans reused ({n_plans}); misaligned input gets its own kernel")


def check_cuda_graph(device: torch.device) -> None:
    T, H = 48, 4096
    x, residual, weight = _inputs(T, H, torch.bfloat16, seed=5, device=device)
    outs = {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles, creates the pool) outside capture
        for algo in SYMM:
            allreduce_add_rmsnorm(x, residual, weight, algo=algo)
        allreduce(x, algo="one_shot")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for algo in SYMM:
            outs[algo] = allreduce_add_rmsnorm(x, residual, weight, algo=algo)
        outs["plain"] = (allreduce(x, algo="one_shot"),)
    for rep in range(50):
        nx, nr, _ = _inputs(T, H, torch.bfloat16, seed=100 + rep, device=device)
        x.copy_(nx)
        residual.copy_(nr)
        graph.replay()
        ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
        _, ref_sum = gather_allreduce_ref(x, None, None)
        for algo in SYMM:
            n, ro = outs[algo]
            assert torch.equal(ro, ref_ro), f"graph replay {rep} {algo}: residual_out"
            torch.testing.assert_close(n, ref_n, atol=6e-2, rtol=1.6e-2)
        assert torch.equal(outs["plain"][0], ref_sum), f"graph replay {rep}: allreduce"
    _log("ok  CUDA-graph capture + 50 replays with new data (4 symmetric algos, allreduce)")


def check_lamport_specifics(device: torch.device) -> None:
    """Zero inputs of either sign (+0.0 is the empty sentinel) must not hang or change the
    result; fp32 asking for lamport takes one_shot with one warning; afterwards every Lamport
    slot is empty (zero) again."""
    pool = get_pool()
    for H in (4096, 7168):
        for zero in (0.0, -0.0):
            x = torch.full((5, H), zero, dtype=torch.bfloat16, device=device)
            residual = torch.zeros_like(x)
            for algo in ("lamport", "lamport_two_shot"):
                ro = allreduce_add(x, residual, algo=algo)
                assert torch.equal(ro, torch.zeros_like(ro)), f"all {zero} inputs, {algo}"
        xm, residual, weight = _inputs(33, H, torch.float16, seed=H, device=device)
        xm[::2] = 0.0
        xm[1::4] = -0.0
        _, ref_ro = gather_allreduce_ref(xm, residual, weight, 1e-6)
        for algo in ("lamport", "lamport_two_shot"):
            assert torch.equal(allreduce_add_rmsnorm(xm, residual, weight, algo=algo)[1], ref_ro)
    x, residual, weight = _inputs(8, 1024, torch.float32, seed=9, device=device)
    _, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        ro = allreduce_add_rmsnorm(x, residual, weight, algo="lamport")[1]
        ro2 = allreduce_add_rmsnorm(x, residual, weight, algo="lamport_two_shot")[1]
    msgs = [str(w.message) for w in rec]
    assert any("using one_shot" in m for m in msgs) and any("using two_shot" in m for m in msgs)
    assert torch.equal(ro, ref_ro) and torch.equal(ro2, ref_ro), "fp32 lamport requests"
    torch.cuda.synchronize()
    dist.barrier()
    region = pool.buffer[workspace_of(pool).lamport_offset :].view(torch.int16)
    dirty = int((region != kar.LAMPORT_SENTINEL_BITS).sum())
    assert dirty == 0, f"{dirty} Lamport slot elements not returned to the sentinel"
    _log(f"ok  lamport(_two_shot): ±0.0 inputs, fp32 → plain twin, {region.numel()} slots clean")


def check_pool_reuse() -> None:
    pool = get_pool()
    assert pool.available, f"symmetric pool unavailable: {pool.reason}"
    assert get_pool() is pool
    _log(f"ok  pool reused without re-rendezvous: {pool}")


def check_fallback_small_pool(device: torch.device) -> None:
    world = dist.get_world_size()
    group = dist.new_group(list(range(world)))
    # room for the flags and two halves of 2 KiB; none for Lamport slots
    set_pool(SymmetricPool(group, size_bytes=kar.SIGNAL_BYTES + 4096))
    x, residual, weight = _inputs(64, 4096, torch.bfloat16, seed=3, device=device)
    ref_n, ref_ro = gather_allreduce_ref(x, residual, weight, 1e-6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            n, ro = allreduce_add_rmsnorm(x, residual, weight, group=group, algo="one_shot")
    msgs = [str(w.message) for w in rec if "falling back to NCCL" in str(w.message)]
    assert len(msgs) == 1, f"expected one fallback warning, got {msgs}"
    assert "pool has 4096 B" in msgs[0], msgs[0]
    torch.testing.assert_close(ro, ref_ro, atol=6e-2, rtol=1.6e-2)
    torch.testing.assert_close(n, ref_n, atol=6e-2, rtol=1.6e-2)
    assert _same_on_all_ranks(n)
    # a tiny message still fits the tiny pool and takes the symmetric kernel
    xs, rs, ws = _inputs(1, 512, torch.bfloat16, seed=4, device=device)
    _, ref_small = gather_allreduce_ref(xs, rs, None)
    assert torch.equal(
        allreduce_add_rmsnorm(xs, rs, ws, group=group, algo="one_shot")[1], ref_small
    )
    _log(f"ok  pool too small → NCCL fallback with one warning: {msgs[0][:90]}…")


def check_bad_input(device: torch.device) -> None:
    x, residual, weight = _inputs(4, 64, torch.bfloat16, seed=1, device=device)

    def expect(exc, fn, what):
        try:
            fn()
        except exc as e:
            return str(e)
        raise AssertionError(f"{what}: expected {exc.__name__}")

    expect(ValueError, lambda: allreduce_add_rmsnorm(x, residual[:2], weight), "shape")
    expect(ValueError, lambda: allreduce_add_rmsnorm(x, residual, weight[:32]), "weight shape")
    expect(TypeError, lambda: allreduce_add_rmsnorm(x, residual.half(), weight), "dtype")
    expect(TypeError, lambda: allreduce_add_rmsnorm(x.int(), residual, weight), "x dtype")
    expect(ValueError, lambda: allreduce_add_rmsnorm(x, residual.cpu(), weight), "device")
    if torch.cuda.device_count() > 1:
        other = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
        msg = expect(
            ValueError,
            lambda: allreduce_add_rmsnorm(x.to(other), residual.to(other), weight.to(other)),
            "other GPU",
        )
        assert "current CUDA device" in msg, msg
    solo = None
    for r in range(dist.get_world_size()):  # every rank must create every group
        g = dist.new_group([r])
        if r == dist.get_rank():
            solo = g
    n, ro = allreduce_add_rmsnorm(x, residual, weight, group=solo)
    rn, rro = add_rmsnorm(x, residual, weight)
    assert torch.equal(n, rn) and torch.equal(ro, rro), "group of size 1 must be add + norm"
    _log("ok  bad input → clear errors; group of size 1 → local add + RMSNorm")


def check_backward(device: torch.device) -> None:
    T, H = 96, 4096
    for algo in ("one_shot", "two_shot", "nccl"):  # fp32 (lamport: 16-bit only)
        x, residual, weight = _inputs(T, H, torch.float32, seed=21, device=device)
        dn, dro, _ = _inputs(T, H, torch.float32, seed=22, device=device)
        dn, dro = dn.contiguous(), dro.contiguous()
        xs = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(xs, x)
        x.requires_grad_()
        r = residual.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        n, ro = allreduce_add_rmsnorm(x, r, w, algo=algo)
        (n * dn + ro * dro).sum().backward()
        s = sum(xs).requires_grad_()
        r2 = residual.clone().requires_grad_()
        w2 = weight.clone().requires_grad_()
        n2, ro2, _ = add_rmsnorm_ref(s, r2, w2, 1e-6)
        (n2 * dn + ro2 * dro).sum().backward()
        torch.testing.assert_close(x.grad, s.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(r.grad, r2.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(w.grad, w2.grad, atol=1e-2, rtol=1e-4)
    _log("ok  backward: identity through the all-reduce + local add/RMSNorm backward")


def check_compile(device: torch.device) -> None:
    """``torch.compile(fullgraph=True)`` forward + backward through the collective (one graph,
    the kernel op opaque) matches the eager call."""
    T, H = 32, 4096
    for algo in ("one_shot", "lamport", "nccl"):
        torch._dynamo.reset()
        x, residual, weight = _inputs(T, H, torch.bfloat16, seed=31, device=device)
        dy = _inputs(2 * T, H, torch.bfloat16, seed=32, device=device)[0]
        inputs = (x.requires_grad_(), residual.requires_grad_(), weight.requires_grad_())

        def fn(x, r, w, algo=algo):
            return torch.cat(allreduce_add_rmsnorm(x, r, w, algo=algo))

        eager = fn(*inputs)
        want = torch.autograd.grad(eager, inputs, dy)
        got_out = torch.compile(fn, fullgraph=True)(*inputs)
        got = torch.autograd.grad(got_out, inputs, dy)
        torch.testing.assert_close(got_out, eager, atol=6e-2, rtol=1.6e-2)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=6e-2, rtol=1.6e-2)
    _log("ok  torch.compile(fullgraph=True) forward + backward (one_shot, lamport, nccl)")


def run_checks(*, iters: int = 1000) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    check_pool_reuse()
    check_algos_vs_reference(device)
    check_repeated_calls(device, iters)
    check_back_to_back(device)
    check_cached_plans_and_alignment(device)
    check_cuda_graph(device)
    check_lamport_specifics(device)
    check_backward(device)
    check_compile(device)
    check_bad_input(device)
    check_fallback_small_pool(device)  # last: registers a small pool for a new group only
    torch.cuda.synchronize()
    dist.barrier()
    _log(f"ALL CHECKS PASSED on {dist.get_world_size()} ranks ({time.perf_counter() - t0:.1f} s)")


def main() -> None:
    info = init_distributed()
    if info.device.type != "cuda" or info.world_size < 2:
        raise SystemExit("needs >= 2 GPUs under torchrun")
    _log(
        f"world={info.world_size} torch={torch.__version__} "
        f"device={torch.cuda.get_device_name()} env="
        + ",".join(
            f"{k}={os.environ.get(k)}"
            for k in (
                "NCCL_NVLS_ENABLE",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                "NVSHMEM_DISABLE_NVLS",
            )
        )
    )
    try:
        run_checks()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
