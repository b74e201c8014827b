"""Train a small decoder-only MoE language model with moekit, on text that ships with Python.

    python examples/train_moe.py                      # tiny config, CPU-friendly (make run)
    python examples/train_moe.py --config mid         # larger sizes (GPU)
    python examples/train_moe.py --stop-after 500     # ... then --resume continues identically
    python examples/train_moe.py --baseline torch     # same model, torch-native MoE layers
    python examples/train_moe.py --fp8                # the routed experts in FP8 (docs/fp8.md)
    torchrun --nproc_per_node=4 examples/train_moe.py --ep 4 --config mid   # experts on 4 GPUs

The corpus is the Python standard library's own source files, read bytewise (vocabulary 256),
so nothing is downloaded. Each block is RMSNorm → causal self-attention
(``scaled_dot_product_attention``) → RMSNorm → ``moekit.nn.MoELayer``, with residuals; the
output head is tied to the token embedding. On a terminal a progress bar shows the loss and
tokens/s (plain log lines otherwise); at the end the script prints the validation loss and
writes ``losses.json``, ``loss_curve.png`` and ``checkpoint/`` under ``--out`` (default: the
first of ``runs/<config>-<baseline>[-ep<N>]``, ``...-2``, ``...-3`` that holds no run; with
``--resume`` the last that does). A folder with a run in it is never overwritten unless
``--overwrite``. CPU tensors run moekit's PyTorch reference path; on a GPU the Triton kernels
run (bf16). The learning rate warms up linearly, then follows a cosine (torch's ``LinearLR``
then ``CosineAnnealingLR``).

Under torchrun (W processes) with ``--ep N``: a ``DeviceMesh`` (W/N data-parallel × N expert-
parallel), each MoE layer's experts split over the expert-parallel ranks, FSDP2 for every other
weight, each rank 1/W of every batch, so the run follows the single-process one from the same
seed (``examples/train_moe_parallel.py``). Checkpoints are ``torch.distributed.checkpoint``
folders that reload at any EP size (``--resume`` with another ``--ep``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run from a checkout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the example's own modules

from train_moe_parallel import Parallel
from train_moe_plot import label, save_figure

from benchmarks.torch_moe import torch_moe, with_loss
from moekit import Fp8Recipe
from moekit.nn import MoELayer, RMSNorm, RouterConfig


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
        r, c = self.router, self.router.config
        y, aux = torch_moe(
            tokens, r.weight, self.experts.fc1_weight, self.experts.fc2_weight, self.k,
            aux_loss_coeff=c.aux_loss_coeff, expert_bias=r.expert_bias, **c.routing_kwargs(),
        )  # fmt: skip
        self.last_aux_loss = aux.detach()
        return with_loss(y, aux).view(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: Config, moe_cls: type[MoELayer]) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        router = RouterConfig(aux_loss_coeff=1e-2)
        self.moe = moe_cls(d, cfg.ffn, cfg.num_experts, cfg.k, router=router)

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

LOG_EVERY = 10  # steps between read-backs of the losses (each one waits for the GPU)
EVALS = 8  # validation points over a run


def evaluate(model, data, cfg, device, par, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)
    model.eval()
    total = 0.0
    with torch.no_grad():
        for _ in range(batches):
            x, y = par.shard(*batch(data, cfg, gen, device))
            total += float(par.mean(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())))
    model.train()
    return total / batches


class Fp8MoE(MoELayer):
    """moekit's layer with its routed experts in FP8 (blockwise e4m3, the default recipe)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, fp8=Fp8Recipe(), **kwargs)


def build_model(cfg: Config, baseline: str, par: Parallel, device, dtype) -> nn.Module:
    """The single-process model (its weights from the seed alone) with this rank's experts,
    sharded by FSDP2 over the ranks."""
    moe_cls = {"moekit": MoELayer, "moekit-fp8": Fp8MoE, "torch": TorchMoE}[baseline]
    model = MoELM(cfg, moe_cls).to(device, dtype)
    if par.size == 1:
        return model
    group = par.ep_group

    class RankMoE(moe_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, ep_group=group, **kwargs)

    state = par.local_experts(model.state_dict(), cfg.num_experts)
    ranked = MoELM(cfg, RankMoE if group is not None else moe_cls).to(device, dtype)
    ranked.load_state_dict(state)
    return par.shard_model(ranked)


def schedule(opt: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over the first 5% of the steps, then a cosine down to zero."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR

    warmup = max(2, cfg.steps // 20)
    cosine = CosineAnnealingLR(opt, T_max=max(1, cfg.steps - warmup))
    if cfg.steps <= warmup:
        return cosine
    ramp = LinearLR(opt, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1)
    return SequentialLR(opt, [ramp, cosine], milestones=[warmup])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--baseline", choices=("moekit", "torch"), default="moekit")
    p.add_argument("--fp8", action="store_true", help="moekit's routed experts in FP8")
    p.add_argument("--steps", type=int, default=None, help="total steps (default: the config's)")
    p.add_argument("--out", default=None, help="run folder (default: a new one under runs/)")
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in <out>")
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
    if args.resume and args.overwrite:
        p.error("--resume continues the run in --out, --overwrite replaces it: pick one")
    if args.fp8:
        if args.baseline != "moekit":
            p.error("--fp8 runs moekit's layers (not --baseline torch)")
        args.baseline = "moekit-fp8"
    return args


def _holds_run(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("losses.json", "checkpoint"))


def _default_folder(args) -> str:
    """runs/<config>-<baseline>[-ep<N>], or -2, -3, ... after it: a new run takes the first
    that holds no run, --resume the last that does."""
    base = os.path.join("runs", f"{args.config}-{args.baseline}")
    base += f"-ep{args.ep}" if args.ep > 1 else ""
    names = [base] + [f"{base}-{i}" for i in range(2, 1000)]
    used = [n for n in names if _holds_run(n)]
    if args.resume:
        return used[-1] if used else base
    return next(n for n in names if not _holds_run(n))


def run_folder(args, par: Parallel) -> str:
    """The run folder, the same on every rank; an earlier run is never overwritten silently."""
    out = args.out
    if out is None:
        out = _default_folder(args) if par.rank == 0 else None
        if par.size > 1:
            box = [out]
            dist.broadcast_object_list(box, src=0)
            out = box[0]
    ckpt = os.path.join(out, "checkpoint")
    if args.resume and not os.path.exists(os.path.join(ckpt, ".metadata")):
        raise SystemExit(f"--resume: no checkpoint at {ckpt}")
    if _holds_run(out) and not (args.resume or args.overwrite):
        raise SystemExit(
            f"{out} holds an earlier run: --resume continues it, --overwrite replaces it, or "
            "choose another --out"
        )
    if par.rank == 0:
        if args.overwrite:
            for f in ("losses.json", "loss_curve.png", "log.txt"):
                if os.path.exists(os.path.join(out, f)):
                    os.remove(os.path.join(out, f))
            shutil.rmtree(ckpt, ignore_errors=True)
        os.makedirs(out, exist_ok=True)
    if par.size > 1:
        dist.barrier()
    return out


class Progress:
    """tqdm's bar on a terminal (rank 0); elsewhere a log line every tenth of the run, also
    appended to <out>/log.txt."""

    def __init__(self, steps: range, title: str, quiet: bool, rank: int, out: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        self.rank, self.total = rank, steps.stop
        self.bar = None
        if tqdm is not None and not quiet and rank == 0 and sys.stderr.isatty():
            self.bar = tqdm(steps, desc=title)
        self.steps = self.bar if self.bar is not None else steps
        self.every = max(1, self.total // 10)
        self.log = os.path.join(out, "log.txt")

    def update(self, step: int, loss: float, tok_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
        elif self.rank == 0 and ((step + 1) % self.every < LOG_EVERY or step + 1 == self.total):
            self.say(f"step {step + 1}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tok/s")

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)
            with open(self.log, "a") as f:
                f.write(text + "\n")


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cfg = CONFIGS[args.config]
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, steps=args.steps)
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    if args.ep > 1 and args.baseline not in ("moekit", "moekit-fp8"):
        raise SystemExit("--ep runs the moekit layers only")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (
        torch.bfloat16 if device == "cuda" else torch.float32
    )  # fmt: skip
    par = Parallel(args.ep, device)
    if cfg.batch % par.size:  # each rank trains on its own equal share of the batch
        raise SystemExit(f"--batch ({cfg.batch}) must be a multiple of the ranks ({par.size})")
    if cfg.num_experts % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the {cfg.num_experts} experts")
    out = run_folder(args, par)
    torch.manual_seed(args.seed)
    data = load_corpus(cfg.corpus_mb)
    split = int(data.numel() * 0.95)
    train, val = data[:split], data[split:]
    model = build_model(cfg, args.baseline, par, device, dtype)
    # AdamW's foreach kernels take one kind of tensor per call: FSDP2's DTensors and the plain
    # expert weights do not mix
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, eps=1e-6,
                            foreach=par.size == 1)  # fmt: skip
    sched = schedule(opt, cfg)
    gen = torch.Generator().manual_seed(args.seed)
    layers = moe_layers(model)
    E = cfg.num_experts
    record = {"losses": [], "aux": [], "val": []}
    load = torch.zeros(len(layers), E, device=device)  # tokens routed per layer and expert
    ckpt = os.path.join(out, "checkpoint")
    if args.resume:
        extra = {"data_rng": gen.get_state(), "meta": "", "load": load.cpu()}
        got = par.load(ckpt, model, opt, sched, extra)
        meta = json.loads(got["meta"])  # the config and the record so far
        changed = {k: (meta["config"].get(k), v) for k, v in dataclasses.asdict(cfg).items()
                   if meta["config"].get(k) != v}  # fmt: skip
        if changed:  # the data stream and the LR schedule would silently differ
            diffs = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
            raise SystemExit(f"--resume with another configuration than the checkpoint's ({diffs})")
        gen.set_state(got["data_rng"])
        record = meta["record"]
        load = got["load"].to(device)
    start = len(record["losses"])
    end = cfg.steps if args.stop_after is None else min(cfg.steps, args.stop_after)
    title = f"{args.config}/{args.baseline}" + (f"/ep{args.ep}" if args.ep > 1 else "")
    progress = Progress(range(start, end), title, args.no_progress, par.rank, out)
    tokens_per_step = cfg.batch * cfg.seq
    eval_every = max(1, cfg.steps // EVALS)
    local_load = torch.zeros_like(load)
    pending: list[torch.Tensor] = []  # [loss, aux] on the device, read back every LOG_EVERY
    t0 = time.perf_counter()
    for step in progress.steps:
        x, y = par.shard(*batch(train, cfg, gen, device))
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        par.finish_grads_and_clip(model, 1.0)
        opt.step()
        sched.step()
        aux = sum((m.last_aux_loss for m in layers if m.last_aux_loss is not None),
                  torch.zeros((), device=device))  # fmt: skip
        pending.append(par.mean(torch.stack([loss.detach(), aux])))
        for i, m in enumerate(layers):
            if m.last_counts is not None:
                local_load[i] += m.last_counts
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            record["val"].append((step + 1, evaluate(model, val, cfg, device, par)))
        if len(pending) < LOG_EVERY and step + 1 < end:
            continue
        both = torch.stack(pending).float().tolist()  # the one host sync per window
        record["losses"] += [a for a, _ in both]
        record["aux"] += [b for _, b in both]
        pending.clear()
        rate = (step - start + 1) * tokens_per_step / (time.perf_counter() - t0)
        progress.update(step, record["losses"][-1], rate)
    elapsed = time.perf_counter() - t0
    tok_s = (end - start) * tokens_per_step / max(elapsed, 1e-9)
    val_loss = evaluate(model, val, cfg, device, par)
    load = load + par.sum(local_load)
    meta = json.dumps({"config": dataclasses.asdict(cfg), "record": record})
    par.save(ckpt, model, opt, sched, {"data_rng": gen.get_state(), "meta": meta,
             "load": load.cpu()})  # fmt: skip
    share = (load / load.sum(1, keepdim=True).clamp_min(1) * E).tolist() if load.any() else None
    result = {
        "config": args.config, "baseline": args.baseline, "device": device, "steps": cfg.steps,
        "dtype": str(dtype).removeprefix("torch."), "ep": args.ep, "world": par.size,
        **record, "expert_load": share, "val_loss": val_loss, "tokens_per_s": tok_s,
        "tokens_per_s_per_gpu": tok_s / par.size, "batch": cfg.batch, "seconds": elapsed,
    }  # fmt: skip
    if par.rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(result, f)
        save_figure(result, out, os.path.join(out, "loss_curve.png"))
        progress.say(
            f"done: {len(record['losses'])}/{cfg.steps} steps, train loss "
            f"{record['losses'][-1]:.4f}, validation loss {val_loss:.4f} nats/byte, "
            f"{tok_s / par.size:,.0f} tokens/s per {'GPU' if device == 'cuda' else 'process'} "
            f"({label(result)}); run folder {out}"
        )
    if par.size > 1:
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
