"""A tiny Megatron-Core GPT-MoE (2 layers, 8 experts, top-2, the alltoall token dispatcher)
built with moekit's experts and with Megatron's ``SequentialMLP`` from the same weights, on the
GPU: logits, loss and every gradient equal within fp32 tolerance in fp32, and within the
bf16-vs-fp32 error in bf16; under Megatron's DistributedDataParallel the experts' gradients
land in ``main_grad``; a checkpoint round trip between the two backends."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

VOCAB, SEQ, BATCH = 128, 64, 4


@pytest.fixture(scope="module")
def mgpt():
    import megatron_gpt

    megatron_gpt.init_single_process()
    return megatron_gpt


def step(model, data):
    """(logits, mean loss, {name: grad}) of one forward and backward, with the experts'
    gradients keyed by expert (the state-dict layout of moekit's experts)."""
    from moekit.integrations.megatron import sequential_to_grouped

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


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst(got: tuple, want: tuple) -> float:
    """The largest relative L2 error over logits, loss and every gradient."""
    assert got[2].keys() == want[2].keys()
    errs = [rel(got[0], want[0]), rel(got[1], want[1])]
    errs += [rel(got[2][k], want[2][k]) for k in want[2]]
    return max(errs)


@pytest.fixture(scope="module")
def runs(mgpt):
    """The fp32 reference (SequentialMLP), and each backend's step in fp32 and bf16 from the
    reference's weights."""
    torch.manual_seed(0)
    ref = mgpt.build_gpt(mgpt.gpt_config("tiny", 2, torch.float32), "sequential", VOCAB, SEQ)
    state = {k: v for k, v in ref.state_dict().items()}
    data = mgpt.batch(ref.config, VOCAB, BATCH, SEQ)
    out = {("sequential", torch.float32): step(ref, data)}
    for backend in ("moekit", "sequential"):
        for dtype in (torch.float32, torch.bfloat16):
            if (backend, dtype) not in out:
                cfg = mgpt.gpt_config("tiny", 2, dtype)
                out[backend, dtype] = step(mgpt.build_gpt(cfg, backend, VOCAB, SEQ, state), data)
    return out


def test_fp32_matches_sequential(runs):
    assert worst(runs["moekit", torch.float32], runs["sequential", torch.float32]) < 5e-3


def test_bf16_within_the_bf16_error(runs):
    ref = runs["sequential", torch.float32]
    bf16_error = worst(runs["sequential", torch.bfloat16], ref)
    assert worst(runs["moekit", torch.bfloat16], ref) <= 1.5 * bf16_error + 1e-3


def test_ddp_main_grad(mgpt):
    """Megatron's DDP (fp32 main_grad buffers, its gradient hooks) around the moekit model: the
    experts' gradients in main_grad equal the same model's plain .grad run."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    cfg = mgpt.gpt_config("tiny", 2, torch.bfloat16)
    state = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ).state_dict()
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    _, _, plain = step(mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ, state), data)
    model = mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ, state)
    ddp = DistributedDataParallel(
        cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    ddp.zero_grad_buffer()
    ids, pos, mask, labels = data
    ddp(ids, pos, mask, labels=labels).float().mean().backward()
    ddp.finish_grad_sync()
    checked = 0
    for name, p in model.named_parameters():
        if name.endswith(("fc1_weight", "fc2_weight")):
            fc = "linear_fc1" if name.endswith("fc1_weight") else "linear_fc2"
            assert p.grad is None, name
            for i in range(p.shape[0]):
                key = name.rsplit(".", 1)[0] + f".{fc}.weight{i}"
                assert rel(p.main_grad[i], plain[key]) < 1e-2, key
                checked += 1
    assert checked == 2 * 2 * 8


def test_allgather_dispatcher_matches_sequential(mgpt):
    """Megatron's allgather dispatcher hands the experts tokens_per_expert on the device (the
    alltoall one's are on the host): fp32 step equal to SequentialMLP's."""
    cfg = mgpt.gpt_config("tiny", 2, torch.float32, dispatcher="allgather")
    ref = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ)
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    ours = mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ, ref.state_dict())
    assert worst(step(ours, data), step(ref, data)) < 5e-3


def test_checkpoint_round_trip(mgpt, tmp_path):
    """moekit → torch.save → SequentialMLP → moekit: the same weights and the same loss."""
    from moekit.integrations.megatron import grouped_to_sequential, sequential_to_grouped

    cfg = mgpt.gpt_config("tiny", 2, torch.float32)
    torch.manual_seed(1)
    ours = mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ)
    torch.save(ours.state_dict(), tmp_path / "moekit.pt")
    seq = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ)
    seq.load_state_dict(grouped_to_sequential(torch.load(tmp_path / "moekit.pt")))
    back = mgpt.build_gpt(cfg, "moekit", VOCAB, SEQ)
    back.load_state_dict(sequential_to_grouped(seq.state_dict()))
    for k, v in ours.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back.state_dict()[k], v), k
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    with torch.no_grad():
        a = ours(*data[:3], labels=data[3]).mean()
        b = seq(*data[:3], labels=data[3]).mean()
    assert rel(a, b) < 1e-4


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_fused_permute_and_router_match_sequential(mgpt, dispatcher):
    """moekit_fusions: Megatron's fused permute, unpermute, chunk sort and router run moekit's
    ops inside its own dispatcher and router (built inside the block); the fp32 step equals
    the unfused SequentialMLP model's."""
    from moekit.integrations.megatron import moekit_fusions

    cfg = mgpt.gpt_config("tiny", 2, torch.float32, dispatcher=dispatcher)
    ref = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ)
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    want = step(ref, data)
    fused_cfg = mgpt.gpt_config("tiny", 2, torch.float32, dispatcher=dispatcher)
    with moekit_fusions(fused_cfg):
        ours = mgpt.build_gpt(fused_cfg, "moekit", VOCAB, SEQ, ref.state_dict())
        got = step(ours, data)
    assert worst(got, want) < 5e-3
