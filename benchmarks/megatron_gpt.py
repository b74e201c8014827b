"""Megatron-Core GPT-MoE models for the Megatron benchmark and GPU tests: one process's model
parallel state, a config per shape, and the model built with each experts backend from the
same weights: moekit's (``with_moekit_experts``), Megatron's ``SequentialMLP`` (what its local
spec gives without TransformerEngine), and a ``torch._grouped_mm`` experts module written here
as the stand-in for a grouped path (TransformerEngine's ``TEGroupedMLP`` needs a TE build)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from torch_moe import torch_grouped_swiglu

from moekit.integrations.megatron import MoekitExperts, sequential_to_grouped, with_moekit_experts

SHAPES = {  # hidden, heads, experts, top-k, expert ffn; layers and tokens set per run
    "tiny": (64, 4, 8, 2, 96),
    "qwen3_30b_a3b": (2048, 32, 128, 8, 768),
    "deepseek_v3_ep8": (7168, 56, 32, 8, 2048),  # one EP-8 rank's 32 of DeepSeek-V3's experts
}
BACKENDS = ("moekit", "sequential", "grouped_mm")


def init_single_process(seed: int = 1234) -> None:
    """A one-GPU world (NCCL, every parallel size 1) with Megatron's RNG trackers seeded."""
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    set_expert_parallel(1, seed)


def set_expert_parallel(ep: int, seed: int = 1234) -> None:
    """Megatron's parallel state at expert parallelism ``ep`` over the initialised world (data
    parallel over all of it), replacing any earlier state; RNG trackers seeded."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep)
    model_parallel_cuda_manual_seed(seed)


def gpt_config(shape: str, layers: int, dtype, dispatcher: str = "alltoall",
               ep: int = 1) -> TransformerConfig:  # fmt: skip
    hidden, heads, experts, topk, ffn = SHAPES[shape]
    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=4 * hidden, num_moe_experts=experts, moe_router_topk=topk,
        moe_ffn_hidden_size=ffn, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, normalization="RMSNorm", moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, hidden_dropout=0.0,
        attention_dropout=0.0, expert_model_parallel_size=ep)  # fmt: skip


class GroupedMMExperts(MoekitExperts):
    """Experts as two ``torch._grouped_mm`` calls around SwiGLU × prob in eager PyTorch
    (torch_moe.py's): the grouped-GEMM stand-in, on MoekitExperts' parameters and layout."""

    def forward(self, x, tokens_per_expert, probs):
        offs = tokens_per_expert.to(x.device).cumsum(0).to(torch.int32)
        return torch_grouped_swiglu(x, offs, self.fc1_weight, self.fc2_weight, probs), None


def layer_spec(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    spec = get_gpt_layer_local_spec(num_experts=8, normalization="RMSNorm")  # SequentialMLP
    if backend == "sequential":
        return spec
    return with_moekit_experts(spec, GroupedMMExperts if backend == "grouped_mm" else MoekitExperts)


def build_gpt(config: TransformerConfig, backend: str, vocab: int, seq: int, state=None):
    """The GPT-MoE of ``config`` with ``backend``'s experts, on the GPU; ``state``: a
    ``SequentialMLP`` model's state dict to start from (converted for the grouped backends)."""
    model = GPTModel(config, layer_spec(backend), vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope").cuda()  # fmt: skip
    if state is not None:
        model.load_state_dict(state if backend == "sequential" else sequential_to_grouped(state))
    return model


def batch(config: TransformerConfig, vocab: int, batch_size: int, seq: int, seed: int = 0):
    """(tokens, positions, causal mask, labels) of a random batch on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq + 1), device="cuda", generator=g)
    pos = torch.arange(seq, device="cuda").expand(batch_size, -1)
    mask = torch.ones(1, 1, seq, seq, device="cuda", dtype=torch.bool).triu(1)
    return ids[:, :-1], pos, mask, ids[:, 1:]


def train_step(model, data) -> tuple:
    """(logits, mean loss, {name: grad}) of one forward and backward of ``model`` on ``data``
    (:func:`batch`'s), the experts' gradients keyed by expert in moekit's state-dict layout
    (``…linear_fc1.weight<i>``, i the local expert; SequentialMLP's converted); a weight's
    ``main_grad`` where it has no ``.grad`` (Megatron's DDP)."""
    model.zero_grad(set_to_none=True)
    ids, pos, mask, labels = data
    loss = model(ids, pos, mask, labels=labels).float().mean()
    loss.backward()
    with torch.no_grad():
        logits = model(ids, pos, mask).float()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
        if name.endswith(("fc1_weight", "fc2_weight")):
            fc = "linear_fc1" if name.endswith("fc1_weight") else "linear_fc2"
            for i in range(p.shape[0]):
                grads[name.rsplit(".", 1)[0] + f".{fc}.weight{i}"] = g[i].float()
        elif g is not None:
            grads[name] = g.float()
    return logits, loss.detach(), sequential_to_grouped(grads)
