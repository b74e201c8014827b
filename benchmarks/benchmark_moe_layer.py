"""MoELayer forward + backward against the torch-native MoE and a per-expert loop.

    python benchmarks/benchmark_moe_layer.py --out bench_out [--quick] [--smoke] [--autocast]
    torchrun --nproc_per_node=N benchmarks/benchmark_moe_layer.py --ep N --out bench_out

One GPU, Qwen3-30B-A3B / OLMoE / DeepSeek-V3 (one EP8 rank) / Mixtral sizes, bf16, skewed
routing, aux loss on. Contenders: moekit (also recomputing the activation), torch
(torch_moe.py), loop (not with --quick): do_bench median, best of interleaved rounds, and a CUDA
graph of 5 calls. Ceiling: 18·T·k·H·F FLOPs at this run's dense torch.mm rate. The router alone
against the torch composition and a kernel-less autograd floor. --autocast: fp32 parameters
under bf16 autocast against the bf16 layer, the torch MoE with the same casts and the casts'
byte floor. --ep N: tokens/s per GPU (slowest rank, fixed call counts) of moekit's modes
against torch with all_to_all_single, the exchange alone (GB/s against the GPU1→GPU0 copy
rate) and --ep-baseline scaling (run_moe_ep.sh). Writes moe_layer.json (moe_layer_ep<N>.json).
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import common as bc
import torch
from torch_moe import loop_moe, torch_ep_moe, torch_moe, torch_topk_routing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.nn import DispatchConfig, ExpertParallelConfig, MoELayer
from moekit.ops.router import RouterConfig, route

DSV3 = dict(score="sigmoid", num_groups=8, topk_groups=4, expert_bias=True, scaling=2.5)
# name: (tokens T, experts E, top-k, H, F, router options, speed-up target over torch)
SHAPES = {
    "qwen3_30b_a3b": (16384, 128, 8, 2048, 768, {}, 2.0),
    "olmoe": (8192, 64, 8, 2048, 1024, {}, 2.0),
    "deepseek_v3_ep8": (8192, 32, 8, 7168, 2048, DSV3, 1.4),
    "mixtral": (8192, 8, 2, 4096, 14336, {}, 1.15),
}
EP_SHAPES = {
    "qwen3_30b_a3b": (16384, 128, 8, 2048, 768, {}, None),
    "deepseek_v3": (8192, 256, 8, 7168, 2048, DSV3, None),
}
SMOKE_SHAPES = {
    "smoke_softmax": (48, 8, 2, 32, 16, {}, None),
    "smoke_groups": (40, 16, 4, 32, 16, dict(DSV3, num_groups=4, topk_groups=2), None),
}
QWEN3_TFLOPS_TARGET = 520.0
ROUTER_TARGET = 3.0
ROUTER_ROUNDS = 5
AUX_LOSS_COEFF = 1e-2
CAPACITY_FACTOR = 1.25


def make_layer(T, E, k, H, Fd, opts, device, dtype, seed, ep_group=None, capacity=None,
               ep_config=None):  # fmt: skip
    """The layer (all E experts, or this rank's share), its input and output gradient. The
    router leans towards some experts along one direction of the input, so the routing is
    skewed the same way for every contender."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layer = MoELayer(
        H, Fd, E, k, router=RouterConfig(aux_loss_coeff=AUX_LOSS_COEFF, **opts),
        ep_group=ep_group, dispatch=DispatchConfig(capacity), ep_config=ep_config, device=device,
        dtype=dtype,
    )  # fmt: skip
    with torch.no_grad():
        u = torch.randn(H, generator=gen)
        u /= u.norm()
        lean = 0.5 * torch.randn(E, generator=gen)
        w = torch.randn(E, H, generator=gen) * H**-0.5 + lean[:, None] * u[None, :]
        layer.router.weight.copy_(w)
        dgen = torch.Generator(device=device).manual_seed(seed)
        for p in (layer.experts.fc1_weight, layer.experts.fc2_weight):
            for e in range(p.shape[0]):  # one expert at a time: no fp32 copy of them all
                p[e].copy_(torch.randn(p.shape[1:], device=device, generator=dgen))
            p.mul_(p.shape[-1] ** -0.5)
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(0.01 * torch.randn(E, generator=gen))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        rank_gen = torch.Generator(device="cpu").manual_seed(seed + 1000 * (rank + 1))
        x = torch.randn(T, H, generator=rank_gen) + 2.0 * u
        dy = torch.randn(T, H, generator=rank_gen) * T**-0.5
    x = x.to(device, dtype).requires_grad_()
    return layer, x, dy.to(device, dtype)


def route_opts(layer: MoELayer) -> dict:
    r = layer.router
    return dict(r.config.routing_kwargs(), expert_bias=r.expert_bias)


def steps(layer, x, dy, with_loop: bool, ep_group=None) -> dict:
    """Each contender's forward + backward over the same weights."""
    params = [layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]
    ins = [x, *params]
    k, opts = layer.k, route_opts(layer)

    def moekit():
        return torch.autograd.grad(layer(x), ins, dy)

    def baseline(fn, *extra):
        def step():
            y, aux = fn(x, *params, k, *extra, aux_loss_coeff=AUX_LOSS_COEFF, **opts)
            return torch.autograd.grad([y, aux], ins, [dy, torch.ones_like(aux)])

        return step

    def moekit_recompute():  # the experts recompute their activation in backward
        layer.experts.recompute_activation = True
        try:
            return moekit()
        finally:
            layer.experts.recompute_activation = False

    if ep_group is not None:
        return {"moekit": moekit, "torch": baseline(torch_ep_moe, ep_group)}
    out = {"moekit": moekit, "moekit_recompute": moekit_recompute, "torch": baseline(torch_moe)}
    if with_loop:
        out["loop"] = baseline(loop_moe)
    return out


class RouterFloor(torch.autograd.Function):
    """The router's signature with no kernels: what any custom autograd op taking the logits
    and returning probs, indices and counts pays on the host (Function.apply, the engine's
    backward call, allocations) — the floor under the router's eager time."""

    @staticmethod
    def forward(ctx, logits, k):
        ctx.meta = logits
        T = logits.shape[0]
        idx = logits.new_empty(T, k, dtype=torch.int32)
        ctx.mark_non_differentiable(idx)
        return logits.new_empty(T, k, dtype=torch.float32), idx

    @staticmethod
    def backward(ctx, grad, _):
        return torch.empty_like(ctx.meta), None


def router_steps(T, E, k, opts, device, dtype) -> dict:
    """The router alone after the logits GEMM: top-k routing forward + backward."""
    logits = torch.randn(T, E, device=device, dtype=dtype, requires_grad=True)
    bias = 0.01 * torch.randn(E, device=device) if opts.get("expert_bias") else None
    kw = {n: v for n, v in opts.items() if n != "expert_bias"}
    dp = torch.randn(T, k, device=device)

    def moekit():
        p, _i, _c = route(logits, k, RouterConfig(**kw), bias)
        return torch.autograd.grad(p, logits, dp)

    def torch_composition():
        p = torch_topk_routing(logits, k, expert_bias=bias, **kw)[0]
        return torch.autograd.grad(p, logits, dp)

    def floor():
        return torch.autograd.grad(RouterFloor.apply(logits, k)[0], logits, dp)

    return {"moekit": moekit, "torch": torch_composition, "floor": floor}


def routing_stats(layer: MoELayer, x: torch.Tensor) -> dict:
    with torch.no_grad():
        counts = layer.router(x.detach()).counts.float()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
    return {
        "max_over_mean_load": float(counts.max() / counts.mean()),
        "idle_experts": int((counts == 0).sum()),
    }


def run_shape(name, spec, args, cuda, device, peak_tflops) -> dict:
    T, E, k, H, Fd, opts, target = spec
    res = {"shape": name, "T": T, "E": E, "k": k, "H": H, "F": Fd, "router": dict(opts),
           "target": target}  # fmt: skip
    ms = bc.eager_timer(cuda, warmup=10, rep=60 if args.quick else 150)
    rounds = 1 if args.quick else 3
    layer, x, dy = make_layer(T, E, k, H, Fd, opts, device, args.dtype, seed=0)
    res.update(routing_stats(layer, x))
    fns = steps(layer, x, dy, with_loop=not args.quick)
    for fn in fns.values():
        fn()  # compile, tune, warm the allocator
    bc.measure(fns, {"ms": ms}, rounds, res)
    for c in fns:
        res[f"{c}_peak_mib"] = bc.peak_mib(fns[c], cuda) if c != "loop" else math.nan
    if cuda:
        bc.measure({c: fns[c] for c in ("moekit", "torch")}, {"graph_ms": _graph5}, 1, res)
    flops = 18 * T * k * H * Fd
    res["moekit_tflops"] = flops / res["moekit_ms"] / 1e9
    res["floor_ms"] = flops / peak_tflops / 1e9 if cuda else math.nan
    bc.ratios(
        res, "ms", {"speedup_vs_torch": ("torch", "moekit"), "speedup_vs_loop": ("loop", "moekit")}
    )
    del layer, x, dy, fns
    rf = router_steps(T, E, k, opts, device, args.dtype)
    for fn in rf.values():
        fn()
    # Host-bound calls: their time moves with the host from round to round, so the speed-up is
    # the median of the ratios taken within a round (both timed back to back), over 5 rounds.
    rr = bc.measure(rf, {"us": lambda f: ms(f) * 1e3}, 1 if args.quick else ROUTER_ROUNDS)
    if cuda:
        bc.measure({c: rf[c] for c in ("moekit", "torch")}, {"graph_us": bc.graph_us}, 1, rr)
    bc.ratios(rr, "us", {"speedup": ("torch", "moekit")})
    bc.ratios(rr, "graph_us", {"graph_speedup": ("torch", "moekit")})
    res.update({f"router_{k_}": v for k_, v in rr.items()})
    if args.autocast:
        res.update(autocast_figures(spec, args, cuda, device, ms))
    return res


def _graph5(fn) -> float:
    return bc.graph_us(fn, calls=5) / 1e3


def autocast_figures(spec, args, cuda, device, time_fn) -> dict:
    """fp32 parameters under bf16 autocast: moekit's layer (casts per call inside its ops),
    the torch-native MoE with the same casts written out, and the bf16 layer as the
    reference; the casts' byte floor at the measured copy rate (see the module docstring)."""
    T, E, k, H, Fd, opts, _ = spec
    low = torch.bfloat16
    layer, x, dy = make_layer(T, E, k, H, Fd, opts, device, torch.float32, seed=0)
    bf16 = copy.deepcopy(layer).to(low)
    xb, dyb = x.detach().to(low).requires_grad_(), dy.to(low)
    params = [layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]
    ins, kopts = [x, *params], route_opts(layer)

    def moekit_autocast():
        with torch.autocast(device.split(":")[0], dtype=low):
            y = layer(x)
        return torch.autograd.grad(y, ins, dy)

    def torch_autocast():
        cast = [p.to(low) for p in params]
        y, aux = torch_moe(x.to(low), *cast, k, aux_loss_coeff=AUX_LOSS_COEFF, **kopts)
        return torch.autograd.grad([y.float(), aux], ins, [dy, torch.ones_like(aux)])

    def moekit_bf16():
        return torch.autograd.grad(bf16(xb), [xb, *bf16.parameters()], dyb)

    fns = {"moekit_autocast": moekit_autocast, "torch_autocast": torch_autocast,
           "moekit_bf16": moekit_bf16}  # fmt: skip
    for fn in fns.values():
        fn()
    res = bc.measure(fns, {"ms": time_fn}, 1 if args.quick else 3)
    res["autocast_speedup_vs_torch"] = res["torch_autocast_ms"] / res["moekit_autocast_ms"]
    res["autocast_overhead_ms"] = res["moekit_autocast_ms"] - res["moekit_bf16_ms"]
    res["autocast_cast_bytes"] = sum(p.numel() for p in params) * (4 + 2 + 2)
    rate = bc.copy_gb_per_s(device) if cuda else math.nan
    res["autocast_cast_floor_ms"] = res["autocast_cast_bytes"] / (rate * 1e6)
    return {k_: v for k_, v in res.items() if not k_.endswith("_rounds")}


EP_CALLS = 20  # timed calls per contender and round: a fixed count on every rank


def run_ep_shape(name, spec, args, device) -> dict:
    """One shape at EP W: tokens/s per GPU of every contender (the slowest rank's time), the
    exchange alone (GB/s per GPU of the bytes that cross NVLink) and its share of the step."""
    import torch.distributed as dist

    T, E, k, H, Fd, opts, _ = spec
    W = dist.get_world_size()
    group = dist.group.WORLD if W > 1 else None
    res = {"shape": name, "T_per_rank": T, "E": E, "k": k, "H": H, "F": Fd, "ep": W}
    time_fn = lambda f: _over_ranks(bc.fixed_count_ms(f, warmup=3, calls=EP_CALLS))
    fns, layers = {}, {}
    modes = [("moekit", None, "auto", None), ("moekit_capacity", CAPACITY_FACTOR, "auto", None)]
    if W > 1:  # and the overlapped chunk counts asked for
        modes.append(("moekit_all_to_all", None, "all_to_all", None))
        modes += [(f"moekit_chunks{c}", None, "auto", c) for c in args.ep_chunks if c > 1]
    first = None
    for mode, cf, backend, chunks in modes:
        config = ExpertParallelConfig(backend, chunks=chunks) if group is not None else None
        if first is None:
            layer, x, dy = make_layer(T, E, k, H, Fd, opts, device, args.dtype, 0, group, cf,
                                      config)  # fmt: skip
            first = layer
        else:  # the same parameters (one copy of the experts in memory)
            layer = MoELayer(
                H, Fd, E, k, router=RouterConfig(aux_loss_coeff=AUX_LOSS_COEFF, **opts),
                ep_group=group, dispatch=DispatchConfig(cf), ep_config=config, device="meta",
                dtype=args.dtype,
            )  # fmt: skip
            layer.router, layer.experts = first.router, first.experts
        contenders = steps(layer, x, dy, False, group)
        fns[mode], layers[mode] = contenders["moekit"], (layer, x)
        if mode == "moekit":
            res.update(routing_stats(layer, x))
            fns["torch"] = contenders["torch"]
    for fn in fns.values():
        fn()
    if group is not None:
        res["backend"] = layers["moekit"][0].ep.last_exchanges[0].backend
    bc.measure(fns, {"ms": time_fn}, 2, res)
    for c in fns:
        res[f"{c}_tokens_per_s"] = T / res[f"{c}_ms"] * 1e3
        res[f"{c}_peak_mib"] = bc.peak_mib(fns[c], True)
    res["speedup_vs_torch"] = res["torch_ms"] / res["moekit_ms"]
    if group is not None:
        res.update(_exchange_figures(*layers["moekit"], group))
        res["exchange_kernel_share"] = _exchange_share(fns["moekit"])
        res["exchange_share"] = res["exchange_step_ms"] / res["moekit_ms"]
        # exposed exchange of a chunked step: its time over the experts' alone (the one-chunk
        # step less its exchange), as a share of the exchange's time (one chunk: 1)
        compute_ms = res["moekit_ms"] - res["exchange_step_ms"]
        for c in args.ep_chunks:
            if f"moekit_chunks{c}_ms" in res:
                exposed = max(0.0, res[f"moekit_chunks{c}_ms"] - compute_ms)
                res[f"chunks{c}_exposed_share"] = exposed / res["exchange_step_ms"]
    return res


def _exchange_figures(layer, x, group) -> dict:
    """The layer's exchange alone, on its own routing: dispatch + combine forward (the backward
    moves the same bytes the other way). GB/s per GPU counts the bytes each rank reads from
    its peers (its own tokens excluded), over the slowest rank's time."""
    import torch.distributed as dist

    from moekit.ops.expert_exchange import ExpertExchange

    with torch.no_grad():
        r = layer.router(x.detach())

    def exchange():
        ex = ExpertExchange(r.indices, layer.num_experts, group, layer.ep.max_tokens, "auto")
        rows, _, _ = ex.dispatch(x.detach(), r.probs)
        return ex.combine(rows), ex

    _, ex = exchange()
    ms = _over_ranks(bc.fixed_count_ms(lambda: exchange(), warmup=3, calls=EP_CALLS))
    rank, W, gpu_ms = dist.get_rank(), dist.get_world_size(), ms
    if ex.backend == "symmetric":  # the GPU's own time: alone, its small launches are host-bound
        gpu_ms = _over_ranks(bc.graph_us(lambda: exchange()[0], 5, fixed_count=True) / 1e3)
        table = ex.table.long()
    else:  # the counts, all-gathered
        table = torch.empty(W, W, dtype=torch.long, device=x.device)
        dist.all_gather_into_tensor(table, ex.routes.sends.long(), group=group)
    remote = table[:, rank].sum() + table[rank].sum() - 2 * table[rank, rank]  # rows in + out
    mean_bytes = _over_ranks(float(remote) * x.shape[1] * x.element_size(), "AVG")
    tokens = _over_ranks(float(x.shape[0]), "SUM")  # ranks_per_token: over every rank's tokens
    return {"exchange_fwd_eager_ms": ms, "exchange_fwd_ms": gpu_ms,
            "exchange_step_ms": 2 * gpu_ms,  # forward and backward move the same bytes
            "exchange_gb_per_s": mean_bytes / gpu_ms / 1e6,
            "exchange_eager_gb_per_s": mean_bytes / ms / 1e6,
            "ranks_per_token": float(table.sum()) / tokens}  # fmt: skip


def _exchange_share(fn) -> float:
    """Share of the step's GPU kernel time in the exchange's kernels (NCCL or moekit's)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = ex = 0.0
    for e in prof.key_averages():
        t = e.device_time_total
        total += t
        key = e.key.lower()
        if any(n in key for n in ("nccl", "_pull_", "_exchange_barrier", "_copy_rows")):
            ex += t
    return ex / total if total else math.nan


def _over_ranks(v: float, op: str = "MAX") -> float:
    """``v`` reduced over the ranks (MAX, SUM, or AVG as SUM / world size)."""
    import torch.distributed as dist

    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op))
    return float(t) / (dist.get_world_size() if op == "AVG" else 1)


def p2p_copy_gb_per_s(nbytes: int = 1 << 30) -> float:
    """GPU1→GPU0 copy rate of this host (copy engines over NVLink), GB/s moved, timed on rank 0
    (median of 10 copies between CUDA events): the ceiling of one peer-to-peer stream."""
    import torch.distributed as dist

    t = torch.tensor([math.nan], device="cuda", dtype=torch.float64)
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:1").normal_()
        dst = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:0")
        torch.cuda.synchronize(1)
        t.fill_(nbytes / bc.fixed_count_ms(lambda: dst.copy_(src), warmup=3, calls=10) / 1e6)
    dist.broadcast(t, 0)
    return float(t)


def main_ep(args) -> None:
    import torch.distributed as dist

    from moekit.distributed import init_distributed

    W = init_distributed("nccl").world_size  # one GPU per rank; --ep 1: no torchrun needed
    if args.ep != W:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} processes, got {W}")
    p2p = p2p_copy_gb_per_s() if W > 1 else math.nan
    rows = []
    for name, spec in EP_SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        rows.append({**run_ep_shape(name, spec, args, "cuda"), "p2p_copy_gb_per_s": p2p})
        if dist.get_rank() == 0:
            bc.log(json.dumps(rows[-1]))
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        scaling(rows, args.ep_baseline)
        bc.log(f"EP{W}: tokens/s per GPU (forward + backward), {torch.cuda.get_device_name()}; "
               f"GPU1→GPU0 copy {p2p:.0f} GB/s")  # fmt: skip
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ep": W,
                "p2p_copy_gb_per_s": p2p}  # fmt: skip
        bc.finish(args.out, f"moe_layer_ep{W}", {"meta": meta, "rows": rows}, EP_COLUMNS)
    dist.destroy_process_group()


def scaling(rows: list[dict], baseline: str | None) -> None:
    """tokens/s per GPU over the EP 1 run's (its JSON rows' ``moekit_tokens_per_s``)."""
    base = {}
    if baseline:
        with open(baseline) as f:
            base = {r["shape"]: r for r in json.load(f)["rows"]}
    for r in rows:
        b = base.get(r["shape"])
        for c in ("moekit", "moekit_capacity"):
            r[f"{c}_scaling"] = r[f"{c}_tokens_per_s"] / b["moekit_tokens_per_s"] if b else math.nan


EP_COLUMNS = [
    "shape", ("moekit", "moekit_tokens_per_s"), ("capacity", "moekit_capacity_tokens_per_s"),
    ("a2a", "moekit_all_to_all_tokens_per_s"), ("torch", "torch_tokens_per_s"),
    ("×torch", "speedup_vs_torch"), ("scaling", "moekit_scaling"),
    ("cap sc.", "moekit_capacity_scaling"), ("xchg GB/s", "exchange_gb_per_s"),
    ("p2p GB/s", "p2p_copy_gb_per_s"), ("xchg share", "exchange_share"),
    ("peak MiB", "moekit_peak_mib"),
]  # fmt: skip
COLUMNS = [
    "shape", ("load", "max_over_mean_load"), ("moekit ms", "moekit_ms"), ("torch ms", "torch_ms"),
    ("loop ms", "loop_ms"), ("× torch", "speedup_vs_torch"), "target",
    ("TFLOP/s", "moekit_tflops"), ("floor ms", "floor_ms"), ("graph m", "moekit_graph_ms"),
    ("graph t", "torch_graph_ms"), ("MiB m", "moekit_peak_mib"), ("MiB t", "torch_peak_mib"),
    ("MiB recomp", "moekit_recompute_peak_mib"), ("router µs m", "router_moekit_us"),
    ("t", "router_torch_us"), ("floor", "router_floor_us"), ("×", "router_speedup"),
    ("graph ×", "router_graph_speedup"), ("autocast ×", "autocast_speedup_vs_torch"),
    ("autocast overhead ms", "autocast_overhead_ms"), ("cast floor ms", "autocast_cast_floor_ms"),
]  # fmt: skip


def main() -> None:
    ap = bc.parser(__doc__, quick="one round, no per-expert loop")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--autocast", action="store_true", help="also fp32 params under autocast")
    ap.add_argument("--ep", type=int, default=None, help="expert parallelism (torchrun)")
    ap.add_argument("--ep-baseline", default=None, help="the --ep 1 JSON, for scaling")
    ap.add_argument("--ep-chunks", type=int, nargs="*", default=[],
                    help="also time the layer in these many overlapped chunks")  # fmt: skip
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.ep is not None:
        return main_ep(args)
    device = "cuda" if cuda else "cpu"
    peak_tflops = bc.DensePeak().tflops() if cuda else math.nan
    bc.log(f"dense torch.mm peak: {peak_tflops:.0f} TFLOP/s")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    cases = [(n, lambda n=n, s=s: run_shape(n, s, args, cuda, device, peak_tflops))
             for n, s in shapes.items() if not args.shapes or n in args.shapes]  # fmt: skip
    rows, _, failed = bc.run_cases(cases)
    meta = {"device": bc.device_name(cuda), "torch": torch.__version__, "dtype": str(args.dtype),
            "dense_tflops": peak_tflops, "aux_loss_coeff": AUX_LOSS_COEFF, "failed": failed}  # fmt: skip
    series = {"MoELayer": "speedup_vs_torch", "router alone": "router_speedup",
              "MoELayer, fp32 params under autocast": "autocast_speedup_vs_torch"}  # fmt: skip
    panel = bc.bars(rows, series, "speed-up over torch-native (fwd+bwd)", hlines={"parity": 1.0})
    bc.finish(args.out, "moe_layer", {"meta": meta, "rows": rows}, COLUMNS, [panel])


if __name__ == "__main__":
    main()
