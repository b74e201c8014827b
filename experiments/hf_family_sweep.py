"""Which Hugging Face MoE families moekit's experts backend runs, and whether it matches eager.

For every model family of the installed transformers whose modeling code uses its experts
interface (``@use_experts_implementation``), build a tiny random-initialised model (hidden 64,
2 layers, 8 experts, top-2, vocab 128, ...), run forward + backward in fp32 on CPU on a
2 x 12 batch with ``experts_implementation="eager"`` and with ``"moekit"`` (identical
weights: one model, deep-copied), and compare logits, loss and every parameter's gradient
(max abs diff over the eager tensor's max abs). Each family gets a verdict:

* ``match``: every compared tensor within ``TOL`` (relative), with every experts call run by
  moekit's ``grouped_mlp``;
* ``mismatch``: moekit ran, but some tensor differs by more than ``TOL``;
* ``fallback``: moekit warned that it runs transformers' grouped_mm / eager experts instead
  (the warning's reason is recorded; the numbers are still compared);
* ``error``: the moekit run raised (and whether the eager run raises too);
* ``config``: the tiny eager model itself cannot be built or run (a config problem here);
* ``skipped``: no text path this script knows how to drive.

The model class is the family's ``*ForCausalLM`` (loss from ``labels``), else its text model
(``*TextModel``) or base model, with ``mean(last_hidden_state ** 2)`` as the loss. CPU only;
this checks moekit's CPU reference path, not its Triton kernels. From the repository root:

    .venv/bin/python experiments/hf_family_sweep.py [--families mixtral qwen3_moe] [-v]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import glob
import importlib
import inspect
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

# Applied to a family's config where its defaults have the key (the value None leaves it).
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
FAMILY: dict[str, dict] = {}
# Model class by family, where the rule (ForCausalLM, else TextModel, else Model) is wrong.
MODEL_CLASS: dict[str, str] = {}
SKIP: dict[str, str] = {}


def families() -> list[str]:
    root = os.path.dirname(transformers.__file__)
    found = set()
    for path in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")):
        with open(path) as f:
            if "use_experts_implementation" in f.read():
                found.add(os.path.basename(os.path.dirname(path)))
    return sorted(found)


def model_class(family: str) -> type:
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = [n for n in getattr(module, "__all__", []) if "PreTrained" not in n]
    if family in MODEL_CLASS:
        return getattr(module, MODEL_CLASS[family])
    for suffix in ("ForCausalLM", "TextModel", "Model"):
        hits = sorted((n for n in names if n.endswith(suffix)), key=len)
        if hits:
            return getattr(module, hits[0])
    raise LookupError(f"no model class among {names}")


def _defaults(config_class: type) -> dict:
    config = config_class()
    if dataclasses.is_dataclass(config):
        values = {f.name: getattr(config, f.name, None) for f in dataclasses.fields(config)}
    else:
        values = {}
    values.update(config.to_dict())
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
    if defaults.get("head_dim") is not None and defaults.get("head_dim") == defaults.get(
        "qk_rope_head_dim"
    ):  # multi-head latent attention: head_dim is the rotary part
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs.update(FAMILY.get(family, {}))
    kwargs = {k: v for k, v in kwargs.items() if v is not _DROP}
    return config_class(**kwargs)


_DROP = object()  # a FAMILY value: do not pass this key


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "has_post_expert_norm")]


def run(model, ids, causal: bool):
    """logits, loss, grads, experts calls, grouped_mlp calls, warnings."""
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
                out = model(input_ids=ids, labels=ids)
                logits, loss = out.logits, out.loss
            else:
                out = model(input_ids=ids)
                logits = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                loss = logits.float().pow(2).mean()
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


def check(family: str, verbose: bool = False) -> dict:
    row = {"family": family, "class": "", "verdict": "", "detail": "", "rel": None}
    if family in SKIP:
        row.update(verdict="skipped", detail=SKIP[family])
        return row
    try:
        cls = model_class(family)
        row["class"] = cls.__name__
        causal = cls.__name__.endswith("ForCausalLM")
        torch.manual_seed(0)
        config = tiny_config(family, cls.config_class)
        eager_model = cls._from_config(config, experts_implementation="eager").float().train()
        moekit_model = copy.deepcopy(eager_model)
        moekit_model.set_experts_implementation("moekit")
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        row.update(verdict="config", detail=f"build: {first_line(exc)}")
        return row
    results = {}
    for impl, model in (("eager", eager_model), ("moekit", moekit_model)):
        try:
            results[impl] = run(model, ids, causal)
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            results[impl] = exc
    eager, moekit = results["eager"], results["moekit"]
    if isinstance(eager, Exception):
        if isinstance(moekit, Exception):
            row.update(verdict="config", detail=f"eager and moekit: {first_line(eager)}")
        else:
            row.update(verdict="config", detail=f"eager only: {first_line(eager)}")
        return row
    if isinstance(moekit, Exception):
        row.update(verdict="error", detail=f"{first_line(moekit)} (eager runs)")
        return row
    calls = moekit[3]
    if calls["experts"] == 0:
        row.update(verdict="config", detail="no experts module ran")
        return row
    impls = {m.config._experts_implementation for m in experts_modules(moekit_model)}
    diffs = {"logits": rel_diff(moekit[0], eager[0]), "loss": rel_diff(moekit[1], eager[1])}
    missing = sorted(set(eager[2]) ^ set(moekit[2]))
    for name in eager[2].keys() & moekit[2].keys():
        diffs[name] = rel_diff(moekit[2][name], eager[2][name])
    worst = max(diffs, key=diffs.get)
    row["rel"] = diffs[worst]
    row["worst"] = worst
    row["diffs"] = diffs
    notes = []
    if impls != {"moekit"}:
        notes.append(f"experts implementations {sorted(map(str, impls))}")
    if missing:
        notes.append(f"grads only on one side: {missing[:3]}")
    if not all(torch.isfinite(t).all() for t in (eager[0], eager[1])):
        notes.append("eager output not finite")
    if moekit[4]:
        row.update(verdict="fallback", detail="; ".join(moekit[4]))
    elif calls["grouped_mlp"] != calls["experts"]:
        row.update(
            verdict="error",
            detail=f"{calls['grouped_mlp']} grouped_mlp calls for {calls['experts']} experts calls",
        )
    elif diffs[worst] <= TOL and not missing:
        row.update(verdict="match", detail=f"{calls['experts']} experts calls")
    else:
        row.update(verdict="mismatch", detail=f"worst: {worst}")
    if notes:
        row["detail"] += " [" + "; ".join(notes) + "]"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", help="default: every family found")
    parser.add_argument("-v", "--verbose", action="store_true", help="print tracebacks")
    args = parser.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    transformers.logging.set_verbosity_error()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", file=sys.stderr)
    rows = []
    for family in args.families or families():
        start = time.perf_counter()
        row = check(family, args.verbose)
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        rel = "" if row["rel"] is None else f"{row['rel']:.2e}"
        print(
            f"{family:24s} {row['verdict']:9s} {rel:9s} {row['seconds']:5.1f}s {row['detail']}",
            file=sys.stderr,
            flush=True,
        )
    print("| family | model class | verdict | max rel diff / reason |")
    print("|---|---|---|---|")
    for row in rows:
        rel = "" if row["rel"] is None else f"{row['rel']:.1e}"
        detail = row["detail"] if row["verdict"] != "match" else ""
        cell = "; ".join(x for x in (rel, detail) if x).replace("|", "\\|")
        print(f"| {row['family']} | {row['class']} | {row['verdict']} | {cell} |")


if __name__ == "__main__":
    main()
