"""allreduce / allreduce_add / allreduce_add_rmsnorm.

CPU (marker ``dist``): two gloo ranks spawned with torch.multiprocessing exercise the reference
path, the NCCL-fallback path (gloo's all_reduce + local fused epilogue), autograd, bad input and a
group of size 1, and ``torch.compile(fullgraph=True)`` forward + backward. Under
``TRITON_INTERPRET=1`` the symmetric-memory kernel itself runs in the interpreter with two
processes sharing file-backed buffers (each "peer buffer" mapped into both processes, like
symmetric memory), which checks indexing, the barriers, the Lamport slots and the epochs on CPU.
GPU (markers ``gpu``, ``dist``): ``tests/distributed/gpu_allreduce_check.py`` under torchrun.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.reference.allreduce import allreduce_add_rmsnorm_shards_ref
from tests._multiproc import finish_worker, run_gpu_check_under_torchrun

WORLD = 2


def _spawn(fn, *args) -> None:
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(fn, args=(os.path.join(d, "store"), *args), nprocs=WORLD, join=True)


def _init(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _shards(T: int, H: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    shards = [torch.randn(T, H, generator=g).to(dtype) for _ in range(WORLD)]
    residual = torch.randn(T, H, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    return shards, residual, weight


def _all_equal_across_ranks(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(WORLD)]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(got[0], g) for g in got[1:])


def _worker_paths(rank: int, store: str) -> None:
    from moekit.ops.allreduce import allreduce, allreduce_add, allreduce_add_rmsnorm

    _init(rank, store)
    try:
        # T=1 (single token), odd H (masking), a batch dim (flattening), all float dtypes
        for T, H, dtype, extra in [(1, 8, torch.float32, ()), (5, 33, torch.bfloat16, ()),
                                   (4, 16, torch.float16, (2,))]:  # fmt: skip
            shards, residual, weight = _shards(T, H, dtype, seed=T * 100 + H)
            shape = (*extra, T // extra[0], H) if extra else (T, H)
            x = shards[rank].reshape(shape)
            res = residual.reshape(shape)
            ref_n, ref_ro = allreduce_add_rmsnorm_shards_ref(shards, residual, weight, 1e-6)
            # reference path: bit-identical to the shard oracle and across ranks
            n, ro = allreduce_add_rmsnorm(x, res, weight, algo="reference")
            assert n.shape == shape and ro.shape == shape
            assert torch.equal(ro.reshape(T, H), ref_ro) and torch.equal(n.reshape(T, H), ref_n)
            # auto on CPU = reference
            n2, ro2 = allreduce_add_rmsnorm(x, res, weight)
            assert torch.equal(n2, n) and torch.equal(ro2, ro)
            # nccl (gloo) fallback: all_reduce in the input dtype, then the fused epilogue
            n3, ro3 = allreduce_add_rmsnorm(x, res, weight, algo="nccl")
            tol = {torch.float32: 1e-5, torch.bfloat16: 6e-2, torch.float16: 8e-3}[dtype]
            torch.testing.assert_close(ro3.float(), ro.float(), atol=tol * 8, rtol=tol)
            torch.testing.assert_close(n3.float(), n.float(), atol=tol * 8, rtol=tol)
            assert _all_equal_across_ranks(n3) and _all_equal_across_ranks(ro3)
            # plain all-reduce and all-reduce + add through the same machinery
            s = allreduce(x, algo="reference")
            _, ref_s = allreduce_add_rmsnorm_shards_ref(shards, None, None)
            assert torch.equal(s.reshape(T, H), ref_s)
            a = allreduce_add(x, res, algo="reference")
            assert torch.equal(a, ro)
            s_n = allreduce(x, algo="nccl")
            torch.testing.assert_close(s_n.float(), s.float(), atol=tol * 8, rtol=tol)
        # repeated calls reuse their launch plans (one per shape / dtype / algo / group)
        from moekit.ops.allreduce import set_auto_thresholds
        from moekit.runtime.cache import cache_entries
        from moekit.tuning.allreduce import PLAN_CACHE_KIND

        shards, residual, weight = _shards(4, 16, torch.float32, seed=5)
        for _ in range(2):
            for algo in ("reference", "nccl", "auto"):
                allreduce_add_rmsnorm(shards[rank], residual, weight, algo=algo)
            n_plans = len(cache_entries(PLAN_CACHE_KIND))
        set_auto_thresholds(None, None)  # drops the plans
        assert n_plans >= 3 and len(cache_entries(PLAN_CACHE_KIND)) == 0
        # explicit symmetric algo on CPU: one-time warning, NCCL path
        shards, residual, weight = _shards(3, 16, torch.float32, seed=7)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            n4, _ = allreduce_add_rmsnorm(shards[rank], residual, weight, algo="one_shot")
            allreduce_add_rmsnorm(shards[rank], residual, weight, algo="two_shot")
        msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
        assert len(msgs) == 1 and "CUDA symmetric memory" in msgs[0], msgs
        ref_n, _ = allreduce_add_rmsnorm_shards_ref(shards, residual, weight, 1e-6)
        torch.testing.assert_close(n4, ref_n, atol=1e-5, rtol=1e-5)
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


def _worker_autograd(rank: int, store: str) -> None:
    from moekit.ops.allreduce import allreduce, allreduce_add, allreduce_add_rmsnorm
    from moekit.reference.rmsnorm import add_rmsnorm_ref

    _init(rank, store)
    try:
        T, H = 6, 24
        shards, residual, weight = _shards(T, H, torch.float32, seed=11)
        g = torch.Generator().manual_seed(12)
        dn, dro = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        for algo in ("reference", "nccl"):
            x = shards[rank].clone().requires_grad_()
            r = residual.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            n, ro = allreduce_add_rmsnorm(x, r, w, algo=algo)
            (n * dn + ro * dro).sum().backward()
            # oracle: local add + norm on the all-reduced sum; the all-reduce's backward is
            # the identity (Megatron row-parallel), so d x = d residual = d(sum)
            s = sum(sh for sh in shards).detach().requires_grad_()
            r2 = residual.clone().requires_grad_()
            w2 = weight.clone().requires_grad_()
            n2, ro2, _ = add_rmsnorm_ref(s, r2, w2, 1e-6)
            (n2 * dn + ro2 * dro).sum().backward()
            torch.testing.assert_close(x.grad, s.grad, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r.grad, r2.grad, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(w.grad, w2.grad, atol=1e-4, rtol=1e-5)
            # only the normed output used (d residual_out = None)
            x = shards[rank].clone().requires_grad_()
            allreduce_add_rmsnorm(x, residual, w.detach(), algo=algo)[0].sum().backward()
            assert x.grad is not None and torch.isfinite(x.grad).all()
        # identity backward of allreduce / allreduce_add
        x = shards[rank].clone().requires_grad_()
        r = residual.clone().requires_grad_()
        (allreduce(x, algo="reference") * dn).sum().backward()
        assert torch.equal(x.grad, dn)
        x.grad = None
        (allreduce_add(x, r, algo="nccl") * dro).sum().backward()
        assert torch.equal(x.grad, dro) and torch.equal(r.grad, dro)
        # a second backward through the graph accumulates into .grad of x and residual alike
        # (each keeps its own storage, though one gradient serves both); batch dims flattened
        for algo in ("reference", "nccl"):
            x = shards[rank].view(2, 3, H).clone().requires_grad_()
            r = residual.view(2, 3, H).clone().requires_grad_()
            w = weight.clone().requires_grad_()
            n, ro = allreduce_add_rmsnorm(x, r, w, algo=algo)
            loss = (n * dn.view(2, 3, H) + ro * dro.view(2, 3, H)).sum()
            loss.backward(retain_graph=True)
            first = [t.grad.clone() for t in (x, r, w)]
            loss.backward()
            for t, g in zip((x, r, w), first):
                torch.testing.assert_close(t.grad, 2 * g)
            assert x.grad.data_ptr() != r.grad.data_ptr()
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


def _worker_errors(rank: int, store: str) -> None:
    from moekit.ops.allreduce import allreduce, allreduce_add_rmsnorm
    from moekit.reference.rmsnorm import add_rmsnorm_ref

    _init(rank, store)
    try:
        x = torch.randn(4, 8)
        r = torch.randn(4, 8)
        w = torch.ones(8)

        def raises(exc, match, fn):
            with pytest.raises(exc, match=match):
                fn()

        raises(
            ValueError, "residual must have x's shape", lambda: allreduce_add_rmsnorm(x, r[:3], w)
        )
        raises(
            ValueError, r"weight must have shape \(H,\)", lambda: allreduce_add_rmsnorm(x, r, w[:4])
        )
        raises(TypeError, "x must have dtype", lambda: allreduce_add_rmsnorm(x.long(), r, w))
        raises(
            TypeError, "residual must have x's dtype", lambda: allreduce_add_rmsnorm(x, r.half(), w)
        )
        raises(TypeError, "weight must have", lambda: allreduce_add_rmsnorm(x, r, w.double()))
        raises(TypeError, "x must be a torch.Tensor", lambda: allreduce_add_rmsnorm([1.0], r, w))
        raises(ValueError, "residual must be on x's device", lambda: allreduce_add_rmsnorm(
            x, r.to("meta"), w))  # fmt: skip
        raises(ValueError, "weight must be on x's device", lambda: allreduce_add_rmsnorm(
            x, r, w.to("meta")))  # fmt: skip
        raises(ValueError, "algo must be one of", lambda: allreduce_add_rmsnorm(x, r, w, algo="x"))
        xt = torch.randn(8, 4).t()  # [4, 8], not contiguous
        raises(ValueError, "x must be contiguous", lambda: allreduce_add_rmsnorm(xt, r, w))
        raises(ValueError, "eps must be", lambda: allreduce_add_rmsnorm(x, r, w, eps=-1.0))
        raises(TypeError, "group must be", lambda: allreduce(x, group="world"))
        # group of size 1: no communication, plain add + RMSNorm
        solo = [dist.new_group([0]), dist.new_group([1])][rank]
        n, ro = allreduce_add_rmsnorm(x, r, w, group=solo, algo="one_shot")
        rn, rro, _ = add_rmsnorm_ref(x, r, w, 1e-6)
        torch.testing.assert_close(n, rn, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ro, rro, atol=0, rtol=0)
        assert allreduce(x, group=solo) is x
        finish_worker()  # barrier, then exit without gloo's racy teardown
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_reference_and_nccl_paths():
    _spawn(_worker_paths)


@pytest.mark.dist
def test_autograd_row_parallel_semantics():
    _spawn(_worker_autograd)


@pytest.mark.dist
def test_bad_input_and_group_of_one():
    _spawn(_worker_errors)


def test_auto_algo_defaults(monkeypatch):
    from moekit.ops.allreduce import auto_algo, set_auto_thresholds

    for name in ("ONE_SHOT", "TWO_SHOT", "LAMPORT", "LAMPORT_TWO_SHOT"):
        monkeypatch.delenv(f"MOEKIT_AR_{name}_MAX_KB", raising=False)
    # the defaults: W=2 lamport ≤ 512 KiB, lamport_two_shot ≤ 4 MiB, one_shot ≤ 8 MiB, two_shot
    # above; W=4 lamport_two_shot ≤ 8 MiB, one_shot ≤ 1 MiB (fp32), two_shot above
    assert auto_algo(8192, 2, True) == "lamport" and auto_algo(1 << 20, 2, True) == (
        "lamport_two_shot"
    )
    assert auto_algo(8192, 2) == "one_shot" and auto_algo(6 << 20, 2, True) == "one_shot"
    assert auto_algo(1 << 30, 2, True) == "two_shot"
    assert auto_algo(8192, 4, True) == "lamport_two_shot"
    assert auto_algo(8 << 20, 4, True) == "lamport_two_shot"
    assert auto_algo(917_504, 4) == "one_shot" and auto_algo(2_097_152, 4) == "two_shot"
    assert auto_algo(1 << 30, 4, True) == "two_shot"  # NCCL only when a two_shot max is set
    assert auto_algo(8192, 8, True) == "one_shot" and auto_algo(1 << 20, 8) == "two_shot"
    monkeypatch.setenv("MOEKIT_AR_TWO_SHOT_MAX_KB", "1024")
    assert auto_algo(2 << 20, 4) == "nccl"
    set_auto_thresholds(lamport_max_bytes=1 << 20)
    try:
        assert auto_algo(1 << 20, 4, True) == "lamport" and auto_algo(1 << 20, 4) == "one_shot"
    finally:
        set_auto_thresholds()


# ----------------------------------------------------------------------------------------------
# the symmetric-memory kernels in Triton's interpreter, two processes sharing buffers
# ----------------------------------------------------------------------------------------------


_SIM_SLOT = 32768  # Lamport slot bytes


def _sim_nbytes() -> int:
    from moekit.kernels import allreduce as kar

    return kar.SIGNAL_BYTES + (1 << 16) + 2 * WORLD * _SIM_SLOT  # two halves of 32 KiB


def _sim_config(algo: str, T: int, H: int, progs: int):
    from moekit.tuning.allreduce import allreduce_config

    cfg = allreduce_config(algo.replace("_tile", ""), T, H, WORLD, progs)
    if algo.endswith("_tile"):  # the [W, H] tile gather (the default from 4 ranks on)
        cfg = dataclasses.replace(cfg, gather_tile=True)
    return cfg


def _sim_call(kar, x, res, w, peer_bases, ctl, rank, algo, space, cfg):
    T = x.shape[0]
    ro = torch.empty_like(x)
    y = torch.empty_like(x) if w is not None else None
    rstd = torch.empty(T) if w is not None else None
    kar.fused_allreduce(
        x, res, w, ro, y, rstd, peer_bases, ctl, 1e-6,
        rank=rank, algo=algo.replace("_tile", ""), space=space, config=cfg,
    )  # fmt: skip
    return y, ro, rstd


_SIM_CASES = [
    # (T, H, algo, dtype, max_programs): T=1 leaves ranks without rows in two_shot; T not a
    # multiple of W or of the grid; grids change between calls (epochs must stay in step)
    (5, 64, "one_shot", torch.float32, 3),
    (7, 32, "two_shot", torch.float32, 2),
    (1, 64, "two_shot", torch.float32, 4),
    (9, 16, "one_shot", torch.bfloat16, 4),
    (3, 16, "two_shot", torch.float16, 1),
    (6, 8, "one_shot", torch.float32, 1),
    # lamport between the others: slots alternate with the shared launch epoch
    (5, 64, "lamport", torch.bfloat16, 3),
    (1, 16, "lamport", torch.float16, 2),
    (7, 32, "two_shot", torch.bfloat16, 2),
    (9, 32, "lamport", torch.bfloat16, 4),
    (5, 32, "two_shot_tile", torch.float32, 2),
    (7, 32, "lamport_two_shot", torch.bfloat16, 2),
    (1, 16, "lamport_two_shot", torch.float16, 3),
    (8, 64, "lamport_two_shot", torch.bfloat16, 8),
    # wide rows
    (3, 4096, "lamport_two_shot", torch.bfloat16, 5),
    (2, 4096, "lamport", torch.float16, 4),
]


def _worker_sim(rank: int, store: str, paths: list[str], out_dir: str) -> None:
    from moekit.kernels import allreduce as kar

    nbytes = _sim_nbytes()
    bufs = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
    peer_bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    ctl = torch.zeros(kar.CTL_WORDS, dtype=torch.int32)
    space = kar.workspace(nbytes, WORLD, _SIM_SLOT)
    assert space.lamport_slot_bytes == _SIM_SLOT and space.half_bytes == 1 << 15
    results = {}
    for i, (T, H, algo, dtype, progs) in enumerate(_SIM_CASES):
        shards, residual, weight = _shards(T, H, dtype, seed=1000 + i)
        if i % 3 == 0:  # zeros of both signs: never confused with the empty Lamport sentinel
            for shard in shards:
                shard[0] = 0.0
                shard[-1, ::2] = -0.0
        cfg = _sim_config(algo, T, H, progs)
        for mode in ("norm", "add", "plain"):
            res = residual if mode != "plain" else None
            w = weight if mode == "norm" else None
            y, ro, rstd = _sim_call(kar, shards[rank], res, w, peer_bases, ctl, rank, algo, space,
                                    cfg)  # fmt: skip
            ref_y, ref_ro = allreduce_add_rmsnorm_shards_ref(shards, res, w, 1e-6)
            # fp32: exact (same order of fp32 additions); bf16/fp16: the interpreter truncates
            # fp32 → bf16 instead of rounding, so allow one ulp
            tol = 0.0 if dtype == torch.float32 else 2.0**-6
            torch.testing.assert_close(ro.float(), ref_ro.float(), atol=tol * 8, rtol=tol)
            if w is not None:
                torch.testing.assert_close(y.float(), ref_y.float(), atol=tol * 8 + 1e-6, rtol=tol)
                assert torch.isfinite(rstd).all()
            results[f"{i}-{mode}-ro"] = ro
            if y is not None:
                results[f"{i}-{mode}-y"] = y
    results["epochs"] = ctl.clone()
    # every Lamport launch handed its slots back: the region is all sentinel (zero) again
    region = bufs[rank][space.lamport_offset :].view(torch.int16)
    results["lamport_clean"] = torch.tensor(bool((region == kar.LAMPORT_SENTINEL_BITS).all()))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.dist
def test_symmetric_kernel_in_interpreter(interpret):
    if not interpret:
        pytest.skip("runs the cross-rank kernel in Triton's interpreter (TRITON_INTERPRET=1)")
    d = tempfile.mkdtemp()
    try:
        paths = []
        for r in range(WORLD):  # zeroed, like a new SymmetricPool
            p = os.path.join(d, f"buf{r}")
            with open(p, "wb") as f:
                f.write(b"\0" * _sim_nbytes())
            paths.append(p)
        mp.spawn(_worker_sim, args=(os.path.join(d, "store"), paths, d), nprocs=WORLD)
        outs = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
        for key in outs[0]:
            assert torch.equal(outs[0][key], outs[1][key]), f"ranks differ on {key}"
        # one launch epoch per launch (16 cases × 3 modes); the arrival counter is back at 0
        assert outs[0]["epochs"].tolist() == [3 * len(_SIM_CASES), 0]
        assert all(bool(o["lamport_clean"]) for o in outs)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_workspace_layout():
    from moekit.kernels import allreduce as kar

    assert kar.workspace(kar.SIGNAL_BYTES - 1, 2, 1024) is None
    small = kar.workspace(kar.SIGNAL_BYTES + 4096, 2, 4 << 20)  # no room for Lamport slots
    assert (small.half_bytes, small.lamport_slot_bytes) == (2048, 0)
    assert small.fits(1, 512, 2, "one_shot", 2) and not small.fits(2, 1024, 2, "one_shot", 2)
    assert not small.lamport_fits(1, 8, 2, "lamport", 2)
    nbytes = kar.SIGNAL_BYTES + (1 << 20) + 2 * 2 * 768
    space = kar.workspace(nbytes, 2, 1000)  # the slot is rounded down to 768 B
    assert space == kar.Workspace(1 << 19, kar.SIGNAL_BYTES + (1 << 20), 768)
    assert space.lamport_fits(1, 384, 2, "lamport", 2)
    assert not space.lamport_fits(1, 392, 2, "lamport", 2)
    assert not space.lamport_fits(1, 8, 4, "lamport", 2)  # fp32: no bit pattern to spare
    assert space.lamport_fits(2, 192, 2, "lamport_two_shot", 2)
    assert not space.lamport_fits(3, 192, 2, "lamport_two_shot", 2)


# ----------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): a group of one, and two gloo ranks (reference / nccl paths)
# ----------------------------------------------------------------------------------------------


def _compile_check(fn, inputs, grad_out, backend) -> None:
    torch._dynamo.reset()
    eager = fn(*inputs)
    want = torch.autograd.grad(eager, inputs, grad_out)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got_out = compiled(*inputs)
    got = torch.autograd.grad(got_out, inputs, grad_out)
    torch.testing.assert_close(got_out, eager, atol=1e-5, rtol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def _compiled_ops_check(algo: str | None, device: str = "cpu", backend: str = "aot_eager") -> None:
    from moekit.ops.allreduce import allreduce, allreduce_add, allreduce_add_rmsnorm

    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g)
    w = 1 + 0.1 * torch.randn(16, generator=g)
    dy = torch.randn(12, 16, generator=g).to(device)
    x, r, w = (t.to(device).requires_grad_() for t in (x, r, w))
    kw = {} if algo is None else {"algo": algo}
    fns = (
        (lambda x, r, w: torch.cat(allreduce_add_rmsnorm(x, r, w, **kw)), (x, r, w), dy),
        (lambda x, r: allreduce_add(x, r, **kw), (x, r), dy[:6]),
        (lambda x: allreduce(x, **kw) * 2, (x,), dy[:6]),
    )
    for fn, inputs, grad_out in fns:
        _compile_check(fn, inputs, grad_out, backend)


def _worker_compile(rank: int, store: str) -> None:
    from moekit.ops.allreduce import allreduce_add_rmsnorm_op

    _init(rank, store)
    try:
        for algo in ("reference", "nccl"):
            _compiled_ops_check(algo)
        # the kernel op's schema and fake implementation (every rank makes the same calls)
        x, r, w = torch.randn(5, 16), torch.randn(5, 16), torch.ones(16)
        for args in ((x, r, w, 1e-6, "0", "nccl", True), (x, None, None, 0.0, "0", "auto", False)):
            torch.library.opcheck(allreduce_add_rmsnorm_op.op, args)
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_torch_compile_fullgraph_two_ranks():
    _spawn(_worker_compile)


def _group_of_one(check) -> None:
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/s", rank=0, world_size=1)
        try:
            check()
        finally:
            dist.destroy_process_group()


def test_torch_compile_fullgraph_group_of_one():
    _group_of_one(lambda: _compiled_ops_check(None))


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph_group_of_one():
    _group_of_one(lambda: _compiled_ops_check("one_shot", "cuda", "inductor"))


# ----------------------------------------------------------------------------------------------
# GPU: the full check script under torchrun (2+ GPUs)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.dist
def test_gpu_allreduce_check_torchrun():
    run_gpu_check_under_torchrun("gpu_allreduce_check.py", "ALL CHECKS PASSED")
