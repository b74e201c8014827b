"""Small and eager calls: moekit against torch where the host, not the GPU, sets the pace.

    python benchmarks/benchmark_small_shapes.py --out bench_out [--quick] [--no-warmup]

A sweep of MoE shapes from decode steps (1–64 tokens) to short training sequences (8192 routed
rows), E from 8 to 256, H and F from 512 to 4096, top-k routing of random scores with a
per-expert skew (so some experts get nothing). For each shape and pass

  mm_fc1     grouped_mm  x[T,H] @ w1[e]^T            (ragged M, weight.transpose view)
  mm_dgrad   grouped_mm  dh[T,2F] @ w1[e]            (ragged M)
  mm_wgrad   grouped_mm  dh^T[2F,T] @ x[T,H] -> [E,2F,H]   (ragged K, bf16 out)
  mlp        grouped_mlp forward + backward          (vs torch._grouped_mm + SwiGLU, autograd)
  block      permute -> grouped_mlp -> unpermute forward + backward
             (vs argsort / index_select / torch._grouped_mm / index_add_)
  permute    permute forward (routing metadata included) + backward of rows and probs
             (vs argsort / index_select, counts by index_add_)
  unpermute  unpermute forward + backward, routing made beforehand (vs index_add_)

it measures each contender three ways:
  eager  µs per call of back-to-back calls (triton.testing.do_bench median: max of host and GPU)
  gpu    µs per call of a CUDA graph of 20 calls (GPU work alone)
  host   µs of host time per call while the GPU is kept busy (calls enqueued behind a sleep)
and prints the ratios torch / moekit (eager: > 1 means moekit is faster) and moekit / torch
(host). Eager and host are taken in three rounds, the contenders in turns: figures are medians
over the rounds, ratios the medians of the ratios within a round. Last, the warm-up: the wall time of the first forward + backward of a new MoE-block
shape in a fresh process with an empty Triton cache, and again in a second process.

Writes small_shapes.json and small_shapes.png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from common import (
    AutogradFloor,
    bench_ms,
    error_line,
    graph_us,
    host_ms,
    host_us_per_call,
    pyplot,
    save_figure,
    sleep_cycles_per_ms,
    write_json,
)
from torch_moe import torch_grouped_swiglu as torch_mlp
from torch_moe import torch_moe_block as torch_block
from torch_moe import torch_permute, torch_unpermute

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.ops import grouped_mlp, grouped_mm, permute, unpermute

# (name, tokens, k, E, H, F): routed rows T = tokens * k
SHAPES = [
    ("decode_1_mixtral", 1, 2, 8, 4096, 4096),
    ("decode_1_qwen3", 1, 8, 128, 2048, 768),
    ("decode_16_olmoe", 16, 8, 64, 2048, 1024),
    ("decode_64_e256", 64, 8, 256, 4096, 512),
    ("prefill_256_e8", 256, 2, 8, 1024, 1024),
    ("short_512_olmoe", 512, 8, 64, 2048, 1024),
    ("short_2048_e8", 2048, 2, 8, 1024, 1024),
    ("short_1024_e256", 1024, 8, 256, 512, 512),
    ("short_2048_e16", 2048, 4, 16, 2048, 2048),
    ("short_4096_e8", 4096, 2, 8, 4096, 4096),
]
QUICK = ["decode_1_qwen3", "decode_64_e256", "short_2048_e8", "short_2048_e16"]
SMOKE_SHAPES = [("smoke", 8, 2, 4, 32, 16)]
PASSES = ("mm_fc1", "mm_dgrad", "mm_wgrad", "mlp", "block", "permute", "unpermute")
CONTENDERS = ("moekit", "torch")
GRAPH_CALLS = 20
# One custom autograd Function with grouped_mlp's inputs and outputs that launches nothing: the
# host time any op of that signature pays before its kernels (mlp pass only).
FLOOR = "autograd_floor"


def make_case(tokens, k, E, H, Fd, device, dtype, seed):
    """Leaves and routing of one shape: top-k of skewed random scores (a per-expert bias, so
    popular experts take most rows and some get none)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    skew = torch.randn(E, generator=g) * 2.0
    scores = torch.randn(tokens, E, generator=g) + skew
    probs, idx = scores.softmax(-1).topk(k, dim=-1)
    probs = (probs / probs.sum(-1, keepdim=True)).to(device)
    idx = idx.to(device)
    counts = torch.bincount(idx.flatten(), minlength=E)
    offsets = counts.cumsum(0).to(torch.int32)
    T = tokens * k

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    return {
        "idx": idx, "probs": probs, "offsets": offsets, "tokens": tokens, "E": E,
        "x_tok": rnd(tokens, H), "x": rnd(T, H), "dh": rnd(T, 2 * Fd), "dy": rnd(T, H),
        "dy_tok": rnd(tokens, H), "row_probs": torch.rand(T, device=device),
        "w1": rnd(E, 2 * Fd, H, scale=H**-0.5), "w2": rnd(E, H, Fd, scale=Fd**-0.5),
        "empty_experts": int((counts == 0).sum()),
    }  # fmt: skip


def moekit_block(x, idx, probs, w1, w2, E):
    d = permute(x, indices=idx, probs=probs, num_experts=E)
    y = grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs)
    return unpermute(y, d, weighted=False)


def make_steps(case, which: str) -> dict:
    """The callable of each contender for one pass."""
    c = case
    w1, w2, offs = c["w1"], c["w2"], c["offsets"]
    x, dh = c["x"], c["dh"]
    if which == "mm_fc1":
        b = w1.transpose(-2, -1)
        return {
            "moekit": lambda: grouped_mm(x, b, offs),
            "torch": lambda: torch._grouped_mm(x, b, offs=offs),
        }
    if which == "mm_dgrad":
        return {
            "moekit": lambda: grouped_mm(dh, w1, offs),
            "torch": lambda: torch._grouped_mm(dh, w1, offs=offs),
        }
    if which == "mm_wgrad":
        dht = dh.t()
        return {
            "moekit": lambda: grouped_mm(dht, x, offs),
            "torch": lambda: torch._grouped_mm(dht, x, offs=offs),
        }
    w1g, w2g = w1.detach().requires_grad_(), w2.detach().requires_grad_()
    if which == "mlp":
        xg = x.detach().requires_grad_()
        pg = c["row_probs"].detach().requires_grad_()
        ins, dy = (xg, w1g, w2g, pg), c["dy"]

        def fwd_bwd(f):
            return lambda: torch.autograd.grad(f(xg, offs, w1g, w2g, pg), ins, dy)

        floor = fwd_bwd(lambda x_, o_, w1_, w2_, p_: AutogradFloor.apply(x_, o_, w1_, w2_, p_))
        return {"moekit": fwd_bwd(grouped_mlp), "torch": fwd_bwd(torch_mlp), FLOOR: floor}
    xg = c["x_tok"].detach().requires_grad_()
    pg = c["probs"].detach().requires_grad_()
    ins, dy, idx, E = (xg, w1g, w2g, pg), c["dy_tok"], c["idx"], c["E"]
    if which == "permute":
        d_rows, d_probs = c["dy"], c["row_probs"]

        def moekit_permute():
            d = permute(xg, indices=idx, probs=pg, num_experts=E)
            return torch.autograd.grad((d.hidden, d.probs), (xg, pg), (d_rows, d_probs))

        def torch_perm():
            rows, _, row_probs, _ = torch_permute(xg, idx, pg, E)
            return torch.autograd.grad((rows, row_probs), (xg, pg), (d_rows, d_probs))

        return {"moekit": moekit_permute, "torch": torch_perm}
    if which == "unpermute":
        yg = c["x"].detach().requires_grad_()
        d = permute(c["x_tok"], indices=idx, probs=c["probs"], num_experts=E)
        token = torch_permute(c["x_tok"], idx, c["probs"], E)[3]
        tokens = c["tokens"]
        return {
            "moekit": lambda: torch.autograd.grad(unpermute(yg, d, weighted=False), yg, dy),
            "torch": lambda: torch.autograd.grad(torch_unpermute(yg, token, tokens), yg, dy),
        }

    def block(f):
        return lambda: torch.autograd.grad(f(xg, idx, pg, w1g, w2g, E), ins, dy)

    return {"moekit": block(moekit_block), "torch": block(torch_block)}


def measure(
    steps: dict, cuda: bool, cycles_per_ms, host_calls: int, per_batch: int, rounds: int = 3
) -> dict:
    """Eager, GPU-only and host µs per call of each contender. ``per_batch`` calls are enqueued
    behind one GPU sleep: few enough that their launches stay within the GPU's launch queue
    (a launch past it blocks the host until the GPU drains).

    On the GPU the contenders take turns for ``rounds`` rounds (the order rotating each round),
    so that a slow stretch of the host hits them alike: each eager and host figure is the
    median over the rounds, and each ratio the median of the ratios within a round."""
    res, ready = {}, {}
    for name, fn in steps.items():
        try:
            fn()  # first call: configs, compilation, launch recording
            fn()
            ready[name] = fn
        except Exception as exc:
            _failed(res, name, exc)
    if not cuda:
        for name, fn in ready.items():
            res[f"{name}_eager_us"] = host_ms(fn) * 1e3
            res[f"{name}_host_us"] = res[f"{name}_eager_us"]
            res[f"{name}_gpu_us"] = math.nan
        return _ratios(res, {})
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in ready}
    names = list(ready)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name not in ready:
                continue
            fn = ready[name]
            try:
                eager = bench_ms(fn, warmup=10, rep=40) * 1e3
                host, covered = host_us_per_call(fn, host_calls, cycles_per_ms, per_batch=per_batch)
            except Exception as exc:
                _failed(res, name, exc)
                del ready[name]
                continue
            per_round[name].append((eager, host))
            res[f"{name}_host_covered"] = res.get(f"{name}_host_covered", True) and covered
    for name, fn in ready.items():
        res[f"{name}_eager_us"] = statistics.median(e for e, _ in per_round[name])
        res[f"{name}_host_us"] = statistics.median(h for _, h in per_round[name])
        res[f"{name}_rounds_us"] = per_round[name]
        try:
            res[f"{name}_gpu_us"] = graph_us(fn)
        except Exception as exc:
            _failed(res, name, exc, metrics=("gpu",))
    return _ratios(res, per_round)


def _failed(res: dict, name: str, exc: Exception, metrics=("eager", "host", "gpu")) -> None:
    print(f"    {name} FAILED: {error_line(exc)}", flush=True)
    res[f"{name}_error"] = error_line(exc)
    for m in metrics:
        res.setdefault(f"{name}_{m}_us", math.nan)


def _ratios(res: dict, per_round: dict) -> dict:
    """eager_speedup = torch / moekit and host_ratio = moekit / torch: the median of the
    per-round ratios where rounds were taken, else the ratio of the figures."""
    mk, th = per_round.get("moekit", []), per_round.get("torch", [])
    if mk and len(mk) == len(th):
        res["eager_speedup"] = statistics.median(t[0] / m[0] for m, t in zip(mk, th))
        res["host_ratio"] = statistics.median(m[1] / t[1] for m, t in zip(mk, th))
    else:
        res["eager_speedup"] = res["torch_eager_us"] / res["moekit_eager_us"]
        res["host_ratio"] = res["moekit_host_us"] / res["torch_host_us"]
    floor = per_round.get(FLOOR, [])
    if mk and len(mk) == len(floor):
        res["host_over_floor"] = statistics.median(m[1] / f[1] for m, f in zip(mk, floor))
    elif f"{FLOOR}_host_us" in res:
        res["host_over_floor"] = res["moekit_host_us"] / res[f"{FLOOR}_host_us"]
    return res


# ------------------------------------------------------------------------------------------------
# Warm-up: the first forward + backward of a new shape, in a fresh process
# ------------------------------------------------------------------------------------------------

WARMUP_CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import moekit.ops as ops
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w1 = (torch.randn(64, 2048, 2048, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
w2 = (torch.randn(64, 2048, 1024, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
probs, idx = torch.randn(4096, 64, device="cuda").softmax(-1).topk(8, dim=-1)
probs.requires_grad_()
torch.cuda.synchronize()
t1 = time.perf_counter()
d = ops.permute(x, indices=idx, probs=probs, num_experts=64)
y = ops.unpermute(ops.grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs), d, weighted=False)
y.sum().backward()
torch.cuda.synchronize()
print(time.perf_counter() - t1, t1 - t0)
"""


def warmup_seconds(env_extra: dict) -> dict:
    """First-step seconds of a new MoE-block shape: a cold process (empty Triton and moekit
    caches) and a second process sharing them."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
        env["MOEKIT_CACHE_DIR"] = os.path.join(tmp, "moekit")
        env.update(env_extra)
        for run in ("cold", "warm"):
            proc = subprocess.run(
                [sys.executable, "-c", WARMUP_CHILD.format(root=root)],
                env=env, capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if proc.returncode != 0:
                out[f"{run}_error"] = proc.stderr.strip().splitlines()[-1:]
                out[f"{run}_s"] = math.nan
                continue
            step, imports = map(float, proc.stdout.split()[-2:])
            out[f"{run}_s"], out[f"{run}_import_s"] = step, imports
    return out


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def table(rows) -> list[str]:
    head = (
        f"{'shape':18} {'pass':9} {'T':>6} {'E':>4} {'H':>5} {'F':>5} | "
        f"{'torch eager/gpu/host µs':>24} | {'moekit eager/gpu/host µs':>25} | "
        f"{'eager x':>7} {'host x':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:

        def trio(c):
            return "/".join(f"{r[f'{c}_{m}_us']:.0f}" for m in ("eager", "gpu", "host"))

        lines.append(
            f"{r['shape']:18} {r['pass']:9} {r['T']:6d} {r['E']:4d} {r['H']:5d} {r['F']:5d} | "
            f"{trio('torch'):>24} | {trio('moekit'):>25} | "
            f"{r['eager_speedup']:7.2f} {r['host_ratio']:6.2f}"
        )
    return lines


def plot(rows, path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    labels = [f"{r['shape']}\n{r['pass']}" for r in rows]
    xs = range(len(rows))
    axes[0].bar(xs, [r["eager_speedup"] for r in rows], color="tab:blue")
    axes[0].axhline(0.95, color="k", ls="--", lw=1, label="target 0.95")
    axes[0].set_ylabel("eager speed-up vs torch (torch µs / moekit µs)")
    axes[1].bar(xs, [r["host_ratio"] for r in rows], color="tab:orange")
    axes[1].axhline(1.3, color="k", ls="--", lw=1, label="grouped_mm target 1.3")
    axes[1].set_ylabel("host µs per call, moekit / torch")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=90, fontsize=6)
        ax.legend()
    fig.suptitle("moekit vs torch on small shapes, eager calls")
    save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench_out")
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    p.add_argument("--shapes", nargs="*", help="shape names to run")
    p.add_argument("--passes", nargs="*", default=list(PASSES), choices=PASSES)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up measurement")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    if args.quick:
        shapes = [s for s in shapes if s[0] in QUICK]
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes]
    os.makedirs(args.out, exist_ok=True)
    cycles_per_ms = sleep_cycles_per_ms() if cuda else None
    rows = []
    for i, (name, tokens, k, E, H, Fd) in enumerate(shapes):
        case = make_case(tokens, k, E, H, Fd, device, dtype, seed=i)
        print(f"{name}: T={tokens * k} E={E} H={H} F={Fd}, {case['empty_experts']} idle experts")
        for which in args.passes:
            per_batch = 25 if which.startswith("mm_") else 5
            res = measure(make_steps(case, which), cuda, cycles_per_ms, 100, per_batch)
            rows.append(
                {"shape": name, "pass": which, "T": tokens * k, "tokens": tokens, "k": k,
                 "E": E, "H": H, "F": Fd, "empty_experts": case["empty_experts"], **res}
            )  # fmt: skip
            print("  " + table(rows[-1:])[-1], flush=True)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "rows": rows,
    }
    write_json(os.path.join(args.out, "small_shapes.json"), result, nan_as_null=True)
    print("\n" + "\n".join(table(rows)))
    for which in args.passes:
        sel = [r for r in rows if r["pass"] == which]
        gm = math.exp(sum(math.log(r["eager_speedup"]) for r in sel) / len(sel))
        worst = min(sel, key=lambda r: r["eager_speedup"])
        print(
            f"{which:9} eager speed-up geomean {gm:.2f}, worst {worst['eager_speedup']:.2f} "
            f"({worst['shape']}); host ratio worst {max(r['host_ratio'] for r in sel):.2f}"
        )
    for r in rows:
        if "host_over_floor" in r:
            print(
                f"mlp host at {r['shape']}: moekit {r['moekit_host_us']:.0f} µs, torch "
                f"{r['torch_host_us']:.0f}, autograd floor {r[f'{FLOOR}_host_us']:.0f} "
                f"(moekit / floor {r['host_over_floor']:.2f})"
            )
    if cuda and not args.no_warmup:
        result["warmup"] = warmup_seconds({})
        write_json(os.path.join(args.out, "small_shapes.json"), result, nan_as_null=True)
        print("warm-up, first forward+backward of a new MoE block (T=4096x8, E=64, H=2048):")
        print(json.dumps(result["warmup"]))
    plot(rows, os.path.join(args.out, "small_shapes.png"))


if __name__ == "__main__":
    main()
