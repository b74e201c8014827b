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
    """``megatron_gpt.train_step``: logits, loss and every gradient, experts' by expert."""
    import megatron_gpt

    return megatron_gpt.train_step(model, data)


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


def _trained(mgpt, backend: str, state: dict, data, distributed: bool) -> tuple:
    """(GPTModel, Megatron's optimizer: its distributed one or its mixed-precision one) of
    ``backend`` from ``state`` under DDP, after one Adam step on ``data``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = mgpt.gpt_config("tiny", 2, torch.bfloat16)
    model = mgpt.build_gpt(cfg, backend, VOCAB, SEQ, state)
    if not distributed:  # every parameter 16-bit, as Megatron-LM's Float16Module makes them:
        model.bfloat16()  # the mixed-precision optimizer's checkpoint maps only those
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                            use_distributed_optimizer=distributed)  # fmt: skip
    ddp = DistributedDataParallel(cfg, ddp_cfg, module=model)
    opt_cfg = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True,
                              use_distributed_optimizer=distributed)  # fmt: skip
    opt = get_megatron_optimizer(opt_cfg, [ddp])
    ddp.zero_grad_buffer()
    ddp(*data[:3], labels=data[3]).float().mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    return model, opt


OPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}  # the model-space format


def _sharded(model, opt, loading: bool = False) -> dict:
    sharded = {"model": model.sharded_state_dict()}
    sharded["optimizer"] = opt.sharded_state_dict(sharded["model"], is_loading=loading,
                                                  metadata=OPT_FORMAT)  # fmt: skip
    return sharded


def _built_state(model, opt) -> dict:
    """{(sharded key, offset): data} of the model and its optimizer state, factories built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = _sharded(model, opt)
    apply_factories(sharded)
    return {(sh.key, sh.global_offset): sh.data.float().cpu()
            for sh in nested_values(sharded) if isinstance(sh, ShardedTensor)}  # fmt: skip


def _save(model, opt, path) -> None:
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save(_sharded(model, opt), str(path))


def _has_expert_adam_state(state: dict) -> bool:
    return any(k[0].startswith("optimizer.") and "exp_avg" in k[0] and ".experts.experts." in k[0]
               for k in state)  # fmt: skip


def test_checkpoint_with_optimizer_across_backends(mgpt, tmp_path):
    """A distributed checkpoint (model + Megatron's mixed-precision optimizer, after a step)
    saved with moekit's experts loads into the SequentialMLP model and its optimizer, and that
    one's back into moekit's: every sharded tensor, weights and Adam states, comes back equal."""
    from megatron.core import dist_checkpointing

    cfg = mgpt.gpt_config("tiny", 2, torch.bfloat16)
    state = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ).state_dict()
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    ours = _trained(mgpt, "moekit", state, data, distributed=False)
    _save(*ours, tmp_path / "moekit")
    saved = _built_state(*ours)
    assert _has_expert_adam_state(saved)
    loaded = []
    for backend, src in (("sequential", "moekit"), ("moekit", "sequential")):
        model, opt = _trained(mgpt, backend, state, data, distributed=False)
        restored = dist_checkpointing.load(_sharded(model, opt, loading=True), str(tmp_path / src))
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optimizer"])
        if backend == "sequential":
            _save(model, opt, tmp_path / "sequential")
        loaded.append(_built_state(model, opt))
    for got in loaded:
        assert got.keys() == saved.keys()
        for k, v in saved.items():
            assert torch.equal(got[k], v), k


def test_distributed_optimizer_checkpoint_in_sequentials_layout(mgpt, tmp_path):
    """Megatron's distributed optimizer, fully reshardable format: moekit's checkpoint holds
    the tensors SequentialMLP's holds (names and global shapes, Adam states of every expert),
    with moekit's own values. (Loading that format back fails in megatron-core 0.19.2
    without Apex or TransformerEngine whatever the experts: its load wants a 'step' tensor
    the format does not save.)"""
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    cfg = mgpt.gpt_config("tiny", 2, torch.bfloat16)
    state = mgpt.build_gpt(cfg, "sequential", VOCAB, SEQ).state_dict()
    data = mgpt.batch(cfg, VOCAB, BATCH, SEQ)
    plain = {}
    for backend in ("moekit", "sequential"):
        model, opt = _trained(mgpt, backend, state, data, distributed=True)
        _save(model, opt, tmp_path / backend)
        plain[backend] = load_plain_tensors(str(tmp_path / backend))
        if backend == "moekit":
            built = _built_state(model, opt)
    shapes = {b: {k: tuple(v.shape) for k, v in p.items() if isinstance(v, torch.Tensor)}
              for b, p in plain.items()}  # fmt: skip
    assert shapes["moekit"] == shapes["sequential"]
    assert _has_expert_adam_state(built)
    for (key, offset), value in built.items():
        lead = len(offset) - value.dim()  # the layer and expert axes: one index each
        region = (*offset[:lead], *(slice(o, o + n) for o, n in zip(offset[lead:], value.shape)))
        assert torch.equal(plain["moekit"][key].float().cpu()[region], value), key
