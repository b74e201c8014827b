"""Which Hugging Face MoE families moekit's experts backend runs, and whether it matches eager.

For every model family of the installed transformers whose modeling code uses its experts
interface (``@use_experts_implementation``), build a tiny random-initialised model (hidden 64,
2 layers, 8 experts, top-2, vocab 128, ...; ``COMMON``, ``SHRINK`` and ``FAMILY`` below), run
forward + backward in fp32 on CPU on a 2 x 12 batch with ``experts_implementation="eager"``,
``"moekit"`` and ``"batched_mm"`` (identical weights: one model, deep-copied), and compare
logits, loss and every parameter's gradient: max abs diff over the eager tensor's max abs.
transformers' own batched_mm experts against eager give the fp32 noise of merely reordering
the experts' sums. Each family gets a verdict:

* ``match``: every experts call ran through moekit's ``grouped_mlp`` and every compared tensor
  is within ``TOL`` (or within ``NOISE`` x batched_mm's noise, with logits and loss within
  ``TOL``);
* ``mismatch``: moekit ran, but some tensor differs by more than that;
* ``fallback``: moekit warned that it runs transformers' grouped_mm / eager experts instead
  (the warning is recorded; the numbers are still compared);
* ``error``: the moekit run raised, the eager one did not;
* ``config``: the tiny model cannot be built, or its eager run raises, or no experts ran;
* ``skipped``: no text path this script knows how to drive (``SKIP``).

The model class is the family's ``*ForCausalLM`` (loss from ``labels``), else its text model
(``*TextModel``) or base model, with ``mean(last_hidden_state * R)`` for a fixed random ``R``
as the loss (not ``mean(h ** 2)``: after a final RMSNorm that is nearly constant). Weights
the model's own init leaves unusable (never initialised; all-zero routers) are re-drawn, and
said so. CPU only: this checks moekit's CPU reference path, not its Triton kernels. From the
repository root (a markdown table on stdout, progress on stderr; about 20 s on 2 CPU cores):

    .venv/bin/python experiments/hf_family_sweep.py [--families mixtral qwen3_omni_moe:talker]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import importlib
import os
import sys
import time
import traceback
import warnings

import torch
import transformers

import moekit.integrations.transformers as hf

TOL = 1e-4  # relative to the eager tensor's max abs
BATCH, SEQ = 2, 12
LAYERS = 2
# The runs: the reference, the backend under test, and transformers' batched_mm experts (its
# distance from eager is the fp32 rounding noise of merely reordering the experts' sums).
IMPLEMENTATIONS = ("eager", "moekit", "batched_mm")
NOISE = 3.0  # above TOL, a diff within NOISE x that noise (and exact logits / loss) still matches

# Applied to a family's config where its defaults have the key.
COMMON = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "dense_intermediate_size": 64,
    "moe_hidden_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    # experts and routing
    "num_experts": 8,
    "n_routed_experts": 8,
    "num_local_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
    "top_k_experts": 2,
    "first_k_dense_replace": 0,
    "num_dense_layers": 0,
    "output_router_logits": True,
    # multi-head latent attention and sparse-attention indexers
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    # linear attention
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # sliding-window attention heads of their own
    "swa_head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    # mamba
    "use_mamba_kernels": False,
}
# Where the default is a number above these, scale it down (keeps None / 0 / 1 as they are).
SHRINK = {
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
}
# Per family, on top of COMMON / SHRINK.
FAMILY: dict[str, dict] = {
    "deepseek_ocr2": {"mlp_layer_types": ["sparse"] * LAYERS},
    "dots1": {"n_shared_experts": 1},
    "ernie4_5_moe": {"moe_layer_start_index": 0, "moe_layer_end_index": LAYERS - 1},
    "ernie4_5_vl_moe": {
        "moe_intermediate_size": [32, 32],
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0,
                            "mrope_section": [3, 3, 2]},
    },
    "flint": {"mlp_only_layers": []},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1,
              "expert_layer_offset": 0},
    "glm4v_moe": {
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 2],
        }
    },
    "gemma4": {"enable_moe_block": True, "vocab_size_per_layer_input": 128,
               "hidden_size_per_layer_input": 16},
    "glm5_next": {"qk_rope_head_dim": 0, "qk_nope_head_dim": 16},
    "hy_v4_vl": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 1, 1]}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # read by the talker's MoE block, though its config class has no such field
    "qwen3_omni_moe:talker": {"shared_expert_intermediate_size": 32},
    "qwen4_exp": {
        "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
        "indexer_budget": 8, "indexer_compress_ratio": 2, "hc_lowrank": 16,
    },
    "zaya": {"num_experts_per_tok": 1},  # ZAYA supports top-1 only
}  # fmt: skip
# Model class by family, where the rule (ForCausalLM, else TextModel, else Model) is wrong, and
# further rows "family:variant" for a second experts-bearing model of a family.
MODEL_CLASS: dict[str, str] = {"qwen3_omni_moe:talker": "Qwen3OmniMoeTalkerModel"}
# Targets not run, with why (none needed in transformers 5.24).
SKIP: dict[str, str] = {}
# Targets whose model takes inputs_embeds only (no token embedding of its own).
EMBEDS_INPUT = {"qwen3_omni_moe:talker"}


def families() -> list[str]:
    """transformers' model families whose modeling code uses the experts interface."""
    root = os.path.dirname(transformers.__file__)
    found = set()
    for path in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(path) as f:
            if "use_experts_implementation" in f.read():
                found.add(os.path.basename(os.path.dirname(path)))
    return sorted(found)


def targets() -> list[str]:
    """The families, and their extra variants present in this transformers."""
    found = families()
    extra = [t for t in MODEL_CLASS if ":" in t and t.split(":")[0] in found]
    return sorted(found + extra)


def model_class(target: str) -> type:
    family = target.split(":")[0]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n in getattr(module, "__all__", []) if "PreTrained" not in n]
    if target in MODEL_CLASS:
        return getattr(module, MODEL_CLASS[target])
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        hits = sorted((n for n in names if n.endswith(suffix)), key=len)
        if hits:
            return getattr(module, hits[0])
    raise LookupError(f"no model class among {names}")


def _defaults(config_class: type) -> dict:
    config = config_class()
    values = config.to_dict()
    for field in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        try:
            values.setdefault(field.name, getattr(config, field.name))
        except Exception:  # e.g. a per-layer attribute read globally
            continue
    return values


def _per_layer(defaults: dict) -> dict:
    """Per-layer lists cut to the tiny model's layers: every kind of layer once (attention
    kinds), every MoE kind of MLP everywhere, other lists truncated."""
    full = defaults.get("num_hidden_layers")
    lists = {k: v for k, v in defaults.items() if isinstance(v, list) and len(v) == full}
    if not lists:
        return {}
    kinds = list(dict.fromkeys(lists.get("layer_types", [])))
    n = max(LAYERS, len(kinds))
    out = {"num_hidden_layers": n}
    for key, value in lists.items():
        if key == "layer_types":
            out[key] = (kinds * n)[:n]
        elif key == "mlp_layer_types":
            moe = [v for v in dict.fromkeys(value) if v != "dense"] or value
            out[key] = (moe * n)[:n]
        else:
            out[key] = value[:n]
    return out


def tiny_config(family: str, config_class: type):
    """``config_class`` with COMMON / SHRINK where its defaults have the key, per-layer lists
    cut down, token ids inside the vocabulary, then the family's own FAMILY entries."""
    defaults = _defaults(config_class)
    kwargs = {k: v for k, v in COMMON.items() if k in defaults}
    for key, small in SHRINK.items():
        value = defaults.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > small:
            kwargs[key] = small
    for key, value in defaults.items():
        if "dropout" in key and isinstance(value, float):
            kwargs[key] = 0.0
    kwargs.update(_per_layer(defaults))
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = defaults.get(key)
        if isinstance(value, int) and value >= kwargs.get("vocab_size", value + 1):
            kwargs[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[key]
    heads = defaults.get("num_attention_heads")
    if heads is not None and defaults.get("num_key_value_heads") == heads:  # stays MHA (MLA)
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    rope = defaults.get("qk_rope_head_dim")
    if rope is not None and defaults.get("head_dim") == rope:  # MLA: head_dim is the RoPE part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs.update(FAMILY.get(family, {}))
    return config_class(**kwargs)


def build(cls: type, config) -> torch.nn.Module:
    """The tiny model, fp32, training mode, eager experts, from a fixed seed. Built in torch's
    deterministic mode, which fills uninitialised memory with NaN: whatever the model's own
    init leaves untouched comes out NaN, not as whatever the allocator held."""
    torch.manual_seed(0)
    mode = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = cls._from_config(config, experts_implementation="eager")
    finally:
        torch.use_deterministic_algorithms(mode)
    return model.float().train()


def fix_init(model: torch.nn.Module) -> list[str]:
    """Re-draw (normal, std 0.02) what the model's own init left unusable: tensors it never
    initialised (NaN, see ``build``), and all-zero routers, whose ties would send every token
    to the same experts. Returns their names."""
    fixed = []
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            router = ("router" in name or name.endswith("gate.weight")) and param.dim() == 2
            if not torch.isfinite(param).all() or (router and not param.any()):
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
                fixed.append(name)
    return fixed


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``@use_experts_implementation`` decorated (it sets these attributes)."""
    return [m for m in model.modules() if hasattr(m, "has_post_expert_norm")]


def run(model, inputs: dict, causal: bool):
    """logits, loss, grads, {experts calls, grouped_mlp calls}, moekit's warnings."""
    calls = {"experts": 0, "grouped_mlp": 0}
    hooks = [
        m.register_forward_hook(lambda *_: calls.__setitem__("experts", calls["experts"] + 1))
        for m in experts_modules(model)
    ]
    real = hf.grouped_mlp

    def counted(*args, **kwargs):
        calls["grouped_mlp"] += 1
        return real(*args, **kwargs)

    hf.grouped_mlp = counted
    hf._warn_fallback.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(1)  # any dropout / jitter draws the same numbers in both runs
            model.zero_grad(set_to_none=True)
            if causal:
                out = model(**inputs, labels=inputs["input_ids"])
                logits, loss = out.logits, out.loss
            else:
                out = model(**inputs)
                logits = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
                loss = (logits.float() * probe).mean()
            loss.backward()
    finally:
        hf.grouped_mlp = real
        for h in hooks:
            h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    moekit_warnings = sorted({str(w.message) for w in caught if "moekit" in str(w.message)})
    return logits.detach(), loss.detach(), grads, calls, moekit_warnings


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if got.shape != want.shape:
        return float("inf")
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def compare(got, want) -> dict[str, float]:
    """Relative max abs diff of logits, loss and each parameter's gradient (inf where a
    gradient exists on one side only)."""
    diffs = {"logits": rel_diff(got[0], want[0]), "loss": rel_diff(got[1], want[1])}
    for name in sorted(got[2].keys() | want[2].keys()):
        both = name in got[2] and name in want[2]
        diffs[name] = rel_diff(got[2][name], want[2][name]) if both else float("inf")
    return diffs


def check(family: str, verbose: bool = False) -> dict:
    row = {"family": family, "class": "", "verdict": "", "detail": "", "rel": None}
    if family in SKIP:
        row.update(verdict="skipped", detail=SKIP[family])
        return row
    try:
        cls = model_class(family)
        row["class"] = cls.__name__
        causal = cls.__name__.endswith("ForCausalLM")
        config = tiny_config(family, cls.config_class)
        base = build(cls, config)
        redrawn = fix_init(base)
        models = {}
        for impl in IMPLEMENTATIONS:
            models[impl] = copy.deepcopy(base)
            models[impl].set_experts_implementation(impl)
        gen = torch.Generator().manual_seed(2)
        if family in EMBEDS_INPUT:
            inputs = {"inputs_embeds": torch.randn(BATCH, SEQ, config.hidden_size, generator=gen)}
        else:
            inputs = {"input_ids": torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)}
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        row.update(verdict="config", detail=f"build: {first_line(exc)}")
        return row
    results = {}
    for impl, model in models.items():
        try:
            results[impl] = run(model, inputs, causal)
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            results[impl] = exc
    eager, moekit = results["eager"], results["moekit"]
    if isinstance(eager, Exception):
        same = isinstance(moekit, Exception) and first_line(moekit) == first_line(eager)
        who = "eager and moekit" if same else "eager"
        row.update(verdict="config", detail=f"{who}: {first_line(eager)}")
        return row
    if isinstance(moekit, Exception):
        row.update(verdict="error", detail=f"{first_line(moekit)} (eager runs)")
        return row
    calls, fallbacks = moekit[3], moekit[4]
    if calls["experts"] == 0:
        row.update(verdict="config", detail="no experts module ran")
        return row
    diffs = compare(moekit, eager)
    worst = max(diffs, key=diffs.get)
    row.update(rel=diffs[worst], worst=worst, diffs=diffs)
    floor = None  # fp32 reordering noise: transformers' own batched_mm experts against eager
    if not isinstance(results["batched_mm"], Exception):
        floor = max(compare(results["batched_mm"], eager).values())
    row["floor"] = floor
    impls = {m.config._experts_implementation for m in experts_modules(models["moekit"])}
    notes = [f"experts implementations {sorted(map(str, impls))}"] if impls != {"moekit"} else []
    if redrawn:
        kinds = sorted({".".join(name.split(".")[-2:]) for name in redrawn})
        notes.append(f"re-drew {len(redrawn)} tensors the init left unusable: {', '.join(kinds)}")
    if fallbacks:
        row.update(verdict="fallback", detail="; ".join(fallbacks))
    elif calls["grouped_mlp"] != calls["experts"]:
        detail = f"{calls['grouped_mlp']} grouped_mlp calls for {calls['experts']} experts calls"
        row.update(verdict="error", detail=detail)
    elif diffs[worst] <= TOL:
        row.update(verdict="match", detail=f"{calls['experts']} experts calls")
    elif (
        floor is not None
        and diffs[worst] <= NOISE * max(floor, TOL)
        and max(diffs["logits"], diffs["loss"]) <= TOL
    ):
        detail = f"{worst}; within fp32 reordering noise (batched_mm vs eager: {floor:.1e})"
        row.update(verdict="match", detail=detail)
    else:
        floor_text = "n/a" if floor is None else f"{floor:.1e}"
        detail = (
            f"worst {worst}; logits {diffs['logits']:.1e}, loss {diffs['loss']:.1e}; "
            f"batched_mm vs eager {floor_text}"
        )
        row.update(verdict="mismatch", detail=detail)
    row["notes"] = "; ".join(notes)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="families (or family:variant); default all")
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)
    rows = []
    for family in args.families or targets():
        start = time.perf_counter()
        row = check(family, args.verbose)
        rows.append(row)
        rel = "" if row["rel"] is None else f"{row['rel']:.2e}"
        floor = "" if row.get("floor") is None else f"(bmm {row['floor']:.1e})"
        print(
            f"{family:22s} {row['verdict']:8s} {rel:8s} {floor:13s} "
            f"{time.perf_counter() - start:4.1f}s {row['detail']} {row.get('notes', '')}",
            file=sys.stderr,
            flush=True,
        )
    print("| family | model class | verdict | max rel diff | batched_mm vs eager | details |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rel = "" if row["rel"] is None else f"{row['rel']:.1e}"
        floor = "" if row.get("floor") is None else f"{row['floor']:.1e}"
        detail = "; ".join(x for x in (row["detail"], row.get("notes")) if x)
        detail = detail.replace("|", "\\|")
        print(
            f"| {row['family']} | {row['class']} | {row['verdict']} | {rel} | {floor} | {detail} |"
        )


if __name__ == "__main__":
    main()
