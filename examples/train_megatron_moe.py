"""Train a small Megatron-Core GPT-MoE whose experts are moekit's, on one GPU.

    pip install 'moekit[megatron]'
    python examples/train_megatron_moe.py [--steps 300] [--backend sequential]

The model is Megatron's own (GPTModel, its router, alltoall token dispatcher, attention and
norms from the local spec, no TransformerEngine); the one moekit line is
``with_moekit_experts(spec)``. The data is a synthetic language with a learnable rule (each
token is a fixed function of the two before it), so the loss falls well below log(vocab).
``--backend sequential`` trains the same model with Megatron's SequentialMLP experts.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from moekit.integrations.megatron import with_moekit_experts

VOCAB, SEQ, BATCH = 512, 256, 16


def synthetic_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where token t = (a·x[t-1] + b·x[t-2] + c) mod VOCAB after two random starts."""
    x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    x[:, :2] = torch.randint(0, VOCAB, (BATCH, 2), generator=gen)
    for t in range(2, SEQ + 1):
        x[:, t] = (3 * x[:, t - 1] + 5 * x[:, t - 2] + 7) % VOCAB
    x = x.cuda()
    return x[:, :-1], x[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backend", choices=("moekit", "sequential"), default="moekit")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, ffn_hidden_size=1024,
        num_moe_experts=16, moe_router_topk=2, moe_ffn_hidden_size=256, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, normalization="RMSNorm",
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2, bf16=True, params_dtype=torch.bfloat16,
    )  # fmt: skip
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    if args.backend == "moekit":
        spec = with_moekit_experts(spec)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope").cuda()  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=args.steps)
    pos = torch.arange(SEQ, device="cuda").expand(BATCH, -1)
    mask = torch.ones(1, 1, SEQ, SEQ, device="cuda", dtype=torch.bool).triu(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.backend} experts: {type(model.decoder.layers[0].mlp.experts).__name__}; "
          f"log(vocab) = {math.log(VOCAB):.2f}")  # fmt: skip
    t0, tokens = time.time(), 0
    for step in range(1, args.steps + 1):
        ids, labels = synthetic_batch(gen)
        loss = model(ids, pos, mask, labels=labels).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        tokens += ids.numel()
        if step % 50 == 0 or step == args.steps:
            rate = tokens / (time.time() - t0)
            print(f"step {step:4d}  loss {loss.item():.3f}  {rate:,.0f} tokens/s")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
