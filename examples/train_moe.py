"""Train a small decoder-only MoE language model with moekit, on text that ships with Python.

    python examples/train_moe.py                      # tiny config, CPU-friendly (make run)
    python examples/train_moe.py --config small       # larger sizes (GPU)
    python examples/train_moe.py --resume             # continue the run folder's checkpoint
    python examples/train_moe.py --baseline torch     # same model, torch-native MoE layers

The corpus is the Python standard library's own source files, read bytewise (vocabulary 256),
so nothing is downloaded. Each block is RMSNorm → causal self-attention
(``scaled_dot_product_attention``) → RMSNorm → ``moekit.nn.MoELayer``, with residuals; the
output head is tied to the token embedding. A progress bar shows the loss and tokens/s; at the
end the script prints the validation loss and writes ``losses.json``, ``loss_curve.png`` and
``checkpoint.pt`` under ``--out`` (default ``runs/<config>-<baseline>``). CPU tensors run
moekit's PyTorch reference path; on a GPU the Triton kernels run (bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from moekit.nn import MoELayer, RMSNorm


@dataclasses.dataclass(frozen=True)
class Config:
    d_model: int
    n_layers: int
    n_heads: int
    num_experts: int
    k: int
    ffn: int  # each expert's width
    seq: int
    batch: int
    steps: int
    lr: float
    corpus_mb: float


CONFIGS = {
    "tiny": Config(64, 2, 4, 4, 2, 64, 64, 16, 1200, 3e-3, 2.0),
    "small": Config(256, 4, 8, 16, 2, 256, 256, 32, 1000, 1e-3, 16.0),
    "mid": Config(512, 8, 8, 32, 4, 512, 512, 32, 2000, 6e-4, 64.0),
}


# ------------------------------------------------------------------------------------------------
# Data: the standard library's sources, bytewise
# ------------------------------------------------------------------------------------------------


def load_corpus(megabytes: float) -> torch.Tensor:
    """uint8 tokens of the standard library's .py files (sorted paths, so every machine with
    the same Python reads the same text), up to ``megabytes``."""
    root = sysconfig.get_paths()["stdlib"]
    limit = int(megabytes * (1 << 20))
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests"))
        for name in sorted(filenames):
            if name.endswith(".py") and total < limit:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()[: limit - total]
                chunks.append(data)
                total += len(data)
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batch(data: torch.Tensor, cfg: Config, gen: torch.Generator, device) -> tuple:
    starts = torch.randint(0, data.numel() - cfg.seq - 1, (cfg.batch,), generator=gen)
    rows = torch.stack([data[s : s + cfg.seq + 1] for s in starts.tolist()]).to(device)
    return rows[:, :-1], rows[:, 1:]


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class TorchMoE(MoELayer):
    """The same layer and parameters, run with torch-native ops: linear router + softmax top-k,
    argsort permute, per-expert SwiGLU (``torch._grouped_mm`` on a GPU), index_add_ combine."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        H = x.shape[-1]
        tokens = x.reshape(-1, H)
        logits = F.linear(tokens, self.router.weight).float()
        probs, idx = logits.softmax(-1).topk(self.k, dim=-1)
        probs = probs / probs.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        rows = tokens.index_select(0, order // self.k)
        w1, w2 = self.experts.fc1_weight, self.experts.fc2_weight
        if x.is_cuda:
            h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offsets)
        else:
            ends = offsets.tolist()
            h = torch.cat([rows[a:b] @ w1[e].t() for e, (a, b) in enumerate(zip([0, *ends], ends))])
        gate, up = h.chunk(2, dim=-1)
        a = (F.silu(gate.float()) * up.float() * probs.flatten()[order][:, None]).to(x.dtype)
        if x.is_cuda:
            out_rows = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offsets)
        else:
            out_rows = torch.cat(
                [a[s:e] @ w2[i].t() for i, (s, e) in enumerate(zip([0, *ends], ends))]
            )
        y = torch.zeros_like(tokens).index_add_(0, order // self.k, out_rows.to(x.dtype))
        return y.view(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: Config, moe_cls: type[MoELayer]) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.moe = moe_cls(d, cfg.ffn, cfg.num_experts, cfg.k, aux_loss_coeff=1e-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.n_heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(B, S, D))
        return x + self.moe(self.norm2(x))


class MoELM(nn.Module):
    def __init__(self, cfg: Config, moe_cls: type[MoELayer]) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg, moe_cls) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.norm(x), self.embed.weight)  # tied head


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


def evaluate(model, data, cfg, device, dtype, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = batch(data, cfg, gen, device)
            total += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()))
    model.train()
    return total / batches


def save_curve(losses: list[float], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--baseline", choices=("moekit", "torch"), default="moekit")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: the config's)")
    p.add_argument("--out", default=None, help="run folder (default runs/<config>-<baseline>)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-after", type=int, default=None,
        help="stop (and save) after this many steps of the schedule, e.g. to --resume later",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    args = p.parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    out = args.out or os.path.join("runs", f"{args.config}-{args.baseline}")
    os.makedirs(out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    data = load_corpus(cfg.corpus_mb)
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    model = MoELM(cfg, MoELayer if args.baseline == "moekit" else TorchMoE).to(device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, eps=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    ckpt_path = os.path.join(out, "checkpoint.pt")
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["data_rng"])
        losses = ckpt["losses"]
    start = len(losses)
    warmup = max(1, cfg.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, cfg.steps - warmup)))

    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    end = cfg.steps if args.stop_after is None else min(cfg.steps, args.stop_after)
    steps = range(start, end)
    bar = (
        tqdm(steps, desc=f"{args.config}/{args.baseline}", disable=args.no_progress)
        if tqdm
        else steps
    )
    tokens_per_step = cfg.batch * cfg.seq
    t0 = time.perf_counter()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch(train, cfg, gen, device)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach().item())
        rate = (step - start + 1) * tokens_per_step / (time.perf_counter() - t0)
        if tqdm is not None and not args.no_progress:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
        elif (step + 1) % 100 == 0 or step + 1 == end:
            print(f"step {step + 1}/{cfg.steps}  loss {losses[-1]:.4f}  {rate:,.0f} tok/s")
    elapsed = time.perf_counter() - t0
    tok_s = (end - start) * tokens_per_step / max(elapsed, 1e-9)
    val_loss = evaluate(model, val, cfg, device, dtype)
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "data_rng": gen.get_state(),
         "losses": losses, "config": dataclasses.asdict(cfg)},
        ckpt_path,
    )  # fmt: skip
    result = {
        "config": args.config, "baseline": args.baseline, "device": device, "steps": cfg.steps,
        "losses": losses, "val_loss": val_loss, "tokens_per_s": tok_s,
    }  # fmt: skip
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump(result, f)
    save_curve(losses, os.path.join(out, "loss_curve.png"), f"{args.config} / {args.baseline}")
    print(
        f"done: {len(losses)}/{cfg.steps} steps, train loss {losses[-1]:.4f}, validation loss "
        f"{val_loss:.4f} nats/byte, {tok_s:,.0f} tokens/s ({device}); run folder {out}"
    )
    return result


if __name__ == "__main__":
    main()
