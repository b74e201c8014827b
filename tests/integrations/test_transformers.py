"""``experts_implementation="moekit"`` against transformers' own ``"eager"`` experts, for tiny
random-initialised models of each supported family: logits, loss and every parameter's
gradient (CPU fp32: moekit's reference path; GPU bf16: the Triton kernels), a few optimizer
steps, generation, fallback for experts moekit cannot run, and torch.compile."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("moekit.integrations.transformers")

from moekit.ops import grouped_mlp  # noqa: E402
from moekit.runtime.state import STATE  # noqa: E402

COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=97, max_position_embeddings=128, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                        v_head_dim=16, routed_scaling_factor=2.5),
}  # fmt: skip


def tiny_model(family: str, impl: str, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=impl, dtype=dtype
    )
    with torch.no_grad():  # a non-zero selection bias (DeepSeek-V3), so that it matters
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=torch.Generator().manual_seed(1)))
    return model.to(device)


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _falls_back_to(backend: str, model, ids) -> None:
    """The moekit backend warns that it runs transformers' ``backend`` experts, and the model's
    logits equal those of transformers' eager experts."""
    hf._warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(input_ids=ids).logits
    assert any(f"runs transformers' {backend} experts" in str(w.message) for w in caught)
    model.set_experts_implementation("eager")
    torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_eager_experts(family, monkeypatch):
    model = tiny_model(family, "eager")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    want = loss_and_grads(model, ids)
    model.set_experts_implementation("moekit")
    calls = []
    monkeypatch.setattr(hf, "grouped_mlp", lambda *a, **k: calls.append(1) or grouped_mlp(*a, **k))
    got = loss_and_grads(model, ids)
    assert len(calls) == COMMON["num_hidden_layers"]  # every MoE layer ran through moekit
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys() and any("experts" in n for n in got[2])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


# More families through the same backend (no router patch for them): tiny configs from the
# keys each config class has; the whole list of families is checked by
# experiments/hf_family_sweep.py.
MORE_FAMILIES = {
    "glm4_moe": {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 0,
                 "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1},
    "qwen3_next": {"num_experts": 8, "moe_intermediate_size": 32,
                   "layer_types": ["linear_attention", "full_attention"],
                   "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "head_dim": 16},
    "minimax": {"num_local_experts": 8, "head_dim": 16},
    "phimoe": {"num_local_experts": 4},
    "granitemoe": {"num_local_experts": 4},
    "dots1": {"n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 0,
              "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1},
    "ernie4_5_moe": {"moe_num_experts": 8, "moe_k": 2, "moe_intermediate_size": 32,
                     "moe_layer_start_index": 0},
    # Gates written as a custom _apply_gate. The SwiGLU limit of 0.05 clamps 25-75% of the
    # pre-activations of these tiny models, so a clamp moekit left out would show.
    "beam": {"num_experts": 8, "moe_intermediate_size": 32, "head_dim": 16, "n_group": 2,
             "topk_group": 1, "mlp_layer_types": ["sparse"] * 2,
             "layer_types": ["full_attention"] * 2},
    "deepseek_v4": {"n_routed_experts": 8, "moe_intermediate_size": 32, "swiglu_limit": 0.05,
                    "head_dim": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
                    "index_head_dim": 16, "index_n_heads": 2},
    "hy_v4": {"num_local_experts": 8, "moe_intermediate_size": 32, "swiglu_limit": 0.05,
              "head_dim": 16, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "minimax_m3_vl_text": {"num_local_experts": 8, "swiglu_limit": 0.05, "swiglu_alpha": 1.702,
                           "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip


def more_model(family: str, impl: str, dtype=torch.float32, device="cpu"):
    """A tiny model of one of MORE_FAMILIES (skips when this transformers lacks it)."""
    if family not in transformers.models.auto.configuration_auto.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    config = transformers.AutoConfig.for_model(family)
    wanted = {**COMMON, "num_experts_per_tok": 2, **MORE_FAMILIES[family]}
    kwargs = {k: v for k, v in wanted.items() if hasattr(config, k)}
    config = transformers.AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=impl, dtype=dtype
    )
    return model.to(device)


@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_more_families_match_eager_experts(family, monkeypatch):
    model = more_model(family, "eager")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11))
    torch.manual_seed(1)  # the same draws in both runs (e.g. PhiMoE's sparse mixer samples)
    want = loss_and_grads(model, ids)
    model.set_experts_implementation("moekit")
    calls = []
    monkeypatch.setattr(hf, "grouped_mlp", lambda *a, **k: calls.append(1) or grouped_mlp(*a, **k))
    torch.manual_seed(1)
    got = loss_and_grads(model, ids)
    assert calls  # the MoE layers ran through moekit
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(MORE_FAMILIES))
def test_gpu_more_families_bf16_within_torch_bf16_error(family):
    """bf16 moekit vs the fp32 eager model: no further from it than bf16 eager is."""
    ids = torch.randint(0, COMMON["vocab_size"], (4, 64), device="cuda")
    torch.manual_seed(1)
    ref = loss_and_grads(more_model(family, "eager", torch.float32, "cuda"), ids)
    err = {}
    for impl in ("eager", "moekit"):
        model = more_model(family, impl, torch.bfloat16, "cuda")
        torch.manual_seed(1)
        got = loss_and_grads(model, ids)
        err[impl] = float((got[0].float() - ref[0]).norm() / ref[0].norm())
    assert err["moekit"] <= 2 * err["eager"] + 1e-3, err


def test_fp32_model_under_autocast_runs_its_experts_in_the_autocast_dtype(monkeypatch):
    """An fp32 model trained under autocast (e.g. Trainer's bf16=True): the experts run in
    the region's dtype, and logits and gradients stay as close to the eager experts' under
    the same region as fp16 allows."""
    model = tiny_model("qwen3_moe", "eager")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    with torch.autocast("cpu", dtype=torch.float16):
        want = loss_and_grads(model, ids)
    model.set_experts_implementation("moekit")
    dtypes = []

    def spy(x, *a, **k):
        dtypes.append(x.dtype)
        return grouped_mlp(x, *a, **k)

    monkeypatch.setattr(hf, "grouped_mlp", spy)
    with torch.autocast("cpu", dtype=torch.float16):
        got = loss_and_grads(model, ids)
    assert dtypes == [torch.float16] * COMMON["num_hidden_layers"]
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for name in want[2]:
        assert got[2][name].dtype == torch.float32, name
        torch.testing.assert_close(got[2][name], want[2][name], rtol=5e-2, atol=5e-3, msg=name)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moekit_router_matches_the_models_router(family, monkeypatch):
    model = tiny_model(family, "moekit")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    want = loss_and_grads(model, ids)
    assert hf.use_moekit_router(model) == COMMON["num_hidden_layers"]
    calls = []
    routing = hf.topk_routing
    monkeypatch.setattr(hf, "topk_routing", lambda *a, **k: calls.append(1) or routing(*a, **k))
    got = loss_and_grads(model, ids)
    assert len(calls) == COMMON["num_hidden_layers"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_from_config_and_optimizer_steps_match():
    ids = torch.randint(0, COMMON["vocab_size"], (2, 11))
    losses = {}
    for impl in ("eager", "moekit"):
        model = tiny_model("qwen3_moe", impl)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[impl] = []
        for _ in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[impl].append(loss.item())
    assert losses["moekit"] == pytest.approx(losses["eager"], rel=1e-4)


def test_generation_matches_eager():
    ids = torch.randint(0, COMMON["vocab_size"], (1, 5))
    out = {}
    for impl in ("eager", "moekit"):
        model = tiny_model("olmoe", impl).eval()
        out[impl] = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(out["moekit"], out["eager"])


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    """Checkpointed moekit against checkpointed eager (re-entrant checkpointing changes
    transformers' own gradients of the aux loss, so each is compared with its own kind)."""
    ids = torch.randint(0, COMMON["vocab_size"], (2, 9))
    results = {}
    for impl in ("eager", "moekit"):
        model = tiny_model("mixtral", impl)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
        model.train()
        results[impl] = loss_and_grads(model, ids)
    got, want = results["moekit"], results["eager"]
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)


def test_dense_first_layers_and_odd_sizes():
    """DeepSeek-V3 with a dense first layer; experts whose act_fn is a plain function run
    through moekit; a hidden size whose rows are not 16-byte multiples falls back."""
    torch.manual_seed(0)
    cfg = dict(FAMILIES["deepseek_v3"], first_k_dense_replace=1, num_hidden_layers=3)
    config = transformers.AutoConfig.for_model("deepseek_v3", **dict(COMMON, **cfg))
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 7))
    want = loss_and_grads(model, ids)
    model.set_experts_implementation("moekit")
    assert hf.use_moekit_router(model) == 2
    got = loss_and_grads(model, ids)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-4, atol=1e-5, msg=name)

    experts = tiny_model("qwen3_moe", "moekit").model.layers[0].mlp.experts
    del experts.act_fn  # a child module: a plain function takes its place as an attribute
    experts.act_fn = torch.nn.functional.silu
    assert hf.unsupported(experts) is None
    experts.act_fn = torch.tanh
    assert "(tanh;" in hf.unsupported(experts)
    odd = dict(COMMON, hidden_size=30, num_attention_heads=1, num_key_value_heads=1)
    config = transformers.AutoConfig.for_model("olmoe", **odd, **FAMILIES["olmoe"])
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="moekit")
    assert "not 16-byte multiples" in hf.unsupported(model.model.layers[0].mlp.experts)
    _falls_back_to("eager", model, ids)


def test_router_patch_reads_a_none_norm_topk_prob_as_false():
    model = tiny_model("qwen3_moe", "moekit")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 6))
    for module in model.modules():
        if hasattr(module, "norm_topk_prob"):
            module.norm_topk_prob = None
    want = model(input_ids=ids).logits
    hf.use_moekit_router(model)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)


def test_unsupported_experts_fall_back_with_a_warning():
    model = tiny_model("qwen3_moe", "moekit")
    experts = model.model.layers[0].mlp.experts
    assert hf.unsupported(experts) is None
    for layer in model.model.layers:  # an activation moekit does not run: tanh GELU
        layer.mlp.experts.act_fn = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    assert "activation moekit does not run" in hf.unsupported(experts)
    ids = torch.randint(0, COMMON["vocab_size"], (1, 7))
    _falls_back_to("grouped_mm", model, ids)


def _experts_of(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if isinstance(getattr(m, "down_proj", 0), torch.Tensor))


@pytest.mark.parametrize(
    ("family", "want"),
    [("beam", "swiglu"), ("deepseek_v4", (0.05, 1.0, 0.0)), ("hy_v4", (0.05, 1.0, 0.0)),
     ("minimax_m3_vl_text", (0.05, 1.702, 1.0))],
)  # fmt: skip
def test_custom_gates_moekit_computes_are_recognised(family, want):
    experts = _experts_of(more_model(family, "moekit"))
    assert hf.unsupported(experts) is None
    act = hf._gate_activation(experts)[0]
    assert act == want or (act.name, act.limit, act.alpha, act.offset) == ("clamped_swiglu", *want)


def test_custom_gates_fail_closed():
    """A gate that differs from the forms moekit knows in any way — its code, a global it
    reads, the activation it applies, a limit it cannot use — falls back."""
    model = more_model("hy_v4", "moekit")
    experts = _experts_of(model)
    cls = type(experts)
    gate = cls._apply_gate

    def clamp_after(self, gate_up):  # Step3p7's form: the clamp after the activation
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate).clamp(max=self.swiglu_limit) * up

    other_f = type(gate)(gate.__code__, {**gate.__globals__, "F": torch.special}, gate.__name__)
    for replacement in (clamp_after, other_f):
        variant = type(cls.__name__, (cls,), {"_apply_gate": replacement})
        experts.__class__ = variant
        assert "a custom gate" in hf.unsupported(experts)
    experts.__class__ = cls
    experts.swiglu_limit = float("nan")
    assert "clamped gate moekit cannot run" in hf.unsupported(experts)
    experts.swiglu_limit = float("inf")  # nothing clamped: plain SwiGLU
    assert hf._gate_activation(experts) == ("swiglu", None)
    ds = more_model("deepseek_v4", "moekit")
    ds_experts = _experts_of(ds)
    ds_experts.act_fn = torch.nn.GELU()
    assert "clamped gate of GELU" in hf.unsupported(ds_experts)


def test_the_gate_in_use_now_decides(monkeypatch):
    """transformers' backends call ``self._apply_gate`` as looked up at the call: a gate set on
    the instance, or on the class after moekit has seen it, is the one that decides (once
    read per class and kept, they ran moekit's gate while transformers' ran theirs)."""
    model = tiny_model("qwen3_moe", "moekit")
    experts = model.model.layers[0].mlp.experts
    cls = type(experts)

    def tanh_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.tanh(gate) * up

    assert hf.unsupported(experts) is None
    experts._apply_gate = types.MethodType(tanh_gate, experts)
    assert "a custom gate" in hf.unsupported(experts)
    x = torch.randn(10, COMMON["hidden_size"])
    w, idx = torch.randn(10, 8).softmax(-1).topk(2, dim=-1)
    hf._warn_fallback.cache_clear()
    with pytest.warns(UserWarning, match="runs transformers' grouped_mm experts"):
        got = experts(x, idx, w)
    want = hf._MOE.grouped_mm_experts_forward(experts, x, idx, w)  # calls the tanh gate
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    del experts._apply_gate
    monkeypatch.setattr(cls, "_apply_gate", hf._fp32_gate, raising=False)
    assert hf.unsupported(experts) is None
    monkeypatch.setattr(cls, "_apply_gate", tanh_gate)
    assert "a custom gate" in hf.unsupported(experts)


class _PostNormExperts(torch.nn.Module):
    """An experts module as transformers' ``use_experts_implementation(has_post_expert_norm=True)``
    sets it up (e.g. MuseSpark): each expert's output is normalised before its routing weight
    applies."""

    has_gate, has_bias, is_transposed, is_concatenated = True, False, False, True
    has_post_expert_norm = True

    def __init__(self, E=4, H=16, F=8):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * F, H, generator=g) * H**-0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, F, generator=g) * F**-0.5)
        self.act_fn = transformers.activations.ACT2FN["silu"]
        self.post_expert_norm = torch.nn.RMSNorm(H, eps=1e-6)
        with torch.no_grad():
            self.post_expert_norm.weight.uniform_(0.5, 1.5, generator=g)

    def reference(self, x, idx, w):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for s in range(idx.shape[1]):
                e = int(idx[t, s])
                gate, up = (self.gate_up_proj[e] @ x[t]).chunk(2)
                o = self.down_proj[e] @ (self.act_fn(gate) * up)
                out[t] = out[t] + w[t, s] * self.post_expert_norm(o)
        return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_post_expert_norm_comes_before_the_routing_weights(device):
    """Experts with a norm after each expert (before its routing weight): moekit runs them
    (the weights applied at the combine) with the loop's values and gradients (fp32 on the
    CPU; bf16 on the GPU: within 2x the bf16 loop's own error against the fp32 loop)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    experts = _PostNormExperts().to(device)
    low = copy.deepcopy(experts).to(dtype)
    assert hf.unsupported(low) is None
    x = torch.randn(9, 16, device=device)
    w, idx = torch.randn(9, 4, device=device).softmax(-1).topk(2, dim=-1)
    g = torch.randn(9, 16, device=device)
    got_in = [t.to(dtype).requires_grad_() for t in (x, w)]
    got = hf.moekit_experts_forward(low, got_in[0], idx, got_in[1])
    got_grads = torch.autograd.grad(got, [*got_in, *low.parameters()], g.to(dtype))
    want_in = [t.clone().requires_grad_() for t in (x, w)]
    want = experts.reference(want_in[0], idx, want_in[1])
    want_grads = torch.autograd.grad(want, [*want_in, *experts.parameters()], g)
    if device == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        return
    loop_in = [t.to(dtype).requires_grad_() for t in (x, w)]
    loop = low.reference(loop_in[0], idx, loop_in[1])
    loop_grads = torch.autograd.grad(loop, [*loop_in, *low.parameters()], g.to(dtype))

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    for a, c, b in zip((got, *got_grads), (loop, *loop_grads), (want, *want_grads)):
        assert rel(a, b) <= 2 * rel(c, b) + 1e-3


def test_expert_parallel_sentinel_ids_are_dropped():
    """Under transformers' expert parallelism a rank holds E_local experts and the slots
    routed elsewhere arrive as ids >= E_local with zero weights: moekit drops them, as
    transformers' batched_mm does (values and gradients)."""
    moe = pytest.importorskip("transformers.integrations.moe")
    experts = tiny_model("qwen3_moe", "moekit").model.layers[0].mlp.experts
    experts._is_expert_parallel = True
    E = experts.gate_up_proj.shape[0]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 2 * E, (11, 2), generator=g)  # about half of them elsewhere
    w = torch.where(idx >= E, 0.0, torch.rand(11, 2, generator=g)).requires_grad_()
    x = torch.randn(11, COMMON["hidden_size"], generator=g, requires_grad=True)
    params = [x, w, experts.gate_up_proj, experts.down_proj]
    got = hf.moekit_experts_forward(experts, x, idx, w)
    want = moe.batched_mm_experts_forward(experts, x, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    dy = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, params, dy), torch.autograd.grad(want, params, dy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_experts_options_newer_than_the_backend_fall_back(monkeypatch):
    """A transformers whose use_experts_implementation has an option this backend does not
    know: experts with it set to a non-default value fall back (never a silent wrong answer);
    at its default they still run through moekit."""
    model = tiny_model("qwen3_moe", "moekit")
    experts = model.model.layers[0].mlp.experts
    monkeypatch.setattr(hf, "_UNKNOWN_OPTIONS", (("has_post_expert_scale", False),))
    assert hf.unsupported(experts) is None
    for layer in model.model.layers:
        layer.mlp.experts.has_post_expert_scale = True
    assert "has_post_expert_scale=True" in hf.unsupported(experts)
    _falls_back_to("grouped_mm", model, torch.randint(0, COMMON["vocab_size"], (1, 7)))


@pytest.mark.parametrize("family", ["qwen3_moe", "hy_v4"])
def test_torch_compile_fullgraph_of_the_experts(family, monkeypatch):
    if family in FAMILIES:
        experts = tiny_model(family, "moekit").model.layers[0].mlp.experts
    else:  # a custom gate, first seen inside the trace
        experts = _experts_of(more_model(family, "moekit"))
        monkeypatch.setattr(STATE, "lookups", {})
    x = torch.randn(10, COMMON["hidden_size"], requires_grad=True)
    w, idx = torch.randn(10, 8).softmax(-1).topk(2, dim=-1)
    compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
    y = compiled(x, idx, w)
    torch.testing.assert_close(y, experts(x, idx, w))
    y.sum().backward()
    assert experts.gate_up_proj.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gpu_bf16_within_torch_bf16_error(family):
    """bf16 moekit vs the fp32 eager model: no further from it than bf16 eager is."""
    ids = torch.randint(0, COMMON["vocab_size"], (4, 64), device="cuda")
    ref = loss_and_grads(tiny_model(family, "eager", torch.float32, "cuda"), ids)
    err = {}
    for impl in ("eager", "moekit"):
        got = loss_and_grads(tiny_model(family, impl, torch.bfloat16, "cuda"), ids)
        err[impl] = float((got[0].float() - ref[0]).norm() / ref[0].norm())
    assert err["moekit"] <= 2 * err["eager"] + 1e-3, err


def test_torch_compile_fullgraph_of_the_moe_block_with_the_moekit_router():
    model = tiny_model("deepseek_v3", "moekit")
    hf.use_moekit_router(model)
    block = model.model.layers[0].mlp  # router + routed experts + shared expert
    x = torch.randn(2, 7, COMMON["hidden_size"], requires_grad=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, block(x), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    assert block.gate.weight.grad is not None and x.grad is not None


def test_old_transformers_gets_a_clear_error(monkeypatch):
    from transformers.integrations import moe

    monkeypatch.delattr(moe, "ALL_EXPERTS_FUNCTIONS")
    with pytest.raises(ImportError, match=r"transformers >= 5\.0"):
        hf.register()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gpu_inductor_fullgraph_of_the_moe_block(family):
    """The default inductor backend on a model's MoE block (router, moekit experts, shared
    expert), bf16: no graph break, and output and gradients as the uncompiled block's."""
    torch._dynamo.reset()
    model = tiny_model(family, "moekit", torch.bfloat16, "cuda")
    if family == "deepseek_v3":
        hf.use_moekit_router(model)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 64, COMMON["hidden_size"], device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    got, want = [], []
    for fn, out in ((torch.compile(block, fullgraph=True), got), (block, want)):
        xi = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        y = fn(xi)
        y.backward(dy)
        out += [y.detach().float(), xi.grad.float()]
        out += [p.grad.float() for p in block.parameters() if p.grad is not None]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_fp8_backend_runs_the_experts_in_fp8(monkeypatch):
    # experts_implementation="moekit_fp8": every MoE layer's experts through grouped_mlp_fp8;
    # logits, loss and gradients within e4m3's error of the eager fp32 experts
    from moekit.ops import fp8_mlp

    model = tiny_model("qwen3_moe", "eager")
    ids = torch.randint(0, COMMON["vocab_size"], (2, 13))
    want = loss_and_grads(model, ids)
    model.set_experts_implementation("moekit_fp8")
    calls = []
    real = fp8_mlp.grouped_mlp_fp8
    monkeypatch.setattr(hf, "grouped_mlp_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # F = 32: the composition, which says so once
        got = loss_and_grads(model, ids)
    assert len(calls) == COMMON["num_hidden_layers"]
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(got[0], want[0]) < 0.05 and abs(got[1] - want[1]) < 0.05 * want[1]
    experts = [n for n in want[2] if "experts" in n]
    assert experts and all(rel(got[2][n], want[2][n]) < 0.1 for n in experts)


def test_fp8_backend_says_when_it_runs_bf16():
    # sizes the FP8 GEMMs cannot take: moekit's bf16 experts, with a warning naming why
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", **dict(COMMON, hidden_size=72, num_attention_heads=4),
        **dict(FAMILIES["qwen3_moe"], head_dim=18),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    ids = torch.randint(0, COMMON["vocab_size"], (1, 5))
    want = model(input_ids=ids).logits
    model.set_experts_implementation("moekit_fp8")
    STATE.warned.clear()
    with pytest.warns(RuntimeWarning, match="not both multiples of 16"):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
