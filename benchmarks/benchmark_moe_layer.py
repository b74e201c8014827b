"""MoELayer forward + backward against the torch-native MoE and a per-expert loop.

    python benchmarks/benchmark_moe_layer.py --out bench_out [--quick] [--smoke]
    torchrun --nproc_per_node=N benchmarks/benchmark_moe_layer.py --ep N --out bench_out

Single GPU: at the layer sizes of Qwen3-30B-A3B, OLMoE, DeepSeek-V3 (one EP8 rank's 32 experts,
sigmoid + group limit + bias) and Mixtral, bf16, aux loss on, skewed routing (the router's
weights lean towards some experts, so loads differ a lot and the routing is the router's own),
each contender runs router → dispatch → experts → combine, forward and backward
(``torch.autograd.grad`` of the output and the aux loss with respect to the input and every
weight):

  moekit   moekit.nn.MoELayer (also with the experts' activation recomputed in backward)
  torch    benchmarks/torch_moe.py: F.linear router + softmax/sigmoid topk, argsort permute,
           torch._grouped_mm SwiGLU experts, index_add_ combine
  loop     the same router, then a per-expert Python loop of F.linear (single GPU only)

Timing: median of ``triton.testing.do_bench`` (back-to-back eager calls, L2 flushed), in
interleaved rounds, best round kept; also a CUDA graph of 5 calls for moekit and torch (the
router alone: 20 calls). The
expert FLOPs (18·T·k·H·F for fc1, fc2 forward, dgrad and wgrad) over the time give TFLOP/s; the
floor is those FLOPs at the dense ``torch.mm`` rate measured in the same run. Peak memory is
the most allocated during one step above what was allocated before it. The router alone (after
the logits GEMM): ``moekit.ops.route`` forward + backward against the torch composition, eager
and in a CUDA graph, with the host floor of a kernel-less autograd op of the same signature;
its eager speed-up is the median over 5 rounds of the ratio within a round.

With ``--autocast``: the same layer with fp32 parameters and an fp32 input under
``torch.autocast(bfloat16)`` (the usual mixed-precision recipe), forward + backward, against
the bf16 layer and the torch-native MoE with the same per-call weight casts. The cast floor is
the least extra traffic of fp32 parameters at the device copy rate measured in the same run:
the forward's cast (fp32 read, bf16 written) plus the fp32 weight gradients' extra two bytes
per parameter over bf16 ones.

With ``--ep N`` (under torchrun, one process per GPU): the Qwen3-30B-A3B and DeepSeek-V3 layers
(E = 128 and 256, split over the N ranks, T tokens per rank): moekit dropless (the symmetric
exchange where it runs), with ``capacity_factor``, and with the all-to-all exchange, against the
torch-native layer with ``all_to_all_single``; tokens/s per GPU (the slowest rank's time, a
fixed number of calls on every rank), peak memory, the exchange alone (dispatch + combine
forward on the layer's routing, timed from a CUDA graph: GB/s per GPU of the bytes read from
peers) against the GPU1→GPU0 copy-engine rate, and the exchange's share of the step. Run it
with ``--ep 1`` on one GPU of the same machine for the scaling efficiency (``--ep-baseline``
takes that JSON); ``benchmarks/run_moe_ep.sh`` runs the checks and every EP size.

Writes moe_layer.json (moe_layer_ep<N>.json) and a PNG under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys

import torch
from common import (
    DensePeak,
    bench_ms,
    copy_gb_per_s,
    error_line,
    fixed_count_ms,
    graph_us,
    host_ms,
    interleaved_rounds,
    pyplot,
    save_figure,
    write_json,
)
from torch_moe import loop_moe, torch_ep_moe, torch_moe, torch_topk_routing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.nn import ExpertParallelConfig, MoELayer
from moekit.ops.router import route

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


def log(*args) -> None:
    print(*args, flush=True)


def make_layer(T, E, k, H, Fd, opts, device, dtype, seed, ep_group=None, capacity=None,
               ep_config=None):  # fmt: skip
    """The layer (all E experts, or this rank's share), its input and output gradient. The
    router leans towards some experts along one direction of the input, so the routing is
    skewed the same way for every contender."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    layer = MoELayer(
        H, Fd, E, k, aux_loss_coeff=AUX_LOSS_COEFF, ep_group=ep_group, capacity_factor=capacity,
        ep_config=ep_config, device=device, dtype=dtype, **opts,
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
        rank_gen = torch.Generator(device="cpu").manual_seed(seed + 1000 * (_rank() + 1))
        x = torch.randn(T, H, generator=rank_gen) + 2.0 * u
        dy = torch.randn(T, H, generator=rank_gen) * T**-0.5
    x = x.to(device, dtype).requires_grad_()
    return layer, x, dy.to(device, dtype)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def route_opts(layer: MoELayer) -> dict:
    r = layer.router
    return dict(r.route_kwargs, expert_bias=r.expert_bias)


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
        p, _i, _c = route(logits, k, expert_bias=bias, **kw)
        return torch.autograd.grad(p, logits, dp)

    def torch_composition():
        p = torch_topk_routing(logits, k, expert_bias=bias, **kw)[0]
        return torch.autograd.grad(p, logits, dp)

    def floor():
        return torch.autograd.grad(RouterFloor.apply(logits, k)[0], logits, dp)

    return {"moekit": moekit, "torch": torch_composition, "floor": floor}


def peak_mib(step, cuda: bool) -> float:
    if not cuda:
        return math.nan
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


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
    res = {"shape": name, "T": T, "E": E, "k": k, "H": H, "F": Fd, "router": dict(opts)}
    time_fn = (lambda f: bench_ms(f, warmup=10, rep=60 if args.quick else 150)) if cuda else host_ms
    layer, x, dy = make_layer(T, E, k, H, Fd, opts, device, args.dtype, seed=0)
    res.update(routing_stats(layer, x))
    fns = steps(layer, x, dy, with_loop=not args.quick)
    for fn in fns.values():
        fn()  # compile, tune, warm the allocator
    best, _ = interleaved_rounds(fns, 1 if args.quick else 3, time_fn, on_error=_report(res))
    for c, ms in best.items():
        res[f"{c}_ms"] = ms
        res[f"{c}_peak_mib"] = peak_mib(fns[c], cuda) if c != "loop" else math.nan
    if cuda:
        for c in ("moekit", "torch"):
            try:
                res[f"{c}_graph_ms"] = graph_us(fns[c], calls=5) / 1e3
            except Exception as exc:
                res[f"{c}_graph_ms"] = math.nan
                res[f"{c}_graph_error"] = error_line(exc)
    flops = 18 * T * k * H * Fd
    res["expert_tflop"] = flops / 1e12
    res["moekit_tflops"] = flops / res["moekit_ms"] / 1e9
    res["floor_ms"] = flops / peak_tflops / 1e9 if cuda else math.nan
    res["speedup_vs_torch"] = res["torch_ms"] / res["moekit_ms"]
    res["speedup_vs_loop"] = res.get("loop_ms", math.nan) / res["moekit_ms"]
    res["target"] = target
    del layer, x, dy, fns
    rf = router_steps(T, E, k, opts, device, args.dtype)
    for fn in rf.values():
        fn()
    # Host-bound calls: their time moves with the host from round to round, so the speed-up is
    # the median of the ratios taken within a round (both timed back to back), over 5 rounds.
    rbest, rounds = interleaved_rounds(
        rf, 1 if args.quick else ROUTER_ROUNDS, time_fn, on_error=_report(res)
    )
    res["router_floor_us"] = rbest["floor"] * 1e3
    for c in ("moekit", "torch"):
        res[f"router_{c}_us"] = rbest[c] * 1e3
        res[f"router_{c}_graph_us"] = graph_us(rf[c]) if cuda else math.nan
    ratios = [t / m for t, m in zip(rounds["torch"], rounds["moekit"])]
    res["router_speedup_rounds"] = ratios
    res["router_speedup"] = statistics.median(ratios) if ratios else math.nan
    res["router_graph_speedup"] = res["router_torch_graph_us"] / res["router_moekit_graph_us"]
    if args.autocast:
        res.update(autocast_figures(spec, args, cuda, device, time_fn))
    return res


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
    fdev = device.split(":")[0]

    def moekit_autocast():
        with torch.autocast(fdev, dtype=low):
            y = layer(x)
        return torch.autograd.grad(y, ins, dy)

    def torch_autocast():
        cast = [p.to(low) for p in params]
        y, aux = torch_moe(
            x.to(low), *cast, k, aux_loss_coeff=AUX_LOSS_COEFF, **kopts
        )  # fmt: skip
        return torch.autograd.grad([y.float(), aux], ins, [dy, torch.ones_like(aux)])

    def moekit_bf16():
        return torch.autograd.grad(bf16(xb), [xb, *bf16.parameters()], dyb)

    fns = {"moekit_autocast": moekit_autocast, "torch_autocast": torch_autocast,
           "moekit_bf16": moekit_bf16}  # fmt: skip
    for fn in fns.values():
        fn()
    res: dict = {}
    best, _ = interleaved_rounds(fns, 1 if args.quick else 3, time_fn, on_error=_report(res))
    for c, ms in best.items():
        res[f"{c}_ms"] = ms
    res["autocast_speedup_vs_torch"] = best["torch_autocast"] / best["moekit_autocast"]
    res["autocast_overhead_ms"] = best["moekit_autocast"] - best["moekit_bf16"]
    n_params = sum(p.numel() for p in params)
    res["autocast_cast_bytes"] = n_params * (4 + 2 + 2)
    if cuda:
        res["autocast_cast_floor_ms"] = res["autocast_cast_bytes"] / (copy_gb_per_s(device) * 1e6)
    else:
        res["autocast_cast_floor_ms"] = math.nan
    return res


def _report(res):
    def on_error(name, exc):
        log(f"    {name} FAILED: {error_line(exc)}")
        res[f"{name}_error"] = error_line(exc)

    return on_error


def table(rows) -> list[str]:
    head = (
        f"{'shape':<17}{'moekit ms':>10}{'torch ms':>10}{'loop ms':>9}{'× torch':>8}"
        f"{'target':>7}{'TFLOP/s':>8}{'floor ms':>9}{'graph m/t':>13}{'peak MiB m/t':>15}"
        f"{'router µs m/t/floor':>20}{'×':>6}{'graph ×':>8}{'recomp MiB':>11}{'load':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        tgt = f"{r['target']:.2f}" if r.get("target") else "-"
        graph = f"{r.get('moekit_graph_ms', math.nan):.2f}/{r.get('torch_graph_ms', math.nan):.2f}"
        peak = f"{r['moekit_peak_mib']:.0f}/{r['torch_peak_mib']:.0f}"
        router = (
            f"{r['router_moekit_us']:.0f}/{r['router_torch_us']:.0f}/{r['router_floor_us']:.0f}"
        )
        lines.append(
            f"{r['shape']:<17}{r['moekit_ms']:>10.3f}{r['torch_ms']:>10.3f}"
            f"{r.get('loop_ms', math.nan):>9.2f}{r['speedup_vs_torch']:>8.2f}{tgt:>7}"
            f"{r['moekit_tflops']:>8.0f}{r['floor_ms']:>9.3f}{graph:>13}{peak:>15}"
            f"{router:>20}{r['router_speedup']:>6.2f}{r['router_graph_speedup']:>8.2f}"
            f"{r.get('moekit_recompute_peak_mib', math.nan):>11.0f}{r['max_over_mean_load']:>6.1f}"
        )
    return lines


def autocast_table(rows) -> list[str]:
    head = (
        f"{'autocast (fp32 params)':<24}{'moekit ms':>10}{'torch ms':>10}{'× torch':>8}"
        f"{'bf16 ms':>9}{'overhead ms':>12}{'cast floor ms':>14}"
    )
    lines = ["", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shape']:<24}{r['moekit_autocast_ms']:>10.3f}{r['torch_autocast_ms']:>10.3f}"
            f"{r['autocast_speedup_vs_torch']:>8.2f}{r['moekit_bf16_ms']:>9.3f}"
            f"{r['autocast_overhead_ms']:>12.3f}{r['autocast_cast_floor_ms']:>14.3f}"
        )
    return lines


def verdict(rows) -> dict:
    ok, fail = [], []
    for r in rows:
        checks = []
        if r.get("target"):
            checks.append(
                (
                    r["speedup_vs_torch"] >= r["target"],
                    f"{r['shape']}: {r['speedup_vs_torch']:.2f}× torch (target ≥ {r['target']})",
                )
            )
        checks.append(
            (
                r["router_speedup"] >= ROUTER_TARGET,
                f"{r['shape']}: router {r['router_speedup']:.2f}× torch (target ≥ {ROUTER_TARGET})",
            )
        )
        checks.append(
            (
                r["moekit_peak_mib"] <= r["torch_peak_mib"],
                f"{r['shape']}: peak "
                f"{r['moekit_peak_mib']:.0f} MiB vs torch {r['torch_peak_mib']:.0f}",
            )
        )
        if r["shape"] == "qwen3_30b_a3b":
            checks.append(
                (
                    r["moekit_tflops"] >= QWEN3_TFLOPS_TARGET,
                    f"qwen3: {r['moekit_tflops']:.0f} TFLOP/s (target ≥ {QWEN3_TFLOPS_TARGET})",
                )
            )
        for good, text in checks:
            (ok if good else fail).append(text)
    return {"pass": ok, "fail": fail}  # fmt: skip


def plot(rows, path) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["shape"] for r in rows]
    xs = range(len(rows))
    bars = [("MoELayer", "speedup_vs_torch"), ("router alone", "router_speedup")]
    if all("autocast_speedup_vs_torch" in r for r in rows):
        bars.append(("MoELayer, fp32 params under autocast", "autocast_speedup_vs_torch"))
    width = 0.8 / len(bars)
    for j, (label, key) in enumerate(bars):
        at = [i - 0.4 + (j + 0.5) * width for i in xs]
        ax.bar(at, [r[key] for r in rows], width, label=label)
    for i, r in enumerate(rows):
        if r.get("target"):
            ax.plot([i - 0.4, i - 0.4 + width], [r["target"]] * 2, "k--", lw=1)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(xs), names, rotation=15)
    ax.set_ylabel("speed-up over torch-native (fwd+bwd)")
    ax.legend(loc="lower center", fontsize=8)
    save_figure(fig, path)


# ------------------------------------------------------------------------------------------------
# Expert parallelism
# ------------------------------------------------------------------------------------------------


EP_CALLS = 20  # timed calls per contender and round: a fixed count on every rank


def run_ep_shape(name, spec, args, device) -> dict:
    """One shape at EP W: tokens/s per GPU of every contender (the slowest rank's time), the
    exchange alone (GB/s per GPU of the bytes that cross NVLink) and its share of the step."""
    import torch.distributed as dist

    T, E, k, H, Fd, opts, _ = spec
    W = dist.get_world_size()
    group = dist.group.WORLD if W > 1 else None
    res = {"shape": name, "T_per_rank": T, "E": E, "k": k, "H": H, "F": Fd, "ep": W}
    time_fn = lambda f: _max_over_ranks(fixed_count_ms(f, warmup=3, calls=EP_CALLS))
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
                H, Fd, E, k, aux_loss_coeff=AUX_LOSS_COEFF, ep_group=group, capacity_factor=cf,
                ep_config=config, device="meta", dtype=args.dtype, **opts,
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
    best, _ = interleaved_rounds(fns, 2, time_fn, on_error=_report(res))
    for c, ms in best.items():
        res[f"{c}_ms"] = ms
        res[f"{c}_tokens_per_s"] = T / ms * 1e3
        res[f"{c}_peak_mib"] = peak_mib(fns[c], True)
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
    ep = layer.ep
    xs = x.detach()

    def exchange():
        ex = ExpertExchange(r.indices, layer.num_experts, group, ep.max_tokens, "auto")
        rows, _, _ = ex.dispatch(xs, r.probs)
        return ex.combine(rows), ex

    _, ex = exchange()
    ms = _max_over_ranks(fixed_count_ms(lambda: exchange(), warmup=3, calls=EP_CALLS))
    # the GPU's own time: the exchange alone is a chain of small launches that the host cannot
    # issue as fast as the GPU runs them (inside a layer step the host runs ahead)
    graph_ms = math.nan
    if ex.backend == "symmetric":
        graph_ms = _max_over_ranks(graph_us(lambda: exchange()[0], 5, fixed_count=True) / 1e3)
    rank, W = dist.get_rank(), dist.get_world_size()
    if ex.backend == "symmetric":
        table = ex.table.long()
    else:  # the counts, all-gathered
        table = torch.empty(W, W, dtype=torch.long, device=x.device)
        dist.all_gather_into_tensor(table, ex.routes.sends.long(), group=group)
    remote_in = int(table[:, rank].sum() - table[rank, rank])
    remote_out = int(table[rank].sum() - table[rank, rank])
    nbytes = (remote_in + remote_out) * x.shape[1] * x.element_size()
    mean_bytes = _mean_over_ranks(float(nbytes))
    gpu_ms = graph_ms if graph_ms == graph_ms else ms
    return {
        "exchange_fwd_eager_ms": ms,
        "exchange_fwd_ms": gpu_ms,
        "exchange_step_ms": 2 * gpu_ms,  # forward and backward move the same bytes
        "exchange_gb_per_s": mean_bytes / gpu_ms / 1e6,
        "exchange_eager_gb_per_s": mean_bytes / ms / 1e6,
        # ranks a token goes to, on average over every rank's tokens
        "ranks_per_token": float(table.sum()) / _sum_over_ranks(float(x.shape[0])),
    }


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


def _reduce_over_ranks(v: float, op) -> float:
    import torch.distributed as dist

    t = torch.tensor([v], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t)


def _max_over_ranks(v: float) -> float:
    import torch.distributed as dist

    return _reduce_over_ranks(v, dist.ReduceOp.MAX)


def _sum_over_ranks(v: float) -> float:
    import torch.distributed as dist

    return _reduce_over_ranks(v, dist.ReduceOp.SUM)


def _mean_over_ranks(v: float) -> float:
    import torch.distributed as dist

    return _sum_over_ranks(v) / dist.get_world_size()


def p2p_copy_gb_per_s(nbytes: int = 1 << 30) -> float:
    """Copy rate from GPU 1 into GPU 0 of this host (the copy engines over NVLink), GB/s of
    bytes moved; timed on rank 0 (the others wait). The ceiling of one peer-to-peer stream."""
    import torch.distributed as dist

    rate = math.nan
    if dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:1").normal_()
        dst = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:0")
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(0)
        rate = 10 * nbytes / start.elapsed_time(end) / 1e6
        del src, dst
    t = torch.tensor([rate], device="cuda", dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t)


def main_ep(args) -> None:
    import torch.distributed as dist

    from moekit.distributed import disable_multicast_env

    disable_multicast_env()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if "RANK" in os.environ:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:  # --ep 1 on one GPU without torchrun
        dist.init_process_group(
            "nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
            device_id=torch.device("cuda", 0),
        )  # fmt: skip
    W = dist.get_world_size()
    if args.ep != W:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} processes, got {W}")
    p2p = p2p_copy_gb_per_s() if W > 1 else math.nan
    rows = []
    for name, spec in EP_SHAPES.items():
        if args.shapes and name not in args.shapes:
            continue
        r = run_ep_shape(name, spec, args, "cuda")
        r["p2p_copy_gb_per_s"] = p2p
        rows.append(r)
        if dist.get_rank() == 0:
            log(json.dumps(r))
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        base = {}
        if args.ep_baseline:
            with open(args.ep_baseline) as f:
                base = {r["shape"]: r for r in json.load(f)["rows"]}
        for r in rows:
            b = base.get(r["shape"])
            for c in ("moekit", "moekit_capacity"):
                r[f"{c}_scaling"] = r[f"{c}_tokens_per_s"] / b["moekit_tokens_per_s"] if b \
                    else math.nan  # fmt: skip
        log("\n".join(ep_table(rows, W, p2p)))
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ep": W,
                "p2p_copy_gb_per_s": p2p}  # fmt: skip
        write_json(os.path.join(args.out, f"moe_layer_ep{W}.json"), {"meta": meta, "rows": rows},
                   nan_as_null=True)  # fmt: skip
    dist.destroy_process_group()


def ep_table(rows, W: int, p2p: float) -> list[str]:
    lines = [f"EP{W}: tokens/s per GPU (forward + backward), {torch.cuda.get_device_name()}; "
             f"GPU1→GPU0 copy {p2p:.0f} GB/s"]  # fmt: skip
    head = (f"{'shape':<15}{'moekit':>10}{'capacity':>10}{'a2a':>10}{'torch':>10}{'×torch':>8}"
            f"{'scaling':>8}{'cap sc.':>8}{'xchg GB/s':>10}{'% p2p':>7}{'xchg share':>11}"
            f"{'peak MiB':>9}")  # fmt: skip
    lines.append(head)
    for r in rows:
        gb = r.get("exchange_gb_per_s", math.nan)
        lines.append(
            f"{r['shape']:<15}{r['moekit_tokens_per_s']:>10.0f}"
            f"{r['moekit_capacity_tokens_per_s']:>10.0f}"
            f"{r.get('moekit_all_to_all_tokens_per_s', math.nan):>10.0f}"
            f"{r['torch_tokens_per_s']:>10.0f}{r['speedup_vs_torch']:>8.2f}"
            f"{r.get('moekit_scaling', math.nan):>8.2f}"
            f"{r.get('moekit_capacity_scaling', math.nan):>8.2f}{gb:>10.0f}"
            f"{100 * gb / p2p if p2p == p2p else math.nan:>7.0f}"
            f"{r.get('exchange_share', math.nan):>11.2f}{r['moekit_peak_mib']:>9.0f}"
        )
        for key in sorted(k for k in r if k.endswith("_exposed_share")):
            c = key.removeprefix("chunks").removesuffix("_exposed_share")
            lines.append(
                f"  {c} overlapped chunks: {r[f'moekit_chunks{c}_tokens_per_s']:.0f} tok/s per GPU"
                f" ({r[f'moekit_chunks{c}_ms'] / r['moekit_ms']:.2f}× one chunk's time), "
                f"exchange exposed {r[key]:.2f}"
            )
    return lines


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="one round, no per-expert loop")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    ap.add_argument("--shapes", nargs="*", default=None)
    ap.add_argument("--autocast", action="store_true",
                    help="also fp32 parameters under bf16 autocast")  # fmt: skip
    ap.add_argument("--ep", type=int, default=None, help="expert parallelism (torchrun)")
    ap.add_argument("--ep-baseline", default=None, help="the --ep 1 JSON, for scaling")
    ap.add_argument("--ep-chunks", type=int, nargs="*", default=[],
                    help="also time the layer in these many overlapped chunks")  # fmt: skip
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    args.dtype = torch.bfloat16 if cuda else torch.float32
    if args.ep is not None:
        return main_ep(args)
    device = "cuda" if cuda else "cpu"
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    peak = DensePeak() if cuda else None
    peak_tflops = peak.tflops() if cuda else math.nan
    log(f"dense torch.mm peak: {peak_tflops:.0f} TFLOP/s")
    rows = []
    for name, spec in shapes.items():
        if args.shapes and name not in args.shapes:
            continue
        log(f"{name} ...")
        rows.append(run_shape(name, spec, args, cuda, device, peak_tflops))
        if cuda:
            torch.cuda.empty_cache()
    lines = table(rows)
    if args.autocast:
        lines += autocast_table(rows)
    v = verdict(rows) if cuda else {"pass": [], "fail": [], "note": "no targets off the GPU"}
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "dtype": str(args.dtype), "dense_tflops": peak_tflops,
        "aux_loss_coeff": AUX_LOSS_COEFF,
    }  # fmt: skip
    write_json(os.path.join(args.out, "moe_layer.json"), {"meta": meta, "rows": rows,
               "verdict": v}, nan_as_null=True)  # fmt: skip
    plot(rows, os.path.join(args.out, "moe_layer.png"))
    log("\n".join(lines))
    for text in v["fail"]:
        log(f"MISSED {text}")
    log(f"targets met: {len(v['pass'])}/{len(v['pass']) + len(v['fail'])}")


if __name__ == "__main__":
    main()
