"""Hugging Face models with ``experts_implementation="moekit"`` against the built-in backends.

    python benchmarks/benchmark_hf.py --out bench_out [--quick] [--smoke] [--autocast]

Random-initialised two-layer Qwen3-MoE and OLMoE, bf16, against eager, batched_mm, grouped_mm:
train tokens/s (seq 4096; --autocast: fp32 params under bf16 autocast), greedy generate tokens/s
(batch 1, 16), the experts module alone (µs, 1 and 16 tokens). CUDA events after warm-up;
generate and experts best of 3 rounds in turns.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import common as bc
import torch
import transformers

import moekit.integrations.transformers  # noqa: F401  (registers "moekit")

ATTN = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128)
MODELS = {
    "qwen3_30b_a3b_2l": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768,
                         intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
                         num_hidden_layers=2, norm_topk_prob=True, **ATTN)),
    "olmoe_2l": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_experts=64,
                 num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=16))}  # fmt: skip
SMOKE_MODELS = {"smoke_qwen3": ("qwen3_moe", dict(hidden_size=64, moe_intermediate_size=32,
                intermediate_size=96, num_experts=8, num_experts_per_tok=2, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16))}  # fmt: skip
IMPLS = ("moekit", "grouped_mm", "batched_mm", "eager")
TRAIN_TARGETS = {"grouped_mm": 1.5, "eager": 3.0}
AUTOCAST_IMPLS = ("moekit", "grouped_mm")
GENERATE_ROUNDS = 3
PASSES = ("train", "train_autocast", "generate1", "generate16")


def build(family: str, dims: dict, device, dtype):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, vocab_size=32768, tie_word_embeddings=False,
                                               max_position_embeddings=8192, **dims)  # fmt: skip
    auto = transformers.AutoModelForCausalLM
    return auto.from_config(config, experts_implementation="eager", dtype=dtype).to(device)


def train_tokens_per_s(model, impl, seq, batch, steps, cuda, autocast=False) -> float:
    model.set_experts_implementation(impl)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=model.device)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return batch * seq / bc.mean_ms(step, steps, cuda, warmup=2) * 1e3


def generate_tokens_per_s(model, impl, batch, new_tokens, cuda, warm: bool = True) -> float:
    model.set_experts_implementation(impl)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, 32), device=model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    run = torch.no_grad()(lambda: model.generate(ids, **kw, pad_token_id=0))
    return batch * new_tokens / bc.mean_ms(run, 1, cuda, warmup=int(warm)) * 1e3


def experts_call_us(model, impl, tokens: int, cuda: bool, calls: int = 200) -> float:
    """Wall µs per call of the first layer's experts module (random top-k routing)."""
    model.set_experts_implementation(impl)
    experts = model.model.layers[0].mlp.experts
    E, k = experts.gate_up_proj.shape[0], model.config.num_experts_per_tok
    g = torch.Generator(device=model.device).manual_seed(tokens)
    x = torch.randn(tokens, model.config.hidden_size, device=model.device, dtype=model.dtype)
    weights, ids = torch.rand(tokens, E, device=model.device, generator=g).softmax(-1).topk(k)
    weights = weights.to(model.dtype)
    with torch.no_grad():
        return bc.mean_ms(lambda: experts(x, ids, weights), calls, cuda, warmup=3) * 1e3


def _guard(row: dict, fn, key: str, better=None) -> None:
    """``row[key]`` = fn() (the better of it and the kept figure with ``better``; a NaN of a
    failed round never wins), or NaN with the error recorded in the row (e.g. out of memory)."""
    try:
        v = fn()
    except Exception as exc:  # a contender that cannot run this shape
        row.setdefault("errors", []).append(bc.error_line(exc))
        bc.release_memory()
        v = float("nan")
    row[key] = better(row[key], v) if better and key in row and v == v else row.get(key, v)


def run_model(name: str, family: str, dims: dict, args, cuda: bool, device, dtype) -> dict:
    seq, new_tokens = (32, 4) if args.smoke else (4096, 128)
    model = build(family, dims, device, dtype)
    r = {"model": name, "family": family, "seq": seq, "batch": args.batch}
    steps = 1 if args.smoke else (3 if args.quick else 6)
    train = partial(train_tokens_per_s, seq=seq, batch=args.batch, cuda=cuda)
    for impl in IMPLS[:2] + (() if args.quick else ("eager",)):  # batched_mm: decode only
        n = 1 if impl == "eager" else steps
        _guard(r, partial(train, model, impl, steps=n), f"train_{impl}")
    # generate / experts alone: noisy host timings, the backends take turns, each keeps its best
    rounds = 0 if args.train_only else 1 if args.smoke else GENERATE_ROUNDS
    for rnd in range(rounds):
        for impl, b in itertools.product(IMPLS[: 3 if rnd else 4], (1, 16)):
            fn = partial(generate_tokens_per_s, model, impl, b, new_tokens, cuda, rnd == 0)
            _guard(r, fn, f"generate{b}_{impl}", max)
    for _, impl, t in itertools.product(range(rounds), IMPLS[:-1], (1, 16)):
        _guard(r, partial(experts_call_us, model, impl, t, cuda), f"experts{t}_us_{impl}", min)
    if args.autocast:
        del model
        model = build(family, dims, device, torch.float32)
        for impl in AUTOCAST_IMPLS:
            fn = partial(train, model, impl, steps=steps, autocast=True)
            _guard(r, fn, f"train_autocast_{impl}")
        ac = {i: r[f"train_autocast_{i}"] for i in AUTOCAST_IMPLS}
        r["train_autocast_vs_grouped_mm"] = ac["moekit"] / ac["grouped_mm"]
    for base in TRAIN_TARGETS:
        if f"train_{base}" in r:
            r[f"train_vs_{base}"] = r["train_moekit"] / r[f"train_{base}"]
    for b in (1, 16) if "generate1_moekit" in r else ():
        best = max((v for v in (r.get(f"generate{b}_{i}", math.nan) for i in IMPLS[1:]) if v == v),
                   default=math.nan)  # fmt: skip
        r[f"generate{b}_vs_best_builtin"] = r[f"generate{b}_moekit"] / best
        if f"experts{b}_us_moekit" in r:
            r[f"experts{b}_us_builtin_best"] = min(r[f"experts{b}_us_{i}"] for i in IMPLS[1:3])
    return r


def report_rows(rows: list[dict]) -> list[dict]:
    """One table line per model and pass: each backend's figure and moekit's ratio."""
    out = []
    for r, p in itertools.product(rows, (*PASSES, "experts1_us", "experts16_us")):
        if f"{p}_moekit" not in r:
            continue
        if p == "train":
            ratio = " / ".join(f"{r[f'train_vs_{b}']:.2f} {b}" for b in TRAIN_TARGETS
                               if f"train_vs_{b}" in r)  # fmt: skip
        elif p == "train_autocast":
            ratio = f"{r['train_autocast_vs_grouped_mm']:.2f} grouped_mm"
        elif p.startswith("experts"):
            ratio = f"{r[f'{p}_moekit'] / r[f'{p}_builtin_best']:.2f} of best"
        else:
            ratio = f"{r[f'{p}_vs_best_builtin']:.2f} best built-in"
        out.append({"model": r["model"], "pass": p, "moekit ×": ratio,
                    **{i: r.get(f"{p}_{i}") for i in IMPLS}})  # fmt: skip
    return out


def main() -> None:
    ap = bc.parser(__doc__, quick="fewer steps, no eager training")
    ap.add_argument("--batch", type=int, default=2, help="training sequences per step")
    ap.add_argument("--autocast", action="store_true", help="also fp32 params, bf16 autocast")
    ap.add_argument("--train-only", action="store_true", help="skip generation and experts")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    run = partial(run_model, args=args, cuda=cuda, device=device, dtype=dtype)
    models = SMOKE_MODELS if args.smoke else MODELS
    rows, _, failed = bc.run_cases((n, partial(run, n, *fd)) for n, fd in models.items())
    meta = bc.meta(cuda, failed=failed, transformers=transformers.__version__)
    panels = [bc.Panel({r["model"]: [r.get(f"{p}_{i}") or 0.0 for i in IMPLS] for r in rows},
                       "tokens/s", IMPLS, title=p)
              for p in PASSES if any(f"{p}_moekit" in r for r in rows)]  # fmt: skip
    bc.log(f"tokens/s, {meta['device']}, bf16" if cuda else "tokens/s, cpu (smoke)")
    data = {"meta": meta, "rows": rows, "table": report_rows(rows)}
    cols = ["model", "pass", *IMPLS, "moekit ×"]
    bc.finish(args.out, "hf", data, cols, panels, floatfmt=",.0f", rows_key="table")


if __name__ == "__main__":
    main()
