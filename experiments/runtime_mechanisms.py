"""What each host-overhead mechanism of moekit's op runtime buys, measured on one GPU.

    python experiments/runtime_mechanisms.py [--rounds 7] [--out bench_out]
    python experiments/runtime_mechanisms.py --tree OLD_CHECKOUT --variants all --host-only
        (the same calls timed against another checkout's moekit: old-vs-new A/B, alternate
        the two in one machine session)

Host µs per call (the calls enqueued behind a GPU sleep, so the host never waits; median of
batches) of small-shape calls, where the host sets the pace, with the mechanisms toggled in
turns inside one process (the variants alternate every round, so drift hits all alike):

    all        every mechanism on (what users run)
    no_bypass  ``dispatcher_only()``: kernel ops through the dispatcher, Functions via .apply
    no_replay  launch replay off: every launch through Triton's own launcher
    plain      both off

Then the gradient-memory reuse (``owned_gradient``): peak memory of a Qwen3-like MoE layer's
forward + backward with it and without; and compile-ahead: the wall time of a new shape's
first forward + backward in a fresh process with an empty Triton cache, with it and without.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

_TREE = sys.argv[sys.argv.index("--tree") + 1] if "--tree" in sys.argv else None
sys.path.insert(0, _TREE or os.path.join(os.path.dirname(__file__), ".."))

from moekit.nn import MoELayer  # noqa: E402
from moekit.ops import grouped_mlp, grouped_mm, permute, topk_routing, unpermute  # noqa: E402

try:  # the op base's module (an older checkout has it as moekit.ops.custom_op)
    from moekit.runtime.op import dispatcher_only
except ImportError:
    from moekit.ops.custom_op import dispatcher_only
from moekit.runtime import replay  # noqa: E402

DEV, DT = "cuda", torch.bfloat16
T, E, K, H, F = 64, 32, 4, 1024, 512


@contextlib.contextmanager
def variant(name: str):
    run = replay.LaunchReplay.run
    if name in ("no_replay", "plain"):
        replay.LaunchReplay.run = lambda self, roles: False
    ctx = dispatcher_only() if name in ("no_bypass", "plain") else contextlib.nullcontext()
    try:
        with ctx:
            yield
    finally:
        replay.LaunchReplay.run = run


def calls() -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(T, H, device=DEV, dtype=DT, generator=g, requires_grad=True)
    logits = torch.randn(T, E, device=DEV, dtype=torch.float32, generator=g, requires_grad=True)
    probs, idx = topk_routing(logits.detach(), K)
    probs = probs.detach().requires_grad_()
    R = T * K
    rows = torch.randn(R, H, device=DEV, dtype=DT, generator=g, requires_grad=True)
    offsets = (torch.arange(1, E + 1, device=DEV) * (R // E)).to(torch.int32)
    w = torch.randn(E, H, H, device=DEV, dtype=DT, generator=g) / 32
    w1 = (torch.randn(E, 2 * F, H, device=DEV, dtype=DT, generator=g) / 32).requires_grad_()
    w2 = (torch.randn(E, H, F, device=DEV, dtype=DT, generator=g) / 32).requires_grad_()
    rp = torch.rand(R, device=DEV, generator=g).to(DT).requires_grad_()
    layer = MoELayer(H, F, E, K, device=DEV, dtype=DT)
    d = permute(x.detach(), idx, probs.detach(), num_experts=E)
    ey = torch.randn(d.hidden.shape, device=DEV, dtype=DT, generator=g, requires_grad=True)

    def bwd(y):
        y.backward(torch.ones_like(y))

    return {
        "grouped_mm fwd": lambda: grouped_mm(rows.detach(), w, offsets),
        "grouped_mlp fwd+bwd": lambda: bwd(grouped_mlp(rows, offsets, w1, w2, rp)),
        "permute fwd+bwd": lambda: bwd(permute(x, idx, probs, num_experts=E).hidden),
        "unpermute fwd+bwd": lambda: bwd(unpermute(ey, d)),
        "topk_routing fwd+bwd": lambda: bwd(topk_routing(logits, K)[0]),
        "MoELayer fwd+bwd": lambda: bwd(layer(x)),
    }


def cycles_per_ms() -> float:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def host_us(fn, cpm: float, batches: int = 8, per_batch: int = 10) -> float:
    """Median over batches of host µs per call, each batch behind a sleep long enough."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    upper_ms = (time.perf_counter() - t0) * 1e3
    out = []
    for _ in range(batches):
        torch.cuda._sleep(int((5 + 2 * per_batch * upper_ms) * cpm))
        slept = torch.cuda.Event()
        slept.record()
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        dt = time.perf_counter() - t0
        if slept.query():
            out.append(float("nan"))  # the GPU went idle: the host waited
        else:
            out.append(dt / per_batch * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


VARIANTS = ("all", "no_bypass", "no_replay", "plain")


def host_table(rounds: int, names: tuple[str, ...] = VARIANTS) -> dict:
    cpm = cycles_per_ms()
    fns = calls()
    got = {(op, v): [] for op in fns for v in names}
    for r in range(rounds):
        for op, fn in fns.items():
            order = names if r % 2 == 0 else names[::-1]
            for v in order:
                with variant(v):
                    got[(op, v)].append(host_us(fn, cpm))
    return {f"{op} | {v}": vals for (op, v), vals in got.items()}


def peak_mib(owned: bool) -> float:
    mlp_module = sys.modules["moekit.ops.grouped_mlp"]  # the ops package shadows the name
    saved = mlp_module.owned_gradient
    if not owned:
        mlp_module.owned_gradient = lambda grad: False
    try:
        layer = MoELayer(2048, 768, 128, 8, device=DEV, dtype=DT)
        x = torch.randn(16384, 2048, device=DEV, dtype=DT, requires_grad=True)
        for _ in range(2):
            layer(x).sum().backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        layer(x).sum().backward()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    finally:
        mlp_module.owned_gradient = saved


FIRST_CALL = """
import sys, time, torch
sys.path.insert(0, {root!r})
import moekit.ops
import moekit.runtime.replay as replay
mlp = sys.modules["moekit.ops.grouped_mlp"]
if {off}:
    replay.compile_ahead = mlp.compile_ahead = lambda body, wait=True: None
from moekit.nn import MoELayer
layer = MoELayer(1536, 640, 24, 3, device="cuda", dtype=torch.bfloat16)
x = torch.randn(333, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
t0 = time.perf_counter()
layer(x).sum().backward()
torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def first_call_s(off: bool) -> float:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        code = FIRST_CALL.format(root=root, off=off)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True, timeout=240)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--skip-first-call", action="store_true")
    ap.add_argument("--tree", default=None, help="import moekit from this checkout")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--host-only", action="store_true", help="no memory or first-call figures")
    args = ap.parse_args()
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "tree": args.tree or "this checkout"}
    res["host_us"] = host_table(args.rounds, tuple(args.variants))
    if not args.host_only:
        res["peak_mib"] = {"owned_gradient": peak_mib(True), "no_reuse": peak_mib(False)}
    if not (args.host_only or args.skip_first_call):
        res["first_call_s"] = {"compile_ahead": first_call_s(False), "off": first_call_s(True)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "runtime_mechanisms.json"), "w") as f:
        json.dump(res, f, indent=1)
    ops = sorted({k.split(" | ")[0] for k in res["host_us"]})
    print(f"host µs per call, median of {args.rounds} rounds [min–max], {res['device']}, "
          f"{res['tree']}")  # fmt: skip
    print(f"{'call':<22}" + "".join(f"{v:>22}" for v in args.variants))
    for op in ops:
        cells = []
        for v in args.variants:
            vals = res["host_us"][f"{op} | {v}"]
            cells.append(f"{statistics.median(vals):7.1f} [{min(vals):.0f}–{max(vals):.0f}]")
        print(f"{op:<22}" + "".join(f"{c:>22}" for c in cells))
    if "peak_mib" in res:
        print("peak MiB, Qwen3-like layer fwd+bwd:", res["peak_mib"])
        print("first fwd+bwd of a new shape, s:", res.get("first_call_s"))


if __name__ == "__main__":
    main()
