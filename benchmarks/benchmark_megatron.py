"""Megatron-Core GPT-MoE training step (forward + backward, bf16, one GPU) with moekit's experts,
Megatron's SequentialMLP and a torch._grouped_mm experts stand-in, side by side in one run.

    python benchmarks/benchmark_megatron.py [--shapes qwen3_30b_a3b] [--layers 2] [--out DIR]

Per shape (megatron_gpt.py): the step's ms with each backend, with moekit's experts and
Megatron's permute and router fused by moekit (``moekit_fusions``), and with no experts (the
ceiling); the experts' share (step − ceiling), one layer's experts alone on the rows Megatron
gave it;
medians of CUDA-event timed steps, in turns. Targets: step ≥ 5× SequentialMLP at Qwen3,
experts ≥ 1.5× the _grouped_mm stand-in.
"""

from __future__ import annotations

import itertools
import statistics
import sys

import common as bc
import megatron_gpt as mgpt
import torch

from moekit.integrations.megatron import MoekitExperts, moekit_fusions, with_moekit_experts

TOKENS = 8192  # per step: micro-batch 4 × sequence 2048
SEQ, VOCAB = 2048, 32768


class NoExperts(MoekitExperts):
    """The ceiling: the step with no expert computation (the rows come back as they went)."""

    def forward(self, x, tokens_per_expert, probs):
        return x * probs.unsqueeze(-1).to(x.dtype), None


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


def timed_steps(fns: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    """ms of each step function, ``per_round`` CUDA-event timed calls per round, in turns (the
    round's first call untimed: the allocator, autotuning on the first round)."""
    times = {name: [] for name in fns}
    for _, (name, fn) in itertools.product(range(rounds), fns.items()):
        times[name] += bc.event_ms(fn, per_round, warmup=1)
    return times


def run_shape(shape: str, layers: int, rounds: int, per_round: int) -> dict:
    cfg = mgpt.gpt_config(shape, layers, torch.bfloat16)
    data = mgpt.batch(cfg, VOCAB, TOKENS // SEQ, SEQ)
    torch.manual_seed(0)
    models = {b: mgpt.build_gpt(cfg, b, VOCAB, SEQ) for b in mgpt.BACKENDS}
    spec = with_moekit_experts(mgpt.layer_spec("sequential"), NoExperts)
    models["ceiling"] = mgpt.GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                                      position_embedding_type="rope").cuda()  # fmt: skip
    # moekit's experts with Megatron's permute and router fused by moekit (moekit_fusions): the
    # other models' configs keep the flags off, so they run Megatron's unfused code as before
    with moekit_fusions(mgpt.gpt_config(shape, layers, torch.bfloat16)) as fused_cfg:
        models["moekit_fused"] = mgpt.build_gpt(fused_cfg, "moekit", VOCAB, SEQ)
        times = timed_steps({n: step_fn(m, data) for n, m in models.items()}, rounds, per_round)
    ms = {n: statistics.median(t) for n, t in times.items()}
    args = experts_inputs(models["moekit"], data)
    alone = {n: experts_ms(models[n].decoder.layers[0].mlp.experts, args) for n in mgpt.BACKENDS}
    experts = {n: ms[n] - ms["ceiling"] for n in mgpt.BACKENDS}
    row = {"shape": shape, "layers": layers, "tokens": TOKENS,
           **{f"{n}_ms": v for n, v in ms.items()},
           **{f"{n}_spread_ms": max(t) - min(t) for n, t in times.items()},
           **{f"{n}_experts_ms": v for n, v in experts.items()},
           "step_x_sequential": ms["sequential"] / ms["moekit"],
           "fused_x_moekit": ms["moekit"] / ms["moekit_fused"],
           "step_x_grouped_mm": ms["grouped_mm"] / ms["moekit"],
           "ceiling_x_sequential": ms["sequential"] / ms["ceiling"],
           "experts_x_grouped_mm": experts["grouped_mm"] / experts["moekit"],
           "experts_x_sequential": experts["sequential"] / experts["moekit"],
           **{f"{n}_experts_alone_ms": v for n, v in alone.items()},
           "alone_x_grouped_mm": alone["grouped_mm"] / alone["moekit"],
           "alone_x_sequential": alone["sequential"] / alone["moekit"]}  # fmt: skip
    del models
    return row


def main(argv=None) -> int:
    ap = bc.parser(__doc__, smoke=False)
    ap.add_argument("--shapes", nargs="*", default=["qwen3_30b_a3b", "deepseek_v3_ep8"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    mgpt.init_single_process()
    cases = [(s, lambda s=s: run_shape(s, args.layers, args.rounds, args.per_round))
             for s in args.shapes]  # fmt: skip
    rows, skipped, failed = bc.run_cases(cases)
    data = {**bc.meta(True, layers=args.layers, failed=failed, skipped=skipped), "rows": rows}
    cols = ["shape", ("moekit ms", "moekit_ms"), ("sequential ms", "sequential_ms"),
            ("grouped_mm ms", "grouped_mm_ms"), ("ceiling ms", "ceiling_ms"),
            ("× sequential", "step_x_sequential"), ("ceiling × seq", "ceiling_x_sequential"),
            ("+fusions ms", "moekit_fused_ms"), ("fusions ×", "fused_x_moekit"),
            ("× grouped_mm", "step_x_grouped_mm"), ("experts ms", "moekit_experts_ms"),
            ("gmm experts ms", "grouped_mm_experts_ms"),
            ("experts × gmm", "experts_x_grouped_mm"),
            ("1 layer's experts ms", "moekit_experts_alone_ms"),
            ("alone × gmm", "alone_x_grouped_mm"), ("alone × seq", "alone_x_sequential")]  # fmt: skip
    panels = [bc.bars(rows, {"moekit": "moekit_ms", "moekit + fusions": "moekit_fused_ms",
                             "SequentialMLP": "sequential_ms",
                             "_grouped_mm": "grouped_mm_ms", "no experts": "ceiling_ms"},
                      "step ms (lower is better)")]  # fmt: skip
    bc.finish(args.out, "megatron", data, cols, panels, "Megatron-Core GPT-MoE step, bf16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
