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
exactly (transposed or interleaved weights, biases, a custom gate other than the clamped
SwiGLU forms below, an activation other than SiLU or exact GELU) run transformers'
``grouped_mm`` backend instead, with a one-time warning that says why; so do experts with a
layout option of a newer transformers than this backend knows. The activation is read from the
module's ``act_fn``, and from its ``_apply_gate`` where that is one of the forms transformers'
models write for a gate moekit computes (the default gate in fp32, SwiGLU with clamps).

``experts_implementation="moekit_fp8"`` (opt-in) runs the same experts in FP8
(``moekit.Fp8Recipe()``, docs/fp8.md): the tokens quantized once in the permute, the experts'
GEMMs in e4m3, the weights kept as they are. Experts the FP8 path cannot take (sizes not
multiples of 16) run moekit's bf16 experts instead, with a one-time warning that says why.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import warnings

import torch
import torch.nn.functional as F

from moekit.activations import Activation
from moekit.ops.autocast import autocast_dtype
from moekit.ops.fp8_mlp import grouped_mlp_fp8
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.permute import permute, unpermute
from moekit.ops.quantize import Fp8Recipe
from moekit.ops.router import topk_routing
from moekit.runtime.state import STATE, memoized, warn_once

__all__ = [
    "ACTIVATION_TYPES",
    "BACKEND_NAME",
    "FP8_BACKEND_NAME",
    "MIN_TRANSFORMERS",
    "moekit_experts_forward",
    "moekit_fp8_experts_forward",
    "register",
    "unsupported",
    "use_moekit_router",
]

BACKEND_NAME = "moekit"
FP8_BACKEND_NAME = "moekit_fp8"
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
    for name, default in _UNKNOWN_OPTIONS:  # fail closed on options newer than this backend
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
    reason = _gate_activation(experts)[1]
    if reason is not None:
        return reason
    w1, w2 = experts.gate_up_proj, experts.down_proj
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[1] != 2 * w2.shape[2]:
        return f"weights of shapes {tuple(w1.shape)} and {tuple(w2.shape)}"
    if not _rows_aligned(w1):
        return f"a hidden size ({w1.shape[2]}) whose {w1.dtype} rows are not 16-byte multiples"
    return None


def _default_gate(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


# The custom ``_apply_gate`` forms moekit computes exactly, written as transformers' models write
# them (matched by bytecode and the globals they read, so an edit to a model's gate falls back).
def _fp32_gate(self, gate_up):  # Beam: the default gate, computed in fp32
    gate, up = gate_up.chunk(2, dim=-1)
    return (self.act_fn(gate.float()) * up.float()).to(gate.dtype)


def _clamped_act_gate(self, gate_up):  # DeepSeek-V4
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    return self.act_fn(gate) * up


def _clamped_silu_gate(self, gate_up):  # GLM-5-Next, HY-V4, HY-V4-VL
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    return F.silu(gate) * up


def _clamped_alpha_gate(self, gate_up):  # MiniMax-M3-VL: gpt-oss's gate, [gate | up] rows
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    glu = gate * torch.sigmoid(gate * self.swiglu_alpha)
    return (up + 1.0) * glu


# gate form -> (limit, alpha, offset) attribute readers; None: the act_fn's plain gate
_GATE_FORMS = {
    _default_gate: None,
    _fp32_gate: None,
    _clamped_act_gate: (lambda m: m.limit, 1.0, 0.0),  # with a SiLU act_fn only
    _clamped_silu_gate: (lambda m: m.swiglu_limit, 1.0, 0.0),
    _clamped_alpha_gate: (lambda m: m.swiglu_limit, lambda m: m.swiglu_alpha, 1.0),
}


def _code_key(fn) -> tuple | None:
    """What a function computes, as far as its bytecode, constants, attribute names and the
    globals it reads tell; None for something that is not a plain Python function."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_freevars:
        return None
    scope = fn.__globals__
    reads = tuple((name, id(scope[name])) for name in code.co_names if name in scope)
    return code.co_code, code.co_consts, code.co_names, code.co_argcount, reads


_FORM_KEYS = {_code_key(form): form for form in _GATE_FORMS}


def _gate_form(experts: torch.nn.Module) -> object:
    """The form of the gate transformers' backends call, ``experts._apply_gate`` as it is
    looked up now (a class patched since the last call too); None for a gate moekit does not
    know, a static or class method or one set on the instance among them."""
    if experts.__dict__.get("_apply_gate") is not None:
        return None
    cls = type(experts)
    gate = getattr(cls, "_apply_gate", None)
    if gate is None or gate is getattr(_MOE, "_default_apply_gate", None):
        return _default_gate
    # (the gate function last seen on the class, that function's form; None: unknown)
    seen = STATE.lookups.get(("hf_gate", cls))
    if seen is None or seen[0] is not gate:
        static = inspect.getattr_static(cls, "_apply_gate")
        plain = not isinstance(static, (staticmethod, classmethod))
        seen = (gate, _FORM_KEYS.get(_code_key(gate)) if plain else None)
        STATE.lookups[("hf_gate", cls)] = seen
    return seen[1]


def _gate_activation(experts: torch.nn.Module) -> tuple[object, str | None]:
    """(moekit's activation for the experts' gate, None) or (None, why there is none).

    Gates moekit runs: the default ``act_fn(gate) * up`` with a SiLU or exact GELU ``act_fn``
    (also when computed in fp32), and SwiGLU with the gate and up clamped, in the forms
    transformers' DeepSeek-V4, GLM-5-Next, HY-V4 and MiniMax-M3-VL write it."""
    form = _gate_form(experts)
    if form is None:
        return None, f"a custom gate ({type(experts).__name__}._apply_gate)"
    name = _activation(experts)
    act = _activation_name(getattr(experts, "act_fn", None))
    readers = _GATE_FORMS[form]
    if readers is None:
        if name is None:
            reason = f"an activation moekit does not run ({act}; it runs SiLU and exact GELU gates)"
            return None, reason
        return name, None
    if form is _clamped_act_gate and name != "swiglu":
        return None, f"a clamped gate of {act} (moekit clamps SiLU gates only)"
    try:
        limit, alpha, offset = (float(r(experts) if callable(r) else r) for r in readers)
    except (TypeError, ValueError) as exc:
        return None, f"a clamped gate moekit cannot run ({exc})"
    key = ("hf_clamped_swiglu", limit, alpha, offset)
    if key not in STATE.lookups:  # a plain dict: torch.compile traces it without a warning
        STATE.lookups[key] = _clamped_swiglu(limit, alpha, offset)
    return STATE.lookups[key]


def _clamped_swiglu(limit: float, alpha: float, offset: float) -> tuple[object, str | None]:
    if limit == float("inf") and alpha == 1.0 and offset == 0.0:
        return "swiglu", None  # nothing is clamped
    try:
        return Activation("clamped_swiglu", limit=limit, alpha=alpha, offset=offset), None
    except ValueError as exc:
        return None, f"a clamped gate moekit cannot run ({exc})"


def _rows_aligned(w1: torch.Tensor) -> bool:
    # moekit's kernels and torch._grouped_mm (transformers' grouped_mm backend) both need it
    return (w1.shape[-1] * w1.element_size()) % 16 == 0


@memoized
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
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, None)


def moekit_fp8_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k] expert ids
    top_k_weights: torch.Tensor,  # [T, k] routing weights
) -> torch.Tensor:  # [T, H], hidden_states' dtype
    """The experts module's forward through moekit in FP8 (``experts_implementation=
    "moekit_fp8"``): the blockwise recipe, the weights quantized once per version."""
    reason = unsupported(self)
    if reason is not None:
        return _fallback(self, hidden_states, top_k_index, top_k_weights, reason)
    H, F = self.gate_up_proj.shape[-1], self.down_proj.shape[-1]
    if H % 16 or F % 16:
        warn_once(
            ("hf_fp8", type(self).__name__, H, F),
            f"moekit FP8 experts backend: {type(self).__name__} has hidden size {H} and expert "
            f"width {F}, not both multiples of 16 as the FP8 GEMMs need; it runs moekit's bf16 "
            "experts instead",
        )
        return _experts_forward(self, hidden_states, top_k_index, top_k_weights, None)
    return _experts_forward(self, hidden_states, top_k_index, top_k_weights, Fp8Recipe())


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, fp8) -> torch.Tensor:
    """permute → the experts' MLP (in FP8 with a recipe) → unpermute, on the module's weights."""
    w1, w2 = self.gate_up_proj, self.down_proj
    # autocast may hand fp32 activations to bf16 weights, or run fp32 weights in bf16
    x = hidden_states.to(autocast_dtype(hidden_states.device.type, w1.shape[-1]) or w1.dtype)
    # transformers' expert parallelism marks slots of other ranks' experts with ids >= the
    # local expert count: moekit's marker of a dropped slot is -1
    top_k_index = torch.where(top_k_index < w1.shape[0], top_k_index, -1)
    align = 128 if fp8 is not None else None
    d = permute(x, top_k_index, top_k_weights, num_experts=w1.shape[0], align=align, fp8=fp8)
    activation = _gate_activation(self)[0]

    def mlp(probs):
        if fp8 is not None:
            return grouped_mlp_fp8(d.hidden, d.offsets, w1, w2, probs, activation=activation)
        return grouped_mlp(d.hidden, d.offsets, w1, w2, probs, activation=activation)

    if getattr(self, "has_post_expert_norm", False):
        # A norm of each expert's output comes before the routing weight (it would cancel a
        # weight applied inside the activation): the weights go in at the combine instead.
        y = self.post_expert_norm(mlp(None))
        return unpermute(y.to(x.dtype), d, weighted=True).to(hidden_states.dtype)
    y = mlp(d.probs.to(x.dtype))
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


def register(name: str = BACKEND_NAME, fp8_name: str = FP8_BACKEND_NAME) -> None:
    """Register the backends with transformers' experts interface under ``name`` and, for the
    FP8 one, ``fp8_name`` (done on import of this module)."""
    functions = _experts_module().ALL_EXPERTS_FUNCTIONS
    functions.register(name, moekit_experts_forward)
    functions.register(fp8_name, moekit_fp8_experts_forward)


# looked up once here, not on every forward (decode steps call the experts per token)
_MOE = _experts_module()
_UNKNOWN_OPTIONS = _unknown_options()
register()
# probed at import, outside any torch.compile trace: a traced call only looks a type up
ACTIVATION_TYPES = _activation_table()
