"""``experts_implementation="moekit"`` under transformers' expert parallelism (2 gloo ranks,
CPU): a tiny Qwen3-MoE loaded with ``DistributedConfig(tp_size=2, ep_size=2)`` holds half the
experts per rank. Its logits, loss and every local gradient equal those of transformers'
``grouped_mm`` experts under the same plan, and the logits, loss and local expert gradients
equal those of the single-process model, for both token dispatches: ``all_to_all`` (each rank's
experts get the tokens sent to them, local ids, top-1, unit weights) and ``all_reduce`` (each
rank's experts get the whole batch, the slots of the other rank's experts as sentinel ids with
zero weights, which moekit drops)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests._multiproc import finish_worker

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("moekit.integrations.transformers")

WORLD, E, LAYERS, VOCAB = 2, 4, 2, 97
CONFIG = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
    tie_word_embeddings=False, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=16,
    norm_topk_prob=True, initializer_range=0.2,
)  # fmt: skip
DISPATCHES = ("all_to_all", "all_reduce")
SKIP = "moekit-test-skip: "  # a worker's error starting with it skips the test


def _missing_ep() -> str | None:
    """Why this transformers cannot run the test's expert parallelism, or None."""
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.expert_parallel import EPImplementationInterface
    except ImportError as exc:
        return f"this transformers has no expert parallelism over DistributedConfig ({exc})"
    if "ep_size" not in {f.name for f in dataclasses.fields(DistributedConfig)}:
        return "this transformers' DistributedConfig has no ep_size"
    if missing := set(DISPATCHES) - set(EPImplementationInterface()):
        return f"this transformers has no EP implementations {sorted(missing)}"
    moe = importlib.import_module("transformers.integrations.moe")
    if "grouped_mm" not in moe.ALL_EXPERTS_FUNCTIONS:
        return "this transformers has no grouped_mm experts"
    return None


def _allow_cpu_device_map() -> None:
    """from_pretrained turns a distributed_config into device_map {"": cpu} on a CPU host, and
    its device-map check then asks for accelerate, which nothing on this path uses."""
    acc = importlib.import_module("transformers.integrations.accelerate")
    if not getattr(acc, "is_accelerate_available", lambda: True)():
        acc.is_accelerate_available = lambda: True


def _step(model, ids):
    """Logits, loss and each parameter's (local) gradient of one forward and backward."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads[name] = g.detach().clone()
    return out.logits.detach(), out.loss.detach(), grads


def _worker(rank: int, port: int, path: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        from transformers.distributed import DistributedConfig

        try:  # the all_to_all dispatch exchanges split sizes and tokens with it
            dist.all_to_all_single(torch.empty(WORLD), torch.zeros(WORLD))
        except RuntimeError as exc:
            raise RuntimeError(f"{SKIP}gloo has no all_to_all_single ({exc})") from exc
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
        _allow_cpu_device_map()
        load = transformers.AutoModelForCausalLM.from_pretrained
        ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
        want = _step(load(path, experts_implementation="eager", dtype=torch.float32), ids)
        El = E // WORLD
        experts = slice(rank * El, (rank + 1) * El)
        tol = dict(rtol=1e-4, atol=1e-5)
        calls, run = [], hf.grouped_mlp  # (rows, rows kept) of each moekit grouped_mlp call

        def recorded(x, offsets, *args, **kwargs):
            calls.append((x.shape[0], int(offsets[-1])))
            return run(x, offsets, *args, **kwargs)

        hf.grouped_mlp = recorded
        for dispatch in DISPATCHES:
            got = {}
            for impl in ("grouped_mm", "moekit"):
                config = DistributedConfig(tp_size=WORLD, ep_size=WORLD, ep_implementation=dispatch)
                model = load(
                    path, experts_implementation=impl, dtype=torch.float32,
                    distributed_config=config,
                )  # fmt: skip
                assert model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0] == El
                calls.clear()
                got[impl] = _step(model, ids)
                assert len(calls) == (LAYERS if impl == "moekit" else 0), (dispatch, impl)
            # all_to_all hands the experts only the slots routed to them, all_reduce every slot
            # of the batch, and moekit drops the other rank's
            slots = ids.numel() * CONFIG["num_experts_per_tok"]
            for rows, kept in calls:
                if dispatch == "all_reduce":
                    assert rows == slots and 0 < kept < rows, (dispatch, calls)
                else:
                    assert 0 < kept == rows < slots, (dispatch, calls)
            (logits, loss, grads), ref = got["moekit"], got["grouped_mm"]
            torch.testing.assert_close(logits, ref[0], **tol, msg=dispatch)
            torch.testing.assert_close(loss, ref[1], **tol, msg=dispatch)
            assert grads.keys() == ref[2].keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref[2][name], **tol, msg=f"{dispatch} {name}")
            # and the single-process model: the local experts' gradients are its experts' slice
            torch.testing.assert_close(logits, want[0], **tol, msg=dispatch)
            torch.testing.assert_close(loss, want[1], **tol, msg=dispatch)
            for name, g in grads.items():
                if ".mlp.experts." in name:
                    torch.testing.assert_close(g, want[2][name][experts], **tol, msg=name)
        finish_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_expert_parallel_matches_grouped_mm_and_the_single_process_model(tmp_path):
    if reason := _missing_ep():
        pytest.skip(reason)
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("qwen3_moe", **CONFIG)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(
        tmp_path
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    except mp.ProcessRaisedException as exc:
        if SKIP in str(exc):
            pytest.skip(str(exc).split(SKIP, 1)[1].splitlines()[0])
        raise
