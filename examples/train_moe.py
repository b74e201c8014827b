"""Train a small decoder-only MoE language model with moekit, on text that ships with Python.

    python examples/train_moe.py                      # tiny config, CPU-friendly (make run)
    python examples/train_moe.py --config small       # larger sizes (GPU)
    python examples/train_moe.py --resume             # continue the run folder's checkpoint
    python examples/train_moe.py --baseline torch     # same model, torch-native MoE layers
    torchrun --nproc_per_node=2 examples/train_moe.py --ep 2   # experts split over 2 GPUs

The corpus is the Python standard library's own source files, read bytewise (vocabulary 256),
so nothing is downloaded. Each block is RMSNorm → causal self-attention
(``scaled_dot_product_attention``) → RMSNorm → ``moekit.nn.MoELayer``, with residuals; the
output head is tied to the token embedding. A progress bar shows the loss and tokens/s; at the
end the script prints the validation loss and writes ``losses.json``, ``loss_curve.png`` and
``checkpoint.pt`` under ``--out`` (default ``runs/<config>-<baseline>``). CPU tensors run
moekit's PyTorch reference path; on a GPU the Triton kernels run (bf16).

With ``--ep N`` (under torchrun, N processes) the experts of every MoE layer are split over the
N ranks (``MoELayer(ep_group=...)``) and each rank takes 1/N of every batch; the other weights
are replicated and their gradients averaged, so the run follows the single-process one from
the same seed. Each rank writes its own ``checkpoint-rank<r>.pt``.
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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

from benchmarks.torch_moe import torch_moe, with_loss
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


LOG_EVERY = 10  # steps between loss read-backs (each one waits for the GPU)

CONFIGS = {
    "tiny": Config(64, 2, 4, 4, 2, 64, 64, 16, 1200, 3e-3, 2.0),
    "small": Config(256, 4, 8, 16, 2, 256, 256, 32, 1000, 1e-3, 16.0),
    "mid": Config(512, 8, 8, 32, 4, 512, 512, 64, 2000, 6e-4, 64.0),
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
    """The same layer and parameters, run by the torch-native MoE of
    ``benchmarks/torch_moe.py``: linear router + softmax top-k, argsort permute,
    ``torch._grouped_mm`` SwiGLU experts (a per-expert loop on CPU), index_add_ combine, and
    the same load-balancing loss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        r = self.router
        y, aux = torch_moe(
            tokens, r.weight, self.experts.fc1_weight, self.experts.fc2_weight, self.k,
            aux_loss_coeff=r.aux_loss_coeff, expert_bias=r.expert_bias, **r.route_kwargs,
        )  # fmt: skip
        return with_loss(y, aux).view(x.shape)


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


def evaluate(model, data, cfg, device, ep, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = ep.shard(*batch(data, cfg, gen, device))
            total += float(ep.mean(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())))
    model.train()
    return total / batches


# ------------------------------------------------------------------------------------------------
# Expert parallelism (--ep N under torchrun)
# ------------------------------------------------------------------------------------------------

EXPERT_WEIGHTS = ("experts.fc1_weight", "experts.fc2_weight")


class ExpertParallel:
    """The ranks of an --ep run (a single process is the group of one): batch shards, the
    model with each rank's share of the experts, gradient averaging and global clipping."""

    def __init__(self, size: int, device: str) -> None:
        self.size, self.rank, self.group = size, 0, None
        if size > 1:
            if int(os.environ.get("WORLD_SIZE", "1")) != size:
                raise SystemExit(f"--ep {size} needs torchrun --nproc_per_node={size}")
            if device == "cuda":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl" if device == "cuda" else "gloo")
            self.rank, self.group = dist.get_rank(), dist.group.WORLD

    def build(self, cfg: Config, moe_cls: type[MoELayer], device, dtype) -> nn.Module:
        """The single-process model (same seed, same weights), with this rank's experts."""
        model = MoELM(cfg, moe_cls).to(device, dtype)
        if self.size == 1:
            return model
        group = self.group

        class RankMoE(moe_cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, ep_group=group, **kwargs)

        state = model.state_dict()
        n = cfg.num_experts // self.size
        for name in state:
            if name.endswith(EXPERT_WEIGHTS):
                state[name] = state[name][self.rank * n : (self.rank + 1) * n].clone()
        ep_model = MoELM(cfg, RankMoE).to(device, dtype)
        ep_model.load_state_dict(state)
        return ep_model

    def shard(self, x: torch.Tensor, y: torch.Tensor) -> tuple:
        n = x.shape[0] // self.size
        return x[self.rank * n : (self.rank + 1) * n], y[self.rank * n : (self.rank + 1) * n]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            t = t.detach().clone()
            dist.all_reduce(t)
            t /= self.size
        return t

    def sync_and_clip(self, model: nn.Module, max_norm: float) -> None:
        """Average the replicated weights' gradients; the experts' gradients already hold every
        rank's tokens (each rank's loss is a mean over its shard, hence / N). Then clip by the
        global norm."""
        if self.size == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return
        local_sq = torch.zeros((), device=next(model.parameters()).device)
        shared_sq = torch.zeros_like(local_sq)
        for name, p in model.named_parameters():
            if p.grad is None:
                continue
            if name.endswith(EXPERT_WEIGHTS):
                p.grad /= self.size
                local_sq += p.grad.float().square().sum()
            else:
                dist.all_reduce(p.grad)
                p.grad /= self.size
                shared_sq += p.grad.float().square().sum()
        dist.all_reduce(local_sq)
        scale = (max_norm / ((local_sq + shared_sq).sqrt() + 1e-6)).clamp(max=1.0)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))


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
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: config)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (under torchrun)")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), default=None,
        help="parameter and activation dtype (default: bfloat16 on a GPU, float32 on CPU)",
    )  # fmt: skip
    args = p.parse_args(argv)
    for name in ("steps", "batch", "stop_after", "ep"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    cfg = CONFIGS[args.config]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    out = args.out or os.path.join("runs", f"{args.config}-{args.baseline}")
    os.makedirs(out, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    data = load_corpus(cfg.corpus_mb)
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    ep = ExpertParallel(args.ep, device)
    if args.ep > 1 and args.baseline != "moekit":
        raise SystemExit("--ep runs the moekit layers only")
    if cfg.batch % ep.size:  # each rank trains on its own equal share of the batch
        raise SystemExit(f"--batch ({cfg.batch}) must be a multiple of --ep ({ep.size})")
    model = ep.build(cfg, MoELayer if args.baseline == "moekit" else TorchMoE, device, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, eps=1e-6)
    gen = torch.Generator().manual_seed(args.seed)
    losses: list[float] = []
    ckpt_path = os.path.join(
        out, "checkpoint.pt" if ep.size == 1 else f"checkpoint-rank{ep.rank}.pt"
    )
    if args.resume:
        if not os.path.exists(ckpt_path):
            raise SystemExit(f"--resume: no checkpoint at {ckpt_path}")
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        saved = ckpt["config"]
        now = dataclasses.asdict(cfg)
        changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if changed:  # the data stream and the LR schedule would silently differ
            diffs = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise SystemExit(f"--resume with another configuration than the checkpoint's ({diffs})")
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["data_rng"].cpu())  # a CPU generator's state, whatever map_location
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
        tqdm(steps, desc=f"{args.config}/{args.baseline}", disable=args.no_progress or ep.rank > 0)
        if tqdm
        else steps
    )
    tokens_per_step = cfg.batch * cfg.seq
    pending: list[torch.Tensor] = []  # losses still on the device: read every LOG_EVERY steps
    t0 = time.perf_counter()
    steady = None  # (steps, time) at the first read-back: tokens/s after the first steps
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = ep.shard(*batch(train, cfg, gen, device))
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        ep.sync_and_clip(model, 1.0)
        opt.step()
        pending.append(ep.mean(loss).detach())
        if len(pending) < LOG_EVERY and step + 1 < end:
            continue
        losses.extend(torch.stack(pending).float().tolist())  # the one host sync per window
        pending.clear()
        now = time.perf_counter()
        steady = steady or (step + 1 - start, now)
        rate = (step - start + 1) * tokens_per_step / (now - t0)
        if tqdm is not None and not args.no_progress:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
        elif ep.rank == 0 and ((step + 1) % 100 < LOG_EVERY or step + 1 == end):
            print(f"step {step + 1}/{cfg.steps}  loss {losses[-1]:.4f}  {rate:,.0f} tok/s")
    elapsed = time.perf_counter() - t0
    tok_s = (end - start) * tokens_per_step / max(elapsed, 1e-9)
    tok_s_steady = tok_s
    if steady is not None and end - start > steady[0]:
        tok_s_steady = (
            (end - start - steady[0]) * tokens_per_step / (time.perf_counter() - steady[1])
        )
    val_loss = evaluate(model, val, cfg, device, ep)
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "data_rng": gen.get_state(),
         "losses": losses, "config": dataclasses.asdict(cfg)},
        ckpt_path,
    )  # fmt: skip
    result = {
        "config": args.config, "baseline": args.baseline, "device": device, "steps": cfg.steps,
        "dtype": str(dtype).removeprefix("torch."), "ep": ep.size,
        "losses": losses, "val_loss": val_loss, "tokens_per_s": tok_s,
        "tokens_per_s_after_first_steps": tok_s_steady, "batch": cfg.batch,
    }  # fmt: skip
    if ep.rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(result, f)
        title = f"{args.config} / {args.baseline}" + (f" / ep{ep.size}" if ep.size > 1 else "")
        save_curve(losses, os.path.join(out, "loss_curve.png"), title)
        print(
            f"done: {len(losses)}/{cfg.steps} steps, train loss {losses[-1]:.4f}, validation "
            f"loss {val_loss:.4f} nats/byte, {tok_s:,.0f} tokens/s ({device}"
            f"{f', {ep.size} ranks' if ep.size > 1 else ''}); run folder {out}"
        )
    if ep.size > 1:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
