"""moekit's Megatron-Core experts against Megatron's own ``SequentialMLP`` with Megatron's config
and the same weights, on CPU (Megatron's MoELayer forward needs CUDA; the experts module and
the checkpoint layouts do not): outputs and every gradient for each supported activation,
biases, probs on the input, idle experts and a single token; the state-dict converters both
ways; the sharded state dict tensor by tensor; the spec helper; the options it declines."""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
mg = pytest.importorskip("moekit.integrations.megatron")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import (  # noqa: E402
    dict_list_map_inplace,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.optimizer import (  # noqa: E402
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

E, H, FFN = 4, 32, 48
LINEARS = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


@pytest.fixture(scope="module", autouse=True)
def megatron_groups():
    """A one-process gloo world with Megatron's parallel state (every size 1)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    owned = not torch.distributed.is_initialized()
    if owned:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if owned:
        torch.distributed.destroy_process_group()


def config(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                moe_router_topk=2, params_dtype=torch.float32)  # fmt: skip
    base.update(kw)
    return TransformerConfig(**base)


def pair(cfg: TransformerConfig):
    """(SequentialMLP, MoekitExperts) with the same weights: Megatron's, moved across with the
    state-dict converter (random biases, so that they matter)."""
    pg = get_default_pg_collection()
    seq = SequentialMLP(E, cfg, LINEARS, pg_collection=pg)
    with torch.no_grad():
        for name, p in seq.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    ours = mg.MoekitExperts(E, cfg, pg_collection=pg)
    ours.load_state_dict(mg.sequential_to_grouped(seq.state_dict()))
    return seq, ours


def run(module, x, counts, probs):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    y, bias = module(x, counts, probs)
    assert bias is None
    dy = torch.randn_like(y, generator=torch.Generator().manual_seed(7))
    (y * dy).sum().backward()
    return y.detach(), x.grad, probs.grad


def grads_by_expert(module) -> dict:
    """Every weight gradient keyed by the state-dict layout of moekit's experts."""
    if isinstance(module, SequentialMLP):
        return mg.sequential_to_grouped(
            {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        )
    return {f"{n}{i}": p.grad[i] for n, p in (
        ("linear_fc1.weight", module.fc1_weight), ("linear_fc2.weight", module.fc2_weight),
        ("linear_fc1.bias", module.fc1_bias), ("linear_fc2.bias", module.fc2_bias),
    ) if p is not None for i in range(E)}  # fmt: skip


class ExpertMath(torch.nn.Module):
    """Megatron's expert math written out on ``SequentialMLP``'s own parameters: fc1 (+ bias),
    the activation, × prob, fc2, + bias × prob. The oracle where SequentialMLP itself cannot
    run a backward (megatron-core 0.16.1 with biases at expert and tensor parallelism 1: its
    in-place bias add hits the view that its tensor-parallel reduce returns as-is)."""

    def __init__(self, seq: SequentialMLP) -> None:
        super().__init__()
        self.seq = seq

    def forward(self, x, counts, probs):
        outs = []
        for expert, xe, pe in zip(self.seq.local_experts, x.split(counts.tolist()),
                                  probs.split(counts.tolist())):  # fmt: skip
            fc1, fc2 = expert.linear_fc1, expert.linear_fc2
            h = xe @ fc1.weight.t() + fc1.bias
            if expert.config.gated_linear_unit:
                g, u = h.chunk(2, dim=-1)
                a = expert.config.activation_func(g) * u
            else:
                a = expert.config.activation_func(h)
            outs.append((a * pe[:, None]) @ fc2.weight.t() + fc2.bias * pe[:, None])
        return torch.cat(outs), None


def check_equal(cfg, counts, seed=0):
    seq, ours = pair(cfg)
    oracle = ExpertMath(seq) if cfg.add_bias_linear else seq
    g = torch.Generator().manual_seed(seed)
    R = int(sum(counts))
    x, probs = torch.randn(R, H, generator=g), torch.rand(R, generator=g)
    counts = torch.tensor(counts)
    want, got = run(oracle, x, counts, probs), run(ours, x, counts, probs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    gw, gs = grads_by_expert(ours), grads_by_expert(seq)
    assert gw.keys() == gs.keys()
    for k in gs:
        torch.testing.assert_close(gw[k], gs[k], rtol=1e-4, atol=1e-5, msg=k)


ACTIVATIONS = {
    "swiglu": dict(),
    "geglu": dict(activation_func=F.gelu),
    "clamped_swiglu": dict(
        activation_func=quick_gelu, activation_func_clamp_value=0.7, glu_linear_offset=1.0
    ),
    "relu2": dict(gated_linear_unit=False, activation_func=squared_relu),
    "silu": dict(gated_linear_unit=False),
    "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
}


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_activations_match_sequential(act):
    check_equal(config(**ACTIVATIONS[act]), [5, 0, 9, 3])


@pytest.mark.parametrize("gated", [True, False])
def test_biases_match_sequential(gated):
    check_equal(config(add_bias_linear=True, gated_linear_unit=gated), [3, 7, 0, 6])


@pytest.mark.parametrize("counts", [[0, 17, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [13, 4, 6, 2]])
def test_token_counts_match_sequential(counts):
    check_equal(config(), counts)


def test_probs_on_input_match_sequential():
    cfg = config(moe_apply_probs_on_input=True, moe_router_topk=1, moe_router_pre_softmax=True)
    check_equal(cfg, [4, 2, 5, 1])


def test_selective_recompute_matches_sequential():
    cfg = config(recompute_granularity="selective", recompute_modules=["moe_act"],
                 moe_grouped_gemm=True)  # fmt: skip
    _, ours = pair(cfg)
    assert ours.options.recompute_activation
    check_equal(cfg, [6, 2, 0, 8])


def test_main_grad_accumulates_and_fires_the_gradient_hooks():
    """Megatron's DDP gives each parameter an fp32 ``main_grad`` and hooks the parameter's
    gradient accumulator: moekit adds its weight gradients into main_grad and the hooks still
    fire (what tells the DDP a bucket is ready), also with no rows at all."""
    seq, ours = pair(config())
    for rows in ([3, 0, 4, 2], [0, 0, 0, 0]):
        fired, accumulators = [], []  # held, as Megatron's DDP holds them: else they are freed
        for p in ours.parameters():
            p.main_grad = torch.full(p.shape, 0.5)
            accumulators.append(p.expand_as(p).grad_fn.next_functions[0][0])
            accumulators[-1].register_hook(lambda *_, p=p, fired=fired: fired.append(p))
        x, probs = torch.randn(sum(rows), H), torch.rand(sum(rows))
        run(ours, x, torch.tensor(rows), probs)
        assert len(fired) == 2 and all(p.grad is None for p in ours.parameters())
        ref = run(seq, x, torch.tensor(rows), probs)  # noqa: F841 - fills seq's grads
        want = grads_by_expert(seq)
        for i in range(E):
            got = ours.fc1_weight.main_grad[i] - 0.5
            torch.testing.assert_close(got, want[f"linear_fc1.weight{i}"], rtol=1e-4, atol=1e-5)
        seq.zero_grad(set_to_none=True)


@pytest.mark.parametrize("gated", [True, False])
def test_cpu_initialisation_equals_sequential(gated):
    """With use_cpu_initialization, the same seed gives moekit's experts SequentialMLP's
    weights exactly: Megatron's init methods, applied expert by expert in the same order."""
    cfg = config(gated_linear_unit=gated, add_bias_linear=True)
    torch.manual_seed(3)
    seq = SequentialMLP(E, cfg, LINEARS, pg_collection=get_default_pg_collection())
    torch.manual_seed(3)
    ours = mg.MoekitExperts(E, cfg, pg_collection=get_default_pg_collection())
    want = mg.sequential_to_grouped(seq.state_dict())
    for k, v in ours.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_state_dict_layout_and_round_trip():
    cfg = config(add_bias_linear=True)
    seq, ours = pair(cfg)
    sd = ours.state_dict()
    assert set(sd) == {f"linear_fc{j}.{k}{i}" for j in (1, 2) for k in ("weight", "bias")
                       for i in range(E)}  # fmt: skip
    assert sd["linear_fc1.weight0"].shape == (2 * FFN, H) and sd["linear_fc2.weight3"].shape == (
        H, FFN)  # fmt: skip
    back = SequentialMLP(E, cfg, LINEARS, pg_collection=get_default_pg_collection())
    back.load_state_dict(mg.grouped_to_sequential(sd), strict=True)
    for k, v in seq.state_dict().items():
        if v is not None:
            torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)
    bad = dict(sd)
    bad["linear_fc1.weight1"] = torch.zeros(3, H)
    with pytest.raises(RuntimeError, match=r"size mismatch for linear_fc1\.weight1"):
        ours.load_state_dict(bad)
    with pytest.raises(RuntimeError, match=r"Missing key.*linear_fc2\.bias2"):
        ours.load_state_dict({k: v for k, v in sd.items() if k != "linear_fc2.bias2"})


PREFIX = "decoder.layers.0.mlp.experts."


def built(sharded: dict) -> dict:
    """{(key, global offset): (global shape, replica id, data)} of every sharded tensor a
    sharded state dict gives once its factories are built (objects: the key, no data)."""
    sharded = copy.copy(sharded)
    apply_factories(sharded)
    out = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor):
            out[sh.key, sh.global_offset] = (sh.global_shape, sh.replica_id, sh.data)
        else:
            out[sh.key, type(sh).__name__] = (sh.global_shape, sh.replica_id, None)
    return out


def assert_same_sharding(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, (shape, replica, data) in want.items():
        assert got[k][:2] == (shape, replica), k
        if data is not None:
            assert torch.equal(got[k][2], data), k


def layer_sharded(module, metadata: dict | None = None) -> dict:
    """The module's sharded state dict as a TransformerBlock hands it on: the layer number
    taken out of the keys (it is an axis of the sharded offsets there)."""
    sharded = module.sharded_state_dict(PREFIX, metadata=metadata)
    replace_prefix_for_sharding(sharded, "decoder.layers.0.", "decoder.layers.")
    return sharded


@pytest.mark.parametrize("singleton", [False, True], ids=["stacked_keys", "singleton_shards"])
@pytest.mark.parametrize("bias", [False, True])
def test_sharded_state_dict_matches_sequential(bias, singleton):
    seq, ours = pair(config(add_bias_linear=bias))
    metadata = {"singleton_local_shards": singleton}
    sharded = layer_sharded(ours, metadata)
    assert all(k.startswith(PREFIX + "linear_fc") for k in sharded)
    assert_same_sharding(built(sharded), built(layer_sharded(seq, metadata)))
    # what a distributed checkpoint loads (each tensor's data) merges back into the stacks
    loaded = copy.copy(sharded)
    apply_factories(loaded)
    loaded = dict_list_map_inplace(
        lambda sh: sh.data.clone() * 2 if isinstance(sh, ShardedTensor) else None, loaded
    )
    apply_factory_merges(loaded, {k: v for k, v in sharded.items()  # as Megatron's load does
                                  if isinstance(v, ShardedTensorFactory)})  # fmt: skip
    assert loaded[PREFIX + "linear_fc1.weight"].shape == ours.fc1_weight.shape
    ours.load_state_dict({k[len(PREFIX) :]: v for k, v in loaded.items()})
    for name, p in seq.named_parameters():
        want = mg.sequential_to_grouped({name: p})
        for k, v in want.items():
            assert torch.equal(ours.state_dict()[k], 2 * v), k


def _adam_state(module, grads: dict) -> dict:
    """Megatron's sharded optimizer state (``get_param_id_to_sharded_param_map`` and
    ``optim_state_to_sharding_state``, as its optimizers build it) of one Adam step of
    ``module`` on ``grads`` (keyed by moekit's state-dict layout), built."""
    for name, p in module.named_parameters():
        if isinstance(module, SequentialMLP):  # the expert's key in moekit's layout
            p.grad = grads[next(iter(mg.sequential_to_grouped({name: None})))].clone()
        else:
            fc = {"fc1_weight": "linear_fc1.weight", "fc2_weight": "linear_fc2.weight",
                  "fc1_bias": "linear_fc1.bias", "fc2_bias": "linear_fc2.bias"}[name]  # fmt: skip
            p.grad = torch.stack([grads[f"{fc}{i}"] for i in range(E)])
    params = list(module.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    opt.step()
    state = opt.state_dict()
    ids = get_param_id_to_sharded_param_map(layer_sharded(module), params)
    optim_state_to_sharding_state(state, ids, exclude_keys="step")  # as Megatron's optimizers
    return built(state["state"])


@pytest.mark.parametrize("bias", [False, True])
def test_optimizer_state_is_sharded_as_sequentials(bias):
    """Megatron's optimizers find the stacked parameters' states through the factories: the
    sharded Adam state names, shapes and values SequentialMLP's experts' state the same."""
    seq, ours = pair(config(add_bias_linear=bias))
    g = torch.Generator().manual_seed(4)
    grads = {k: torch.randn(v.shape, generator=g) for k, v in ours.state_dict().items()}
    got, want = _adam_state(ours, grads), _adam_state(seq, grads)
    assert any(k[0].startswith("optimizer.state.exp_avg.") for k in got)
    assert_same_sharding(got, want)


def test_flattened_optimizer_format_is_declined():
    _, ours = pair(config())
    factory = ours.sharded_state_dict(PREFIX)[PREFIX + "linear_fc1.weight"]
    with pytest.raises(ValueError, match="fully_reshardable"):
        replace(factory, flattened_range=slice(0, 8)).build()


def test_spec_helper_swaps_the_experts():
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=True)
    swapped = mg.with_moekit_experts(spec)
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import build_module

    mlp, pg = swapped.submodules.mlp, get_default_pg_collection()
    if isinstance(mlp, functools.partial):  # megatron-core ≥ 0.17: builders, not ModuleSpecs
        layer = mlp(config=config(), pg_collection=pg)
    else:
        layer = build_module(mlp, config=config(), pg_collection=pg)
    assert isinstance(layer, MoELayer) and isinstance(layer.experts, mg.MoekitExperts)
    assert "MoekitExperts" not in repr(spec)  # the input spec is unchanged
    with pytest.raises(ValueError, match="found no MoE layer"):
        mg.with_moekit_experts(get_gpt_layer_local_spec())


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(activation_func=torch.tanh), "activation_func=tanh"),
        (dict(activation_func=quick_gelu), "activation_func_clamp_value=None"),
        (dict(moe_apply_probs_on_input=True), "needs moe_router_topk=1"),
        ({}, "config.delay_wgrad_compute=True is not supported"),
        ({}, "config.fp8='hybrid' is not supported"),
    ],
)
def test_declines_what_it_does_not_run(kw, match):
    cfg = config(**kw)
    # options whose own checks need what a CPU test lacks (TransformerEngine, expert
    # parallelism) are set after the config is built
    after = {"delay_wgrad_compute": True} if "delay" in match else {}
    after = {"fp8": "hybrid"} if "fp8" in match else after
    for name, value in after.items():
        setattr(cfg, name, value)
    with pytest.raises(ValueError, match=match):
        mg.MoekitExperts(E, cfg, pg_collection=get_default_pg_collection())


def test_tokens_per_expert_must_be_a_tensor():
    _, ours = pair(config())
    with pytest.raises(TypeError, match="tokens_per_expert must be a tensor, got list"):
        ours(torch.randn(3, H), [1, 1, 1, 0], torch.rand(3))
