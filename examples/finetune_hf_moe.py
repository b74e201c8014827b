"""Train a Hugging Face transformers MoE model with moekit's experts backend.

    python examples/finetune_hf_moe.py                    # tiny Qwen3-MoE, CPU-friendly
    python examples/finetune_hf_moe.py --family olmoe --steps 500
    python examples/finetune_hf_moe.py --experts eager    # transformers' own experts, to compare

The model is a random-initialised transformers model (``qwen3_moe``, ``olmoe``, ``mixtral``,
``qwen2_moe`` or ``deepseek_v3``) built from a small config, so nothing is downloaded; the one
line that matters is ``experts_implementation="moekit"``. With a checkpoint of your own, pass
the same argument to ``from_pretrained``. The text is the Python standard library's sources,
bytewise (vocabulary 256), as in ``train_moe.py``. On a GPU the model runs in bf16 and the
experts in moekit's Triton kernels; on CPU moekit's PyTorch reference path runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

import moekit.integrations.transformers  # noqa: F401  (registers experts_implementation="moekit")
from examples.train_moe import load_corpus

SMALL = dict(
    vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=True,
)  # fmt: skip
FAMILY_OPTIONS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                        n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                        kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=32),
}  # fmt: skip


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=sorted(FAMILY_OPTIONS), default="qwen3_moe")
    p.add_argument("--experts", default="moekit", help="experts_implementation")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(args.family, **SMALL, **FAMILY_OPTIONS[args.family])
    model = transformers.AutoModelForCausalLM.from_config(
        config, experts_implementation=args.experts, dtype=dtype
    ).to(device)
    model.train()
    data = load_corpus(2.0)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, t0 = [], time.perf_counter()
    for step in range(args.steps):
        starts = torch.randint(0, data.numel() - args.seq, (args.batch,), generator=gen)
        ids = torch.stack([data[s : s + args.seq] for s in starts.tolist()]).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == args.steps:
            rate = (step + 1) * args.batch * args.seq / (time.perf_counter() - t0)
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.3f}  {rate:,.0f} tok/s")
    n = min(10, len(losses))  # the first and last n steps' mean loss
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    print(f"{args.family} with experts_implementation={args.experts!r} on {device}: "
          f"loss {first:.3f} -> {last:.3f} nats/byte")  # fmt: skip
    return losses


if __name__ == "__main__":
    main()
