"""MoELayer forward + backward against the torch-native MoE and a per-expert loop.

    python benchmarks/benchmark_moe_layer.py --out bench_out [--quick] [--smoke] [--autocast]
    python benchmarks/benchmark_moe_layer.py --fp8 --out bench_out
    torchrun --nproc_per_node=N benchmarks/benchmark_moe_layer.py --ep N --out bench_out

Real MoE sizes, bf16, skewed routing, aux loss on: moekit (and its recompute / regather modes),
torch (torch_moe.py), loop: do_bench, best of rounds in turns, a CUDA graph of 5 calls, ceiling
at this run's torch.mm rate; the router alone. --autocast: fp32 params under bf16 autocast;
--fp8: FP8 experts against bf16; --ep N: tokens/s per GPU against torch with all_to_all_single.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from functools import partial
from unittest import mock

import common as bc
import torch
import torch.distributed as dist
from torch_moe import loop_moe, torch_ep_moe, torch_moe, torch_topk_routing

from moekit import Fp8Recipe
from moekit.distributed import init_distributed
from moekit.nn import DispatchConfig, ExpertParallelConfig, MoELayer
from moekit.ops.expert_exchange import ExpertExchange
from moekit.ops.router import RouterConfig, route

DSV3 = dict(score="sigmoid", num_groups=8, topk_groups=4, expert_bias=True, scaling=2.5)
# name: (tokens T, experts E, top-k, H, F, router options, speed-up target over torch)
SHAPES = {"qwen3_30b_a3b": (16384, 128, 8, 2048, 768, {}, 2.0),
          "olmoe": (8192, 64, 8, 2048, 1024, {}, 2.0),
          "deepseek_v3_ep8": (8192, 32, 8, 7168, 2048, DSV3, 1.4),
          "mixtral": (8192, 8, 2, 4096, 14336, {}, 1.15)}  # fmt: skip
EP_SHAPES = {"qwen3_30b_a3b": (16384, 128, 8, 2048, 768, {}, None),
             "deepseek_v3": (8192, 256, 8, 7168, 2048, DSV3, None)}  # fmt: skip
SMOKE_SHAPES = {"smoke_softmax": (48, 8, 2, 32, 16, {}, None), "smoke_groups": (
    40, 16, 4, 32, 16, dict(DSV3, num_groups=4, topk_groups=2), None)}  # fmt: skip
ROUTER_ROUNDS = 5
AUX_LOSS_COEFF = 1e-2
CAPACITY_FACTOR = 1.25
EP_CALLS = 20  # timed calls per contender and round: a fixed count on every rank


def new_layer(spec, **kw) -> MoELayer:
    _, E, k, H, Fd, opts, _ = spec
    return MoELayer(H, Fd, E, k, router=RouterConfig(aux_loss_coeff=AUX_LOSS_COEFF, **opts), **kw)


def make_layer(T, E, k, H, Fd, opts, device, dtype, seed, ep_group=None, capacity=None,
               ep_config=None):  # fmt: skip
    """The layer (all E experts, or this rank's share), its input and output gradient; the router
    leans towards some experts along one input direction (the same skew for every contender)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layer = new_layer((T, E, k, H, Fd, opts, None), ep_group=ep_group, ep_config=ep_config,
                      dispatch=DispatchConfig(capacity), device=device, dtype=dtype)  # fmt: skip
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
        rank = dist.get_rank() if dist.is_initialized() else 0
        rank_gen = torch.Generator(device="cpu").manual_seed(seed + 1000 * (rank + 1))
        x = torch.randn(T, H, generator=rank_gen) + 2.0 * u
        dy = torch.randn(T, H, generator=rank_gen) * T**-0.5
    x = x.to(device, dtype).requires_grad_()
    return layer, x, dy.to(device, dtype)


def route_opts(layer: MoELayer) -> dict:
    return dict(layer.router.config.routing_kwargs(), expert_bias=layer.router.expert_bias)


def steps(layer, x, dy, with_loop: bool, ep_group=None) -> dict:
    """Each contender's forward + backward over the same weights."""
    params = [layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]
    ins, k, opts = [x, *params], layer.k, route_opts(layer)
    moekit = lambda: torch.autograd.grad(layer(x), ins, dy)
    grad = lambda y, aux: torch.autograd.grad([y, aux], ins, [dy, torch.ones_like(aux)])
    baseline = lambda fn, *extra: lambda: grad(*fn(x, *params, k, *extra,
                                                    aux_loss_coeff=AUX_LOSS_COEFF, **opts))  # fmt: skip
    if ep_group is not None:
        return {"moekit": moekit, "torch": baseline(torch_ep_moe, ep_group)}
    # in backward the experts recompute their activation / gather their input rows again
    recompute = mock.patch.object(layer.experts, "recompute_activation", True)
    regather = dataclasses.replace(layer.dispatch, recompute_rows=True)
    out = {"moekit": moekit, "moekit_recompute": recompute(moekit),
           "moekit_regather": mock.patch.object(layer, "dispatch", regather)(moekit),
           "torch": baseline(torch_moe)}  # fmt: skip
    if with_loop:
        out["loop"] = baseline(loop_moe)
    return out


class RouterFloor(torch.autograd.Function):
    """The router's signature without kernels: the host floor under the router's eager time."""

    @staticmethod
    def forward(ctx, logits, k):
        ctx.meta = logits
        idx = logits.new_empty(logits.shape[0], k, dtype=torch.int32)
        ctx.mark_non_differentiable(idx)
        return logits.new_empty(idx.shape, dtype=torch.float32), idx

    @staticmethod
    def backward(ctx, grad, _):
        return torch.empty_like(ctx.meta), None


def router_steps(T, E, k, opts, device, dtype) -> dict:
    """The router alone after the logits GEMM: top-k routing forward + backward."""
    logits = torch.randn(T, E, device=device, dtype=dtype, requires_grad=True)
    bias = 0.01 * torch.randn(E, device=device) if opts.get("expert_bias") else None
    kw = {n: v for n, v in opts.items() if n != "expert_bias"}
    dp = torch.randn(T, k, device=device)
    grad = lambda fwd: lambda: torch.autograd.grad(fwd()[0], logits, dp)  # of the probs
    return {"moekit": grad(lambda: route(logits, k, RouterConfig(**kw), bias)),
            "torch": grad(lambda: torch_topk_routing(logits, k, expert_bias=bias, **kw)),
            "floor": grad(lambda: RouterFloor.apply(logits, k))}  # fmt: skip


def routing_stats(layer: MoELayer, x: torch.Tensor) -> dict:
    with torch.no_grad():
        counts = layer.router(x.detach()).counts.float()
        if dist.is_initialized():
            dist.all_reduce(counts)
    return {"max_over_mean_load": float(counts.max() / counts.mean()),
            "idle_experts": int((counts == 0).sum())}  # fmt: skip


def run_shape(name, spec, args, cuda, device, peak_tflops) -> dict:
    T, E, k, H, Fd, opts, target = spec
    ms = bc.eager_timer(cuda, warmup=10, rep=60 if args.quick else 150)
    layer, x, dy = make_layer(*spec[:6], device, args.dtype, 0)
    res = {"shape": name, "T": T, "E": E, "k": k, "H": H, "F": Fd, "router": dict(opts),
           "target": target, **routing_stats(layer, x)}  # fmt: skip
    fns = steps(layer, x, dy, with_loop=not args.quick)
    bc.measure(fns, {"ms": ms}, 1 if args.quick else 3, res, warm=True)
    for c in fns:
        res[f"{c}_peak_mib"] = bc.peak_mib(fns[c], cuda) if c != "loop" else math.nan
    if cuda:
        graph5 = {"graph_ms": lambda f: bc.graph_us(f, calls=5) / 1e3}
        bc.measure({c: fns[c] for c in ("moekit", "torch")}, graph5, 1, res)
    flops = 18 * T * k * H * Fd
    res["moekit_tflops"] = flops / res["moekit_ms"] / 1e9
    res["floor_ms"] = flops / peak_tflops / 1e9 if cuda else math.nan
    bc.ratios(res, "ms", {"speedup_vs_torch": ("torch", "moekit"),
                          "speedup_vs_loop": ("loop", "moekit"),
                          "regather_time_ratio": ("moekit_regather", "moekit")})  # fmt: skip
    del layer, x, dy, fns
    rf, us = router_steps(T, E, k, opts, device, args.dtype), lambda f: ms(f) * 1e3
    # host-bound calls drift between rounds: the speed-up is the median of within-round ratios
    rr = bc.measure(rf, {"us": us}, 1 if args.quick else ROUTER_ROUNDS, warm=True)
    if cuda:
        bc.measure({c: rf[c] for c in ("moekit", "torch")}, {"graph_us": bc.graph_us}, 1, rr)
    bc.ratios(rr, "us", {"speedup": ("torch", "moekit")})
    bc.ratios(rr, "graph_us", {"graph_speedup": ("torch", "moekit")})
    res.update({f"router_{k_}": v for k_, v in rr.items()})
    for on, figures in ((args.autocast, autocast_figures), (args.fp8, fp8_figures)):
        res.update(figures(spec, args, cuda, device, ms) if on else {})
    return res


def fp8_figures(spec, args, cuda, device, time_fn) -> dict:
    """The FP8 layer against the bf16 layer (both align 128, the same weights): time, peak
    memory, and the quantization kernels of one forward + backward."""
    layer, x, dy = make_layer(*spec[:6], device, args.dtype, 0)
    layer.dispatch = DispatchConfig(align=128)
    fp8 = new_layer(spec, fp8=Fp8Recipe(), device="meta", dtype=args.dtype)
    fp8.router, e = layer.router, layer.experts
    fp8.experts.fc1_weight, fp8.experts.fc2_weight = e.fc1_weight, e.fc2_weight
    fns = {"bf16_align128": steps(layer, x, dy, False)["moekit"],
           "fp8": steps(fp8, x, dy, False)["moekit"]}  # fmt: skip
    res = bc.measure(fns, {"ms": time_fn}, 1 if args.quick else 3, warm=True)
    bc.measure(fns, {"peak_mib": partial(bc.peak_mib, cuda=cuda)}, 1, res)
    res["fp8_speedup"] = res["bf16_align128_ms"] / res["fp8_ms"]
    res["fp8_memory_ratio"] = res["fp8_peak_mib"] / res["bf16_align128_peak_mib"]
    res["fp8_casts"] = _casts(fns["fp8"]) if cuda else math.nan
    return bc.without_rounds(res)


def _casts(fn) -> int:
    """Launches of one step that quantize: moekit's quantize and FP8 activation kernels, and the
    permute's row copy, which quantizes on the way (its kernel's name is shared with bf16's)."""
    marks = ("quantize", "_act_fp8", "_act_bwd_fp8")
    return 1 + sum(count for name, count, _ in bc.kernel_times(fn) if any(m in name for m in marks))


def autocast_figures(spec, args, cuda, device, time_fn) -> dict:
    """fp32 parameters under bf16 autocast: moekit's layer, the torch-native MoE with the same
    casts written out, the bf16 layer; the casts' byte floor at the measured copy rate."""
    low = torch.bfloat16
    layer, x, dy = make_layer(*spec[:6], device, torch.float32, 0)
    bf16 = copy.deepcopy(layer).to(low)
    xb, dyb = x.detach().to(low).requires_grad_(), dy.to(low)
    params = [layer.router.weight, layer.experts.fc1_weight, layer.experts.fc2_weight]
    ins, kopts = [x, *params], route_opts(layer)
    fwd = torch.autocast(device.split(":")[0], dtype=low)(lambda: layer(x))  # the forward only

    def torch_autocast():
        cast = [p.to(low) for p in params]
        y, aux = torch_moe(x.to(low), *cast, layer.k, aux_loss_coeff=AUX_LOSS_COEFF, **kopts)
        return torch.autograd.grad([y.float(), aux], ins, [dy, torch.ones_like(aux)])

    fns = {"moekit_autocast": lambda: torch.autograd.grad(fwd(), ins, dy),
           "torch_autocast": torch_autocast,
           "moekit_bf16": lambda: torch.autograd.grad(bf16(xb), [xb, *bf16.parameters()], dyb)}  # fmt: skip
    res = bc.measure(fns, {"ms": time_fn}, 1 if args.quick else 3, warm=True)
    res["autocast_speedup_vs_torch"] = res["torch_autocast_ms"] / res["moekit_autocast_ms"]
    res["autocast_overhead_ms"] = res["moekit_autocast_ms"] - res["moekit_bf16_ms"]
    res["autocast_cast_bytes"] = sum(p.numel() for p in params) * (4 + 2 + 2)
    rate = bc.copy_gb_per_s(device) if cuda else math.nan
    res["autocast_cast_floor_ms"] = res["autocast_cast_bytes"] / (rate * 1e6)
    return bc.without_rounds(res)


def run_ep_shape(name, spec, args, device) -> dict:
    """One shape at EP W: tokens/s per GPU (slowest rank), the exchange alone and its share."""
    T, E, k, H, Fd, _, _ = spec
    W = dist.get_world_size()
    group = dist.group.WORLD if W > 1 else None
    config = lambda backend, chunks=None: (
        None if group is None else ExpertParallelConfig(backend, chunks=chunks))  # fmt: skip
    layer, x, dy = make_layer(*spec[:6], device, args.dtype, 0, group, None, config("auto"))
    res = {"shape": name, "T_per_rank": T, "E": E, "k": k, "H": H, "F": Fd, "ep": W,
           **routing_stats(layer, x)}  # fmt: skip
    fns = {c: f for c, f in steps(layer, x, dy, False, group).items() if c in ("moekit", "torch")}
    modes = [("moekit_capacity", CAPACITY_FACTOR, "auto", None)]
    if W > 1:  # and the overlapped chunk counts asked for
        modes.append(("moekit_all_to_all", None, "all_to_all", None))
        modes += [(f"moekit_chunks{c}", None, "auto", c) for c in args.ep_chunks if c > 1]
    for mode, cf, backend, chunks in modes:  # the same parameters (one copy of the experts)
        other = new_layer(spec, ep_group=group, dispatch=DispatchConfig(cf), device="meta",
                          ep_config=config(backend, chunks), dtype=args.dtype)  # fmt: skip
        other.router, other.experts = layer.router, layer.experts
        fns[mode] = steps(other, x, dy, False, group)["moekit"]
    time_fn = lambda f: bc.over_ranks(bc.fixed_count_ms(f, warmup=3, calls=EP_CALLS))
    bc.measure(fns, {"ms": time_fn}, 2, res, warm=True)
    bc.measure(fns, {"peak_mib": bc.peak_mib}, 1, res)
    for c in fns:
        res[f"{c}_tokens_per_s"] = T / res[f"{c}_ms"] * 1e3
    res["speedup_vs_torch"] = res["torch_ms"] / res["moekit_ms"]
    if group is not None:
        res["backend"] = layer.ep.last_exchanges[0].backend
        res.update(_exchange_figures(layer, x, group))
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
    """The layer's exchange alone on its routing, dispatch + combine forward; GB/s per GPU of the
    bytes each rank moves to and from its peers, over the slowest rank's time."""
    with torch.no_grad():
        r = layer.router(x.detach())

    def exchange():
        ex = ExpertExchange(r.indices, layer.num_experts, group, layer.ep.max_tokens, "auto")
        rows, _, _ = ex.dispatch(x.detach(), r.probs)
        return ex.combine(rows), ex

    _, ex = exchange()
    ms = bc.over_ranks(bc.fixed_count_ms(lambda: exchange(), warmup=3, calls=EP_CALLS))
    rank, W, gpu_ms = dist.get_rank(), dist.get_world_size(), ms
    if ex.backend == "symmetric":  # the GPU's own time: alone, its small launches are host-bound
        gpu_ms = bc.over_ranks(bc.graph_us(lambda: exchange()[0], 5, fixed_count=True) / 1e3)
        table = ex.table.long()
    else:  # the counts, all-gathered
        table = torch.empty(W, W, dtype=torch.long, device=x.device)
        dist.all_gather_into_tensor(table, ex.routes.sends.long(), group=group)
    remote = table[:, rank].sum() + table[rank].sum() - 2 * table[rank, rank]  # rows in + out
    mean_bytes = bc.over_ranks(float(remote) * x.shape[1] * x.element_size(), "AVG")
    tokens = bc.over_ranks(float(x.shape[0]), "SUM")  # ranks_per_token: over every rank's tokens
    return {"exchange_fwd_eager_ms": ms, "exchange_fwd_ms": gpu_ms,
            "exchange_step_ms": 2 * gpu_ms,  # forward and backward move the same bytes
            "exchange_gb_per_s": mean_bytes / gpu_ms / 1e6,
            "exchange_eager_gb_per_s": mean_bytes / ms / 1e6,
            "ranks_per_token": float(table.sum()) / tokens}  # fmt: skip


def _exchange_share(fn) -> float:
    """Share of the step's GPU kernel time in the exchange's kernels (NCCL or moekit's)."""
    marks, times = ("nccl", "_pull_", "_exchange_barrier", "_copy_rows"), bc.kernel_times(fn)
    ex = sum(t for name, _, t in times if any(m in name.lower() for m in marks))
    total = sum(t for _, _, t in times)
    return ex / total if total else math.nan


def p2p_copy_gb_per_s(nbytes: int = 1 << 30) -> float:
    """GPU1→GPU0 copy GB/s (rank 0, median of 10): the ceiling of one peer-to-peer stream."""
    t = torch.tensor([math.nan], device="cuda", dtype=torch.float64)
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:1").normal_()
        dst = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:0")
        torch.cuda.synchronize(1)
        t.fill_(nbytes / bc.fixed_count_ms(lambda: dst.copy_(src), warmup=3, calls=10) / 1e6)
    dist.broadcast(t, 0)
    return float(t)


def main_ep(args) -> None:
    W = init_distributed("nccl").world_size  # one GPU per rank; --ep 1: no torchrun needed
    if args.ep != W:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} processes, got {W}")
    p2p = p2p_copy_gb_per_s() if W > 1 else math.nan
    rows = []
    for name, spec in bc.pick(EP_SHAPES, args.shapes):
        rows.append({**run_ep_shape(name, spec, args, "cuda"), "p2p_copy_gb_per_s": p2p})
        if dist.get_rank() == 0:
            bc.log(json.dumps(rows[-1]))
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        base = {}  # tokens/s per GPU over the EP 1 run's (its JSON rows)
        if args.ep_baseline:
            with open(args.ep_baseline) as f:
                base = {r["shape"]: r["moekit_tokens_per_s"] for r in json.load(f)["rows"]}
        for r in rows:
            for c in ("moekit", "moekit_capacity"):
                r[f"{c}_scaling"] = r[f"{c}_tokens_per_s"] / base.get(r["shape"], math.nan)
        bc.log(f"EP{W}: tokens/s per GPU (forward + backward), {torch.cuda.get_device_name()}; "
               f"GPU1→GPU0 copy {p2p:.0f} GB/s")  # fmt: skip
        meta = bc.meta(True, ep=W, p2p_copy_gb_per_s=p2p)
        bc.finish(args.out, f"moe_layer_ep{W}", {"meta": meta, "rows": rows}, EP_COLUMNS)
    dist.destroy_process_group()


EP_COLUMNS = [
    "shape", ("moekit", "moekit_tokens_per_s"), ("capacity", "moekit_capacity_tokens_per_s"),
    ("a2a", "moekit_all_to_all_tokens_per_s"), ("torch", "torch_tokens_per_s"),
    ("×torch", "speedup_vs_torch"), ("scaling", "moekit_scaling"),
    ("cap sc.", "moekit_capacity_scaling"), ("xchg GB/s", "exchange_gb_per_s"),
    ("p2p GB/s", "p2p_copy_gb_per_s"), ("xchg share", "exchange_share"),
    ("peak MiB", "moekit_peak_mib")]  # fmt: skip
COLUMNS = [
    "shape", ("load", "max_over_mean_load"), ("moekit ms", "moekit_ms"), ("torch ms", "torch_ms"),
    ("loop ms", "loop_ms"), ("× torch", "speedup_vs_torch"), "target",
    ("TFLOP/s", "moekit_tflops"), ("floor ms", "floor_ms"), ("graph m", "moekit_graph_ms"),
    ("graph t", "torch_graph_ms"), ("MiB m", "moekit_peak_mib"), ("MiB t", "torch_peak_mib"),
    ("MiB recomp", "moekit_recompute_peak_mib"), ("MiB regather", "moekit_regather_peak_mib"),
    ("regather time ×", "regather_time_ratio"), ("router µs m", "router_moekit_us"),
    ("t", "router_torch_us"), ("floor", "router_floor_us"), ("×", "router_speedup"),
    ("graph ×", "router_graph_speedup"), ("autocast ×", "autocast_speedup_vs_torch"),
    ("autocast overhead ms", "autocast_overhead_ms"), ("cast floor ms", "autocast_cast_floor_ms"),
    ("fp8 ms", "fp8_ms"), ("bf16 a128 ms", "bf16_align128_ms"), ("fp8 ×", "fp8_speedup"),
    ("fp8 MiB ×", "fp8_memory_ratio"), ("casts", "fp8_casts")]  # fmt: skip


def main() -> None:
    ap = bc.parser(__doc__, quick="one round, no per-expert loop")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--autocast", action="store_true", help="also fp32 params under autocast")
    ap.add_argument("--fp8", action="store_true", help="also the layer's experts in FP8")
    ap.add_argument("--ep", type=int, default=None, help="expert parallelism (torchrun)")
    ap.add_argument("--ep-baseline", default=None, help="the --ep 1 JSON, for scaling")
    ap.add_argument("--ep-chunks", type=int, nargs="*", default=[], help="also N overlapped chunks")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.ep is not None:
        return main_ep(args)
    device = "cuda" if cuda else "cpu"
    peak_tflops = bc.DensePeak().tflops() if cuda else math.nan
    bc.log(f"dense torch.mm peak: {peak_tflops:.0f} TFLOP/s")
    shapes = bc.pick(SMOKE_SHAPES if args.smoke else SHAPES, args.shapes)
    run = partial(run_shape, args=args, cuda=cuda, device=device, peak_tflops=peak_tflops)
    rows, _, failed = bc.run_cases((n, partial(run, n, s)) for n, s in shapes)
    meta = bc.meta(cuda, dtype=str(args.dtype), dense_tflops=peak_tflops,
                   aux_loss_coeff=AUX_LOSS_COEFF, failed=failed)  # fmt: skip
    series = {"MoELayer": "speedup_vs_torch", "router alone": "router_speedup",
              "MoELayer, fp32 params under autocast": "autocast_speedup_vs_torch",
              "FP8 layer over the bf16 layer": "fp8_speedup"}  # fmt: skip
    panel = bc.bars(rows, series, "speed-up over torch-native (fwd+bwd)", hlines={"parity": 1.0})
    bc.finish(args.out, "moe_layer", {"meta": meta, "rows": rows}, COLUMNS, [panel])


if __name__ == "__main__":
    main()
