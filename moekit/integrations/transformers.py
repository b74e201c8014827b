"""Hugging Face transformers experts backend: ``experts_implementation="moekit"``.

    import moekit.integrations.transformers  # registers "moekit"
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="moekit")
    model.set_experts_implementation("moekit")  # or switch a loaded model

transformers (≥ 5.0) lets a library supply the forward of a model's experts module (the
modules decorated with ``@use_experts_implementation``: ``gate_up_proj [E, 2F, H]`` as
[gate | up], ``down_proj [E, H, F]``, called with the router's ``top_k_index`` and
``top_k_weights``). This backend runs them as ``permute`` → ``grouped_mlp`` (the routing
weights applied inside the activation) → ``unpermute``, on the module's own parameters: no
copies, no layout change, checkpoints load and save unchanged. Experts this backend cannot run
exactly (transposed or interleaved weights, biases, a custom gate, an activation other than
SiLU or exact GELU) run transformers' ``grouped_mm`` backend instead, with a one-time warning
that says why; so do experts with a layout option of a newer transformers than this backend
knows. The activation is read from the module's ``act_fn``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import warnings

import torch

from moekit.ops.autocast import autocast_dtype
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.permute import permute, unpermute
from moekit.ops.router import topk_routing

__all__ = [
    "ACTIVATION_TYPES",
    "BACKEND_NAME",
    "MIN_TRANSFORMERS",
    "moekit_experts_forward",
    "register",
    "unsupported",
    "use_moekit_router",
]

BACKEND_NAME = "moekit"
MIN_TRANSFORMERS = "5.0"
# the experts' act_fn (applied to the gate) -> moekit's gated activation act(gate) * up
GATED_ACTIVATIONS = {"swiglu": torch.nn.functional.silu, "geglu": torch.nn.functional.gelu}


def _probe(act_fn) -> str | None:
    """moekit's activation whose gate function ``act_fn`` computes, by evaluating it."""
    x = torch.linspace(-20.0, 20.0, 161)  # past clipping variants' bounds (e.g. gelu_10)
    with torch.no_grad():
        try:
            got = act_fn(x)
        except Exception:
            return None
        for name, fn in GATED_ACTIVATIONS.items():
            if torch.allclose(got, fn(x), rtol=1e-5, atol=1e-6):
                return name
    return None


def _activation_table() -> dict[type, str | None]:
    """Activation type -> moekit activation, probed once for each GELU/SiLU entry of
    transformers' ACT2FN (models build their experts' act_fn from it, under various config
    names). A type whose instances compute different functions maps to None."""
    from transformers.activations import ACT2FN

    table: dict[type, str | None] = {torch.nn.SiLU: "swiglu"}
    for key in list(ACT2FN):
        if not any(part in key for part in ("gelu", "silu", "swish")):
            continue
        try:
            fn = ACT2FN[key]
        except Exception:
            continue
        if type(fn) is torch.nn.GELU:  # told apart by its approximate attribute
            continue
        name = _probe(fn)
        table[type(fn)] = name if table.get(type(fn), name) == name else None
    return table


# Experts whose act_fn is a plain function rather than a module (e.g. Lfm2-MoE's F.silu).
_ACTIVATION_FUNCTIONS = {
    torch.nn.functional.silu: "swiglu",
    torch.nn.functional.gelu: "geglu",  # exact GELU unless called with approximate="tanh"
}


def _activation(experts: torch.nn.Module) -> str | None:
    act_fn = getattr(experts, "act_fn", None)
    if isinstance(act_fn, torch.nn.GELU):
        return "geglu" if act_fn.approximate == "none" else None
    for fn, name in _ACTIVATION_FUNCTIONS.items():
        if act_fn is fn:
            return name
    return ACTIVATION_TYPES.get(type(act_fn))


def _activation_name(act_fn: object) -> str:
    return getattr(act_fn, "__name__", None) or type(act_fn).__name__


def _experts_module():
    """transformers.integrations.moe, or a clear error naming the version it needs."""
    try:
        from transformers.integrations import moe
    except ImportError as exc:
        try:
            found = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            found = "not installed"
        raise ImportError(
            f"moekit's transformers backend needs transformers >= {MIN_TRANSFORMERS} (its "
            f"experts interface, transformers.integrations.moe); found {found}. Install it "
            f"with: pip install 'moekit[hf]'"
        ) from exc
    if not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        raise ImportError(
            f"moekit's transformers backend needs transformers >= {MIN_TRANSFORMERS}: this "
            f"transformers ({importlib.metadata.version('transformers')}) has no experts interface"
        )
    return moe


# The layout options of transformers' ``use_experts_implementation`` this backend knows (it
# checks or handles each one below); a transformers with more options may describe experts that
# compute something else.
_KNOWN_OPTIONS = frozenset(
    ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")
)


@functools.cache
def _unknown_options() -> tuple[tuple[str, object], ...]:
    """(name, default) of the options of this transformers' ``use_experts_implementation``
    that this backend does not know."""
    params = inspect.signature(_MOE.use_experts_implementation).parameters.values()
    return tuple(
        (p.name, p.default)
        for p in params
        if p.kind == p.KEYWORD_ONLY and p.name not in _KNOWN_OPTIONS
        and p.name != "experts_interface"
    )  # fmt: skip


def unsupported(experts: torch.nn.Module) -> str | None:
    """Why moekit cannot run this experts module exactly, or None when it can."""
    moe = _MOE
    for name, default in _unknown_options():  # fail closed on options newer than this backend
        value = getattr(experts, name, default)
        if value is not default and value != default:
            return f"an experts option this moekit does not know ({name}={value!r})"
    if not getattr(experts, "has_gate", True):
        return "experts without a gate (up_proj only)"
    if getattr(experts, "is_transposed", False):
        return "transposed expert weights"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up weights"
    if getattr(experts, "has_bias", False):
        return "expert biases"
    default_gate = getattr(moe, "_default_apply_gate", None)
    if getattr(type(experts), "_apply_gate", default_gate) is not default_gate:
        return f"a custom gate ({type(experts).__name__}._apply_gate)"
    if _activation(experts) is None:
        act = _activation_name(getattr(experts, "act_fn", None))
        return f"an activation moekit does not run ({act}; it runs SiLU and exact GELU gates)"
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[1] != 2 * w2.shape[2]:
        return f"weights of shapes {tuple(w1.shape)} and {tuple(w2.shape)}"
    if not _rows_aligned(w1):
        return f"a hidden size ({w1.shape[2]}) whose {w1.dtype} rows are not 16-byte multiples"
    return None


def _rows_aligned(w1: torch.Tensor) -> bool:
    # moekit's kernels and torch._grouped_mm (transformers' grouped_mm backend) both need it
    return (w1.shape[-1] * w1.element_size()) % 16 == 0


@functools.cache
def _warn_fallback(cls_name: str, reason: str, backend: str) -> None:
    warnings.warn(
        f"moekit experts backend: {cls_name} has {reason}; it runs transformers' {backend} "
        f"experts instead",
        stacklevel=3,
    )


def _fallback(self, hidden_states, top_k_index, top_k_weights, reason: str) -> torch.Tensor:
    """transformers' grouped_mm experts, or its eager ones (the class's own forward) where
    grouped_mm cannot run either."""
    name = type(self).__name__
    eager = getattr(type(self).forward, "__wrapped__", None)
    w1 = getattr(self, "gate_up_proj", None)
    if eager is not None and isinstance(w1, torch.Tensor) and not _rows_aligned(w1):
        _warn_fallback(name, reason, "eager")
        return eager(self, hidden_states, top_k_index, top_k_weights)
    _warn_fallback(name, reason, "grouped_mm")
    return _MOE.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def moekit_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k] expert ids
    top_k_weights: torch.Tensor,  # [T, k] routing weights
) -> torch.Tensor:  # [T, H], hidden_states' dtype
    """The experts module's forward through moekit (the signature transformers calls)."""
    reason = unsupported(self)
    if reason is not None:
        return _fallback(self, hidden_states, top_k_index, top_k_weights, reason)
    w1, w2 = self.gate_up_proj, self.down_proj
    # autocast may hand fp32 activations to bf16 weights, or run fp32 weights in bf16
    x = hidden_states.to(autocast_dtype(hidden_states.device.type, w1.shape[-1]) or w1.dtype)
    d = permute(x, top_k_index, top_k_weights, num_experts=w1.shape[0])
    activation = _activation(self)
    if getattr(self, "has_post_expert_norm", False):
        # A norm of each expert's output comes before the routing weight (it would cancel a
        # weight applied inside the activation): the weights go in at the combine instead.
        y = grouped_mlp(d.hidden, d.offsets, w1, w2, None, activation=activation)
        y = self.post_expert_norm(y)
        return unpermute(y.to(x.dtype), d, weighted=True).to(hidden_states.dtype)
    y = grouped_mlp(d.hidden, d.offsets, w1, w2, d.probs.to(x.dtype), activation=activation)
    return unpermute(y, d, weighted=False).to(hidden_states.dtype)


# Routers whose forward is ``(hidden) -> (logits, top-k weights, top-k ids)`` with softmax top-k
# and optional renormalisation; the value says whether the weights come back in the logits'
# dtype (else fp32).
SOFTMAX_ROUTERS = {
    "Qwen3MoeTopKRouter": True,
    "Qwen2MoeTopKRouter": True,
    "OlmoeTopKRouter": True,
    "MixtralTopKRouter": False,
}
# sigmoid scores, selection bias, group-limited selection, renormalisation, scaling
GROUPED_SIGMOID_ROUTERS = ("DeepseekV3TopkRouter",)


def _softmax_router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    # the models test `if self.norm_topk_prob:` (configs may hold None)
    normalize = bool(getattr(self, "norm_topk_prob", True))
    probs, idx = topk_routing(logits, self.top_k, normalize=normalize)
    if SOFTMAX_ROUTERS[type(self).__name__]:
        probs = probs.to(logits.dtype)
    return logits, probs, idx.long()


def _grouped_sigmoid_router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
    logits = torch.nn.functional.linear(hidden_states.float(), self.weight.float())
    probs, idx = topk_routing(
        logits, self.top_k, score="sigmoid", expert_bias=self.e_score_correction_bias.float(),
        num_groups=self.num_group, topk_groups=self.topk_group,
        normalize=bool(self.norm_topk_prob),
        scaling=float(self.routed_scaling_factor),
    )  # fmt: skip
    return logits, probs, idx.long()


def use_moekit_router(model: torch.nn.Module) -> int:
    """Opt-in: run the routers whose semantics moekit's fused ``topk_routing`` matches
    (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral: softmax top-k; DeepSeek-V3: sigmoid, correction
    bias, group-limited) through it, in place. They still return the model's own router logits,
    so its aux-loss outputs are unchanged; ties between equal scores go to the lower expert id.
    Returns the number of routers swapped."""
    swapped = 0
    for module in model.modules():
        name = type(module).__name__
        if name in SOFTMAX_ROUTERS:
            module.forward = _softmax_router_forward.__get__(module)
        elif name in GROUPED_SIGMOID_ROUTERS:
            module.forward = _grouped_sigmoid_router_forward.__get__(module)
        else:
            continue
        swapped += 1
    return swapped


def register(name: str = BACKEND_NAME) -> None:
    """Register the backend with transformers' experts interface under ``name`` (done on
    import of this module)."""
    _experts_module().ALL_EXPERTS_FUNCTIONS.register(name, moekit_experts_forward)


# looked up once here, not on every forward (decode steps call the experts per token)
_MOE = _experts_module()
register()
# probed at import, outside any torch.compile trace: a traced call only looks a type up
ACTIVATION_TYPES = _activation_table()
