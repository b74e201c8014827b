"""Megatron-Core GPT-MoE training step (forward + backward, bf16, one GPU) with moekit's experts,
Megatron's SequentialMLP and a torch._grouped_mm experts stand-in, side by side in one run.

    python benchmarks/benchmark_megatron.py [--shapes qwen3_30b_a3b] [--layers 2] [--out DIR]
    torchrun --nproc_per_node=4 benchmarks/benchmark_megatron.py --ep     (expert parallelism)

Per shape (megatron_gpt.py): the step's ms with each backend, and with moekit's experts and
Megatron's permute and router fused by moekit (``moekit_fusions``); the MoE layers' own GPU time
within the step (CUDA events at each layer's boundaries, forward and backward) and the step's
ceiling, the step with that time taken out; one layer's experts alone on the rows Megatron
gave it, beside the dense GEMM ceiling of the same work (its six GEMMs as torch.mm over every
row). Medians of CUDA-event timed steps, in turns. Targets: step ≥ 5× SequentialMLP at Qwen3,
MoE layers ≥ 1.5× the _grouped_mm stand-in's.

With --ep, under torchrun: moekit's step (with and without the fusions) at expert parallelism =
the world size against EP 1 (each rank every expert, no communication), each rank its own
8192 tokens: tokens/s per GPU (the slowest rank's step) and their ratio, the weak-scaling figure.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys

import common as bc
import megatron_gpt as mgpt
import torch
import torch.distributed as dist

from moekit.integrations.megatron import moekit_fusions

TOKENS = 8192  # per step: micro-batch 4 × sequence 2048
SEQ, VOCAB = 2048, 32768


class MoELayerClock:
    """GPU ms inside a model's MoE layers, forward and backward, step by step: CUDA events at
    each layer's input and output, and at their gradients (the input's gradient is complete
    when the layer's backward is)."""

    def __init__(self, model) -> None:
        self.spans: list[tuple] = []
        self._open = None
        self.layers = len(model.decoder.layers)
        self._handles = []
        for layer in model.decoder.layers:
            self._handles.append(layer.mlp.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(layer.mlp.register_forward_hook(self._leave))

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _enter(self, _module, args, kwargs) -> None:
        x = args[0] if args else kwargs["hidden_states"]
        self._open = self._event()
        if x.requires_grad:
            x.register_hook(self._close)

    def _leave(self, _module, _args, out) -> None:
        self._close()
        y = out[0] if isinstance(out, tuple) else out
        if y.requires_grad:
            y.register_hook(self._reopen)

    def _reopen(self, _grad=None) -> None:
        self._open = self._event()

    def _close(self, _grad=None) -> None:
        self.spans.append((self._open, self._event()))

    def step_ms(self, skip: int = 0) -> list[float]:
        """ms of each step since the last call (after ``skip`` untimed steps), synchronising."""
        torch.cuda.synchronize()
        per_step = 2 * self.layers
        ms = [s.elapsed_time(e) for s, e in self.spans[skip * per_step :]]
        self.spans.clear()
        return [sum(ms[i : i + per_step]) for i in range(0, len(ms), per_step)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def step_fn(model, data):
    def step():
        model.zero_grad(set_to_none=True)
        model(*data[:3], labels=data[3]).float().mean().backward()

    return step


def experts_inputs(model, data) -> tuple:
    """What the first MoE layer's experts are called with in ``model``'s forward on ``data``
    (the rows as Megatron's dispatcher leaves them)."""
    box = {}

    def keep(_module, args):
        box["args"] = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)

    handle = model.decoder.layers[0].mlp.experts.register_forward_pre_hook(keep)
    with torch.no_grad():
        model(*data[:3])
    handle.remove()
    return box["args"]


def experts_ms(experts, args) -> float:
    """ms of one forward + backward of an experts module alone on the captured inputs."""
    x, counts, probs = args
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    dy = torch.randn_like(x)

    def run():
        y, _ = experts(x, counts, probs)
        y.backward(dy)

    return bc.bench_ms(run)


def dense_gemm_ms(experts, args) -> float:
    """ms of the experts' six GEMMs (forward fc1 and fc2, their input and weight gradients) as
    dense torch.mm over every row with one expert's weights, no activation: the GEMM ceiling of
    any experts backend on these rows."""
    x = args[0]
    w1, w2 = experts.fc1_weight[0].detach(), experts.fc2_weight[0].detach()  # [2F, H], [H, F]
    a = torch.randn(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    dy, dh = torch.randn_like(x), x @ w1.t()

    def run():
        x @ w1.t(), a @ w2.t(), dy @ w2, dy.t() @ a, dh @ w1, dh.t() @ x

    return bc.bench_ms(run)


def timed_steps(models: dict, data, rounds: int, per_round: int) -> tuple[dict, dict]:
    """({name: step ms}, {name: MoE layers' ms}) of each model, ``per_round`` CUDA-event timed
    steps per round, in turns (the round's first step untimed: the allocator, autotuning on
    the first round)."""
    fns = {name: step_fn(m, data) for name, m in models.items()}
    clocks = {name: MoELayerClock(m) for name, m in models.items()}
    steps, moe = {name: [] for name in fns}, {name: [] for name in fns}
    for _, (name, fn) in itertools.product(range(rounds), fns.items()):
        steps[name] += bc.event_ms(fn, per_round, warmup=1)
        moe[name] += clocks[name].step_ms(skip=1)
    for clock in clocks.values():
        clock.remove()
    return steps, moe


def run_shape(shape: str, layers: int, rounds: int, per_round: int) -> dict:
    cfg = mgpt.gpt_config(shape, layers, torch.bfloat16)
    data = mgpt.batch(cfg, VOCAB, TOKENS // SEQ, SEQ)
    torch.manual_seed(0)
    models = {b: mgpt.build_gpt(cfg, b, VOCAB, SEQ) for b in mgpt.BACKENDS}
    # moekit's experts with Megatron's permute and router fused by moekit (moekit_fusions): the
    # other models' configs keep the flags off, so they run Megatron's unfused code as before
    with moekit_fusions(mgpt.gpt_config(shape, layers, torch.bfloat16)) as fused_cfg:
        models["moekit_fused"] = mgpt.build_gpt(fused_cfg, "moekit", VOCAB, SEQ)
        times, moe_times = timed_steps(models, data, rounds, per_round)
    ms = {n: statistics.median(t) for n, t in times.items()}
    moe = {n: statistics.median(t) for n, t in moe_times.items()}
    rest = statistics.median(ms[n] - moe[n] for n in ms)  # the step without its MoE layers
    args = experts_inputs(models["moekit"], data)
    alone = {n: experts_ms(models[n].decoder.layers[0].mlp.experts, args) for n in mgpt.BACKENDS}
    dense = dense_gemm_ms(models["moekit"].decoder.layers[0].mlp.experts, args)
    row = {"shape": shape, "layers": layers, "tokens": TOKENS,
           **{f"{n}_ms": v for n, v in ms.items()},
           **{f"{n}_spread_ms": max(t) - min(t) for n, t in times.items()},
           **{f"{n}_moe_ms": v for n, v in moe.items()},
           "rest_ms": rest,
           "step_x_sequential": ms["sequential"] / ms["moekit"],
           "fused_x_sequential": ms["sequential"] / ms["moekit_fused"],
           "ceiling_x_sequential": ms["sequential"] / rest,
           "step_x_grouped_mm": ms["grouped_mm"] / ms["moekit"],
           "moe_x_grouped_mm": moe["grouped_mm"] / moe["moekit"],
           "fused_moe_x_grouped_mm": moe["grouped_mm"] / moe["moekit_fused"],
           **{f"{n}_experts_alone_ms": v for n, v in alone.items()},
           "dense_gemm_ms": dense,
           "alone_x_grouped_mm": alone["grouped_mm"] / alone["moekit"],
           "alone_x_sequential": alone["sequential"] / alone["moekit"],
           "ceiling_alone_x_grouped_mm": alone["grouped_mm"] / dense}  # fmt: skip
    del models
    return row


def run_ep_shape(shape: str, layers: int, rounds: int, per_round: int) -> dict:
    """moekit's step at EP = the world size and at EP 1, each rank on its own batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    row = {"shape": shape, "layers": layers, "tokens_per_gpu": TOKENS, "ep": world}
    for ep in sorted({1, world}):
        mgpt.set_expert_parallel(ep)
        cfg = mgpt.gpt_config(shape, layers, torch.bfloat16, ep=ep)
        data = mgpt.batch(cfg, VOCAB, TOKENS // SEQ, SEQ, seed=rank)
        models = {"moekit": mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ)}
        with moekit_fusions(mgpt.gpt_config(shape, layers, torch.bfloat16, ep=ep)) as fused_cfg:
            models["moekit_fused"] = mgpt.build_gpt(fused_cfg, "moekit", VOCAB, SEQ)
            times, moe = timed_steps(models, data, rounds, per_round)
        for name in models:
            ms = bc.over_ranks(statistics.median(times[name]))
            row[f"{name}_ep{ep}_ms"] = ms
            row[f"{name}_ep{ep}_moe_ms"] = bc.over_ranks(statistics.median(moe[name]))
            row[f"{name}_ep{ep}_tokens_per_s_per_gpu"] = TOKENS / ms * 1e3
        del models
    for name in ("moekit", "moekit_fused"):
        row[f"{name}_weak_scaling"] = row[f"{name}_ep1_ms"] / row[f"{name}_ep{world}_ms"]
    return row


def main_ep(args) -> int:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    world = dist.get_world_size()
    cases = [(s, lambda s=s: run_ep_shape(s, args.layers, args.rounds, args.per_round))
             for s in args.shapes]  # fmt: skip
    rows, skipped, failed = bc.run_cases(cases)
    if dist.get_rank() == 0:
        data = {**bc.meta(True, layers=args.layers, world=world, failed=failed,
                          skipped=skipped), "rows": rows}  # fmt: skip
        cols = ["shape"]
        for name, label in (("moekit", "moekit"), ("moekit_fused", "+fusions")):
            cols += [(f"{label} EP1 ms", f"{name}_ep1_ms"),
                     (f"{label} EP{world} ms", f"{name}_ep{world}_ms"),
                     (f"{label} EP{world} tok/s/GPU", f"{name}_ep{world}_tokens_per_s_per_gpu"),
                     (f"{label} weak scaling", f"{name}_weak_scaling")]  # fmt: skip
        bars = {f"{label} EP{ep}": f"{name}_ep{ep}_tokens_per_s_per_gpu" for ep in (1, world)
                for name, label in (("moekit", "moekit"), ("moekit_fused", "+ fusions"))}  # fmt: skip
        panels = [bc.bars(rows, bars, "tokens/s per GPU (higher is better)")]
        bc.finish(args.out, f"megatron_ep{world}", data, cols, panels,
                  f"Megatron-Core GPT-MoE, EP {world} against EP 1")  # fmt: skip
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = bc.parser(__doc__, smoke=False)
    ap.add_argument("--shapes", nargs="*", default=["qwen3_30b_a3b", "deepseek_v3_ep8"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=3)
    ap.add_argument("--ep", action="store_true", help="expert parallelism, under torchrun")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.ep:
        return main_ep(args)
    mgpt.init_single_process()
    cases = [(s, lambda s=s: run_shape(s, args.layers, args.rounds, args.per_round))
             for s in args.shapes]  # fmt: skip
    rows, skipped, failed = bc.run_cases(cases)
    data = {**bc.meta(True, layers=args.layers, failed=failed, skipped=skipped), "rows": rows}
    cols = ["shape", ("moekit ms", "moekit_ms"), ("+fusions ms", "moekit_fused_ms"),
            ("sequential ms", "sequential_ms"), ("grouped_mm ms", "grouped_mm_ms"),
            ("× seq", "step_x_sequential"), ("+fusions × seq", "fused_x_sequential"),
            ("ceiling × seq", "ceiling_x_sequential"), ("MoE ms", "moekit_moe_ms"),
            ("+fusions MoE ms", "moekit_fused_moe_ms"), ("gmm MoE ms", "grouped_mm_moe_ms"),
            ("MoE × gmm", "moe_x_grouped_mm"), ("+fusions MoE × gmm", "fused_moe_x_grouped_mm"),
            ("experts alone ms", "moekit_experts_alone_ms"),
            ("alone × gmm", "alone_x_grouped_mm"), ("alone × seq", "alone_x_sequential"),
            ("GEMM ceiling × gmm", "ceiling_alone_x_grouped_mm")]  # fmt: skip
    panels = [bc.bars(rows, {"moekit": "moekit_ms", "moekit + fusions": "moekit_fused_ms",
                             "SequentialMLP": "sequential_ms", "_grouped_mm": "grouped_mm_ms",
                             "without MoE layers": "rest_ms"},
                      "step ms (lower is better)")]  # fmt: skip
    bc.finish(args.out, "megatron", data, cols, panels, "Megatron-Core GPT-MoE step, bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
