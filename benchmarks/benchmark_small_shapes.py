"""Small and eager calls: moekit against torch where the host, not the GPU, sets the pace.

    python benchmarks/benchmark_small_shapes.py --out bench_out [--quick] [--no-warmup]

Decode to short-sequence shapes, skewed top-k. Passes: grouped_mm (fc1, dgrad, wgrad), mlp
(against torch._grouped_mm + SwiGLU and a kernel-less autograd floor), block, permute,
unpermute: eager (do_bench), gpu (CUDA graph of 20 calls), host (behind a GPU sleep), 3 rounds
in turns. Then the first fwd + bwd of a new MoE block in a cold and a warm process.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from operator import attrgetter, itemgetter

import common as bc
import torch
from torch_moe import torch_grouped_swiglu as torch_mlp
from torch_moe import torch_moe_block as torch_block
from torch_moe import torch_permute, torch_unpermute

from moekit.ops import grouped_mlp, grouped_mm, permute, unpermute

# (name, tokens, k, E, H, F): routed rows T = tokens * k
SHAPES = [
    ("decode_1_mixtral", 1, 2, 8, 4096, 4096), ("decode_1_qwen3", 1, 8, 128, 2048, 768),
    ("decode_16_olmoe", 16, 8, 64, 2048, 1024), ("decode_64_e256", 64, 8, 256, 4096, 512),
    ("prefill_256_e8", 256, 2, 8, 1024, 1024), ("short_512_olmoe", 512, 8, 64, 2048, 1024),
    ("short_2048_e8", 2048, 2, 8, 1024, 1024), ("short_1024_e256", 1024, 8, 256, 512, 512),
    ("short_2048_e16", 2048, 4, 16, 2048, 2048), ("short_4096_e8", 4096, 2, 8, 4096, 4096),
]  # fmt: skip
QUICK = ["decode_1_qwen3", "decode_64_e256", "short_2048_e8", "short_2048_e16"]
SMOKE_SHAPES = [("smoke", 8, 2, 4, 32, 16)]
PASSES = ("mm_fc1", "mm_dgrad", "mm_wgrad", "mlp", "block", "permute", "unpermute")
FLOOR = "autograd_floor"  # common.AutogradFloor: the host time of grouped_mlp's signature (mlp)


def make_case(tokens, k, E, H, Fd, device, dtype, seed):
    """Leaves and routing of one shape: top-k of scores with a per-expert bias (some idle)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    skew = torch.randn(E, generator=g) * 2.0
    probs, idx = (torch.randn(tokens, E, generator=g) + skew).softmax(-1).topk(k, dim=-1)
    probs, idx = (probs / probs.sum(-1, keepdim=True)).to(device), idx.to(device)
    counts = torch.bincount(idx.flatten(), minlength=E)
    T = tokens * k
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device=device) * scale).to(dtype)
    return {
        "idx": idx, "probs": probs, "offsets": counts.cumsum(0).to(torch.int32), "tokens": tokens,
        "E": E, "x_tok": rnd(tokens, H), "x": rnd(T, H), "dh": rnd(T, 2 * Fd), "dy": rnd(T, H),
        "dy_tok": rnd(tokens, H), "row_probs": torch.rand(T, device=device),
        "w1": rnd(E, 2 * Fd, H, scale=H**-0.5), "w2": rnd(E, H, Fd, scale=Fd**-0.5),
        "empty_experts": int((counts == 0).sum())}  # fmt: skip


def moekit_block(x, idx, probs, w1, w2, E):
    d = permute(x, indices=idx, probs=probs, num_experts=E)
    return unpermute(grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs), d, weighted=False)


def make_steps(case, which: str) -> dict:
    """The callable of each contender for one pass (forward + autograd.grad, but grouped_mm)."""
    c = case
    w1, w2, offs, x, dh = c["w1"], c["w2"], c["offsets"], c["x"], c["dh"]
    mm = {"mm_fc1": (x, w1.transpose(-2, -1)), "mm_dgrad": (dh, w1), "mm_wgrad": (dh.t(), x)}
    if which in mm:
        a, b = mm[which]
        return {"moekit": lambda: grouped_mm(a, b, offs),
                "torch": lambda: torch._grouped_mm(a, b, offs=offs)}  # fmt: skip
    leaf = lambda t: t.detach().requires_grad_()
    grads = lambda fns, ins, dy: {n: lambda f=f: torch.autograd.grad(f(), ins, dy)
                                  for n, f in fns.items()}  # fmt: skip
    w1g, w2g, idx, E = leaf(w1), leaf(w2), c["idx"], c["E"]
    if which == "mlp":
        xg, pg = leaf(x), leaf(c["row_probs"])
        fns = {"moekit": grouped_mlp, "torch": torch_mlp, FLOOR: bc.AutogradFloor.apply}
        fns = {n: partial(f, xg, offs, w1g, w2g, pg) for n, f in fns.items()}
        return grads(fns, (xg, w1g, w2g, pg), c["dy"])
    xg, pg = leaf(c["x_tok"]), leaf(c["probs"])
    if which == "permute":  # the rows and their probs
        hp = attrgetter("hidden", "probs")
        ours = lambda: hp(permute(xg, indices=idx, probs=pg, num_experts=E))
        theirs = lambda: itemgetter(0, 2)(torch_permute(xg, idx, pg, E))
        return grads({"moekit": ours, "torch": theirs}, (xg, pg), (c["dy"], c["row_probs"]))
    if which == "unpermute":
        yg = leaf(x)
        d = permute(c["x_tok"], indices=idx, probs=c["probs"], num_experts=E)
        token = torch_permute(c["x_tok"], idx, c["probs"], E)[3]
        fns = {"moekit": lambda: unpermute(yg, d, weighted=False),
               "torch": lambda: torch_unpermute(yg, token, c["tokens"])}  # fmt: skip
        return grads(fns, yg, c["dy_tok"])
    fns = {"moekit": moekit_block, "torch": torch_block}
    fns = {n: partial(f, xg, idx, pg, w1g, w2g, E) for n, f in fns.items()}
    return grads(fns, (xg, w1g, w2g, pg), c["dy_tok"])


def run_pass(steps: dict, cuda: bool, cycles_per_ms, per_batch: int) -> dict:
    """Eager, GPU-only and host µs per call of each contender (``per_batch`` calls behind one GPU
    sleep: within the launch queue); on the GPU the medians of 3 rounds in turns (the order
    rotating), the ratios medians of the ratios within a round."""
    if not cuda:  # the warm call: configs, compilation, launch recording
        res = bc.measure(steps, {"eager_us": lambda f: bc.host_ms(f) * 1e3}, warm=True)
        res.update({f"{c}_host_us": res[f"{c}_eager_us"] for c in steps})
    else:
        host = lambda f: bc.host_us_per_call(f, 100, cycles_per_ms, per_batch=per_batch)[0]
        timers = {"eager_us": lambda f: bc.bench_ms(f, warmup=10, rep=40) * 1e3, "host_us": host}
        res = bc.measure(steps, timers, 3, keep=statistics.median, rotate=True, warm=True)
        bc.measure(steps, {"gpu_us": bc.graph_us}, 1, res)
    bc.ratios(res, "eager_us", {"eager_speedup": ("torch", "moekit")})
    return bc.ratios(res, "host_us", {"host_ratio": ("moekit", "torch"),
                                      "host_over_floor": ("moekit", FLOOR)})  # fmt: skip


# --- Warm-up: the first forward + backward of a new shape, in a fresh process ---
WARMUP_CHILD = """
import sys, time, torch
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import moekit.ops as ops
x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w1, w2 = ((torch.randn(64, 2048, n, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
          for n in (2048, 1024))
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


def warmup_seconds() -> dict:
    """First-step seconds of a new MoE block: a cold process (empty caches), then a warm one."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "triton"),
                   MOEKIT_CACHE_DIR=os.path.join(tmp, "moekit"))  # fmt: skip
        for run in ("cold", "warm"):
            proc = subprocess.run([sys.executable, "-c", WARMUP_CHILD.format(root=bc.REPO)],
                                  env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
            if proc.returncode != 0:
                out[f"{run}_error"] = proc.stderr.strip().splitlines()[-1:]
                out[f"{run}_s"] = math.nan
                continue
            out[f"{run}_s"], out[f"{run}_import_s"] = map(float, proc.stdout.split()[-2:])
    return out


def trio(c: str):  # "eager/gpu/host" µs of contender ``c``
    us = lambda r, m: f"{r.get(f'{c}_{m}_us', math.nan):.0f}"
    return lambda r: "/".join(us(r, m) for m in ("eager", "gpu", "host"))


COLUMNS = [
    "shape", "pass", "T", "E", "H", "F", ("torch eager/gpu/host µs", trio("torch")),
    ("moekit eager/gpu/host µs", trio("moekit")), ("eager x", "eager_speedup"),
    ("host x", "host_ratio"), ("host / floor", "host_over_floor")]  # fmt: skip


def run_shape(i, shape, args, cuda, device, dtype, cycles_per_ms) -> list[dict]:
    name, tokens, k, E, H, Fd = shape
    case = make_case(tokens, k, E, H, Fd, device, dtype, seed=i)
    bc.log(f"{name}: T={tokens * k} E={E} H={H} F={Fd}, {case['empty_experts']} idle experts")
    rows = []
    for which in args.passes:
        per_batch = 25 if which.startswith("mm_") else 5
        res = run_pass(make_steps(case, which), cuda, cycles_per_ms, per_batch)
        rows.append({"shape": name, "pass": which, "T": tokens * k, "tokens": tokens, "k": k,
                     "E": E, "H": H, "F": Fd, "empty_experts": case["empty_experts"], **res})  # fmt: skip
        bc.log(bc.table(rows[-1:], COLUMNS))
    return rows


def main() -> None:
    p = bc.parser(__doc__, quick=f"only {', '.join(QUICK)}")
    p.add_argument("--shapes", nargs="*", help="shape names to run")
    p.add_argument("--passes", nargs="*", default=list(PASSES), choices=PASSES)
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up measurement")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = bc.pick(SMOKE_SHAPES if args.smoke else SHAPES, args.shapes)
    shapes = bc.pick(shapes, QUICK if args.quick else None)
    run = partial(run_shape, args=args, cuda=cuda, device=device, dtype=dtype,
                  cycles_per_ms=bc.sleep_cycles_per_ms() if cuda else None)  # fmt: skip
    rows, _, failed = bc.run_cases((s[0], partial(run, i, s)) for i, s in enumerate(shapes))
    result = {"device": bc.device_name(cuda), "rows": rows, "failed": failed}
    if cuda and not args.no_warmup:
        result["warmup"] = warmup_seconds()
        bc.log(f"warm-up, first forward+backward of a new MoE block: {result['warmup']}")
    labels = {"eager": "eager_speedup", "host (moekit / torch)": "host_ratio"}
    rows_ = [{**r, "case": f"{r['shape']} {r['pass']}"} for r in rows]
    panel = bc.bars(rows_, labels, "moekit vs torch", label="case", hlines={"parity": 1.0})
    bc.finish(args.out, "small_shapes", result, COLUMNS, [panel], "moekit vs torch, small shapes")


if __name__ == "__main__":
    main()
