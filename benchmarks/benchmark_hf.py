"""Hugging Face transformers models with ``experts_implementation="moekit"`` against the
built-in backends (``eager``, ``batched_mm``, ``grouped_mm``).

    python benchmarks/benchmark_hf.py --out bench_out [--quick] [--smoke]

Models: random-initialised Qwen3-MoE and OLMoE with the real MoE layer sizes of Qwen3-30B-A3B
(H 2048, E 128, top-8, F 768) and OLMoE-1B-7B (H 2048, E 64, top-8, F 1024), fewer layers and a
32k vocabulary (so the output head does not hide the experts), bf16.

  train     forward + backward of a causal-LM loss, sequence 4096 × batch: tokens/s
            (not batched_mm, which gathers a copy of the expert weights per row)
  generate  greedy decoding of 128 new tokens after a 32-token prompt, batch 1 and 16: new
            tokens/s (decode steps route batch × top-k rows)
  experts   the first layer's experts module alone under no_grad, 1 and 16 tokens: wall µs
            per call of back-to-back calls (a decode step's experts work, host-bound)
  train_autocast  (``--autocast``) the train pass of the same model with fp32 parameters under
            ``torch.autocast(bfloat16)`` (what ``Trainer(bf16=True)`` does with an fp32
            model), moekit against grouped_mm

Each implementation runs on the same model (``set_experts_implementation``), timed with CUDA
events after warm-up steps; generation runs take turns across the backends, best of 3 each. Writes hf.json and hf.png under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
from common import error_line, pyplot, save_figure, write_json

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

import transformers

import moekit.integrations.transformers  # noqa: F401  (registers "moekit")

ATTN = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128)
MODELS = {
    "qwen3_30b_a3b_2l": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768,
                         intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                         num_hidden_layers=2, norm_topk_prob=True, **ATTN)),
    "olmoe_2l": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                 num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16)),
}  # fmt: skip
SMOKE_MODELS = {
    "smoke_qwen3": ("qwen3_moe", dict(hidden_size=64, moe_intermediate_size=32,
                    intermediate_size=96, num_experts=8, num_experts_per_tok=2,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16)),
}  # fmt: skip
IMPLS = ("moekit", "grouped_mm", "batched_mm", "eager")
TRAIN_TARGETS = {"grouped_mm": 1.5, "eager": 3.0}
AUTOCAST_IMPLS = ("moekit", "grouped_mm")
GENERATE_ROUNDS = 3


def build(family: str, dims: dict, device, dtype):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        family, vocab_size=32768, max_position_embeddings=8192, tie_word_embeddings=False,
        **dims,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation="eager", dtype=dtype
    )
    return model.to(device)


def seconds(fn, steps: int, cuda: bool) -> float:
    """Wall seconds per call of ``fn`` (CUDA events on a GPU)."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def train_tokens_per_s(model, impl, seq, batch, steps, cuda, autocast=False) -> float:
    model.set_experts_implementation(impl)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=model.device)
    region = partial(torch.autocast, model.device.type, dtype=torch.bfloat16, enabled=autocast)

    def step():
        model.zero_grad(set_to_none=True)
        with region():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    for _ in range(2):
        step()
    return batch * seq / seconds(step, steps, cuda)


def generate_tokens_per_s(model, impl, batch, new_tokens, cuda, warm: bool = True) -> float:
    model.set_experts_implementation(impl)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, 32), device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def run():
        with torch.no_grad():
            model.generate(ids, **kw, pad_token_id=0)

    if warm:
        run()
    return batch * new_tokens / seconds(run, 1, cuda)


def experts_call_us(model, impl, tokens: int, cuda: bool, calls: int = 200) -> float:
    """Wall µs per call of the first layer's experts module on ``tokens`` tokens (random top-k
    routing), back-to-back under no_grad, synchronised once at the end."""
    model.set_experts_implementation(impl)
    experts = model.model.layers[0].mlp.experts
    E, k = experts.gate_up_proj.shape[0], model.config.num_experts_per_tok
    g = torch.Generator(device=model.device).manual_seed(tokens)
    x = torch.randn(tokens, model.config.hidden_size, device=model.device, dtype=model.dtype)
    scores = torch.rand(tokens, E, device=model.device, generator=g)
    weights, ids = scores.softmax(-1).topk(k, dim=-1)
    weights = weights.to(model.dtype)
    with torch.no_grad():
        for _ in range(3):
            experts(x, ids, weights)
        return seconds(lambda: experts(x, ids, weights), calls, cuda) * 1e6


def _guard(row: dict, fn) -> float:
    """fn(), or NaN with the error recorded in the row (e.g. out of memory)."""
    try:
        return fn()
    except Exception as exc:  # a contender that cannot run this shape
        row.setdefault("errors", []).append(error_line(exc))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return float("nan")


def plot(rows: list[dict], path: str) -> None:
    """One panel of tokens/s per pass that ran, a bar per backend and model."""
    try:
        plt = pyplot()
    except ImportError:
        return
    passes = [p for p in ("train", "train_autocast", "generate1", "generate16")
              if any(f"{p}_moekit" in r for r in rows)]  # fmt: skip
    fig, axes = plt.subplots(1, len(passes), figsize=(4 * len(passes), 3.6), squeeze=False)
    for ax, p in zip(axes[0], passes):
        for j, r in enumerate(rows):
            vals = [r.get(f"{p}_{i}") or 0.0 for i in IMPLS]
            ax.bar([k + 0.4 * j for k in range(len(IMPLS))], vals, 0.4, label=r["model"])
        ax.set_xticks([k + 0.2 for k in range(len(IMPLS))], IMPLS, rotation=20)
        ax.set_title(p)
        ax.set_ylabel("tokens/s")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="fewer steps, no eager training")
    ap.add_argument("--smoke", action="store_true", help="tiny model; runs on CPU too")
    ap.add_argument("--batch", type=int, default=2, help="training sequences per step")
    ap.add_argument("--autocast", action="store_true",
                    help="also train an fp32 copy under bf16 autocast")  # fmt: skip
    ap.add_argument("--train-only", action="store_true", help="skip generation and experts")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    models = SMOKE_MODELS if args.smoke else MODELS
    seq, new_tokens = (32, 4) if args.smoke else (4096, 128)
    rows = []
    for name, (family, dims) in models.items():
        model = build(family, dims, device, dtype)
        r = {"model": name, "family": family, "seq": seq, "batch": args.batch}
        for impl in IMPLS:
            if impl == "eager" and args.quick:
                continue
            steps = 1 if (impl == "eager" or args.smoke) else (3 if args.quick else 6)
            if impl != "batched_mm":  # it gathers a weight copy per row: decode only
                r[f"train_{impl}"] = _guard(
                    r, partial(train_tokens_per_s, model, impl, seq, args.batch, steps, cuda)
                )
        # generation: short runs with noisy host timing, so the backends take turns and each
        # keeps its best of GENERATE_ROUNDS
        for rnd in range(0 if args.train_only else 1 if args.smoke else GENERATE_ROUNDS):
            for impl in IMPLS:
                if impl == "eager" and rnd > 0:  # far behind the others: one round
                    continue
                for b in (1, 16):
                    fn = partial(generate_tokens_per_s, model, impl, b, new_tokens, cuda, rnd == 0)
                    v = _guard(r, fn)
                    key = f"generate{b}_{impl}"
                    r[key] = max(r.get(key, v), v) if v == v else v
        for _ in range(0 if args.train_only else 1 if args.smoke else GENERATE_ROUNDS):
            for impl in IMPLS[:-1]:
                for t in (1, 16):
                    v = _guard(r, partial(experts_call_us, model, impl, t, cuda))
                    key = f"experts{t}_us_{impl}"
                    r[key] = min(r.get(key, v), v) if v == v else v
        if args.autocast:
            del model
            model = build(family, dims, device, torch.float32)
            for impl in AUTOCAST_IMPLS:
                steps = 1 if args.smoke else (3 if args.quick else 6)
                r[f"train_autocast_{impl}"] = _guard(
                    r, partial(train_tokens_per_s, model, impl, seq, args.batch, steps, cuda, True)
                )
            r["train_autocast_vs_grouped_mm"] = (
                r["train_autocast_moekit"] / r["train_autocast_grouped_mm"]
            )
        for impl in IMPLS:
            print(f"{name} {impl}: " + ", ".join(
                f"{k.removesuffix('_' + impl)} {v:,.0f}" for k, v in r.items()
                if k.endswith("_" + impl) and "_vs_" not in k
            ), flush=True)  # fmt: skip
        for base in TRAIN_TARGETS:
            if f"train_{base}" in r:
                r[f"train_vs_{base}"] = r["train_moekit"] / r[f"train_{base}"]
        for b in (1, 16) if "generate1_moekit" in r else ():
            builtin = max(
                (r[f"generate{b}_{i}"] for i in IMPLS[1:] if f"generate{b}_{i}" in r),
                key=lambda v: -1.0 if v != v else v,  # NaN (failed) never wins
            )
            r[f"generate{b}_vs_best_builtin"] = r[f"generate{b}_moekit"] / builtin
            if f"experts{b}_us_moekit" in r:
                r[f"experts{b}_us_builtin_best"] = min(
                    r[f"experts{b}_us_{i}"] for i in ("grouped_mm", "batched_mm")
                )
        rows.append(r)
        del model
        if cuda:
            torch.cuda.empty_cache()
    lines = [f"tokens/s, {torch.cuda.get_device_name() if cuda else 'cpu'}, bf16" if cuda else
             "tokens/s, cpu (smoke)"]  # fmt: skip
    head = f"{'model':<18}{'pass':<15}" + "".join(f"{i:>12}" for i in IMPLS) + f"  {'moekit ×'}"
    lines += [head, "-" * len(head)]
    for r in rows:
        for p in ("train", "train_autocast", "generate1", "generate16"):
            if f"{p}_moekit" not in r:
                continue
            vals = "".join(f"{r.get(f'{p}_{i}', float('nan')):>12,.0f}" for i in IMPLS)
            if p == "train":
                ratio = " / ".join(f"{r[f'train_vs_{b}']:.2f} {b}" for b in TRAIN_TARGETS
                                   if f"train_vs_{b}" in r)  # fmt: skip
            elif p == "train_autocast":
                ratio = f"{r['train_autocast_vs_grouped_mm']:.2f} grouped_mm"
            else:
                ratio = f"{r[f'{p}_vs_best_builtin']:.2f} best built-in"
            lines.append(f"{r['model']:<18}{p:<15}{vals}  {ratio}")
        for t in (1, 16):
            if f"experts{t}_us_moekit" not in r:
                continue
            vals = "".join(f"{r.get(f'experts{t}_us_{i}', float('nan')):>12,.0f}" for i in IMPLS)
            best = r[f"experts{t}_us_moekit"] / r[f"experts{t}_us_builtin_best"]
            lines.append(f"{r['model']:<18}{f'experts{t} µs':<15}{vals}  {best:.2f} of best")
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    write_json(os.path.join(args.out, "hf.json"), {"meta": meta, "rows": rows}, nan_as_null=True)
    plot(rows, os.path.join(args.out, "hf.png"))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
