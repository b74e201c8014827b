"""The symmetric-memory all-reduce kernel on one GPU: two ranks simulated by two streams.

Each "rank" owns a zeroed buffer on the same GPU (what a new SymmetricPool gives), ``peer_bases``
holds both addresses, and the two ranks' launches run concurrently on two streams, so the
barriers, the Lamport slots and the launch epochs work exactly as across GPUs (minus NVLink).
Every launch goes through ``moekit.runtime.replay.replayed``: the first call of a key launches
normally, the second records, the third replays. This runs on a single-GPU machine, where the
torchrun check (``gpu_allreduce_check.py``) cannot.
"""

from __future__ import annotations

import pytest
import torch

W = 2
SLOT = 1 << 20


def _case_inputs(T, H, dtype, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    shards = [torch.randn(T, H, device=device, generator=g).to(dtype) for _ in range(W)]
    for s in shards:  # zeros of both signs (+0.0 is the empty Lamport sentinel)
        s[0, ::3] = 0.0
        s[-1, 1::3] = -0.0
    residual = torch.randn(T, H, device=device, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(H, device=device, generator=g)).to(dtype)
    return shards, residual, weight


def _launch_ranks(kar, replayed, tensor_key, ranks, space, cfg, algo, streams):
    """Launch every rank's call on its own stream, nothing else in between (no allocation, no
    compilation: either may wait for the GPU, where the first rank's kernel waits for the
    second)."""
    for r, (x, residual, weight, ro, y, rstd, peer_bases, epochs) in enumerate(ranks):
        with torch.cuda.stream(streams[r]):
            roles = (x, residual, weight, ro, y, rstd, peer_bases, epochs)
            key = ("test_two_streams", algo, r, cfg, *map(tensor_key, roles))

            def body(r=r, roles=roles):
                kar.fused_allreduce(*roles, 1e-6, rank=r, algo=algo, space=space, config=cfg)

            replayed(key, roles, body)


@pytest.mark.gpu
def test_two_ranks_on_two_streams(monkeypatch):
    from moekit.kernels import allreduce as kar
    from moekit.reference.allreduce import allreduce_add_rmsnorm_shards_ref
    from moekit.runtime.replay import replayed, tensor_key
    from moekit.tuning.allreduce import allreduce_config

    device = torch.device("cuda", torch.cuda.current_device())
    nbytes = kar.SIGNAL_BYTES + (8 << 20) + 2 * W * SLOT
    space = kar.workspace(nbytes, W, SLOT)
    bufs = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(W)]
    peer_bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=device)
    epochs = [torch.zeros(kar.CTL_WORDS, dtype=torch.int32, device=device) for _ in range(W)]
    streams = [torch.cuda.Stream() for _ in range(W)]
    cases = [
        ("one_shot", 7, 4096, torch.bfloat16),
        ("two_shot", 33, 2048, torch.float16),
        ("lamport", 5, 7168, torch.bfloat16),
        ("lamport_two_shot", 64, 4096, torch.bfloat16),
        ("one_shot", 3, 1024, torch.float32),
        ("two_shot", 9, 512, torch.float32),
    ]
    launches = 0
    for i, (algo, T, H, dtype) in enumerate(cases):
        # both ranks' programs must be resident at once: a small grid each
        cfg = allreduce_config(algo, T, H, W, 16)
        for rep in range(3):  # normal launch, recorded launch, replayed launch
            shards, residual, weight = _case_inputs(T, H, dtype, 100 * i + rep, device)
            ranks = []
            for r in range(W):
                x, rstd = shards[r], torch.empty(T, dtype=torch.float32, device=device)
                outs = (torch.empty_like(x), torch.empty_like(x), rstd)
                ranks.append((x, residual, weight, *outs, peer_bases, epochs[r]))
            if rep == 0:  # compile and load the kernels first, launching nothing
                with monkeypatch.context() as m:
                    m.setattr(kar, "launch", lambda k, g, *a, **kw: k.warmup(*a, grid=g, **kw).run)
                    _launch_ranks(kar, replayed, tensor_key, ranks, space, cfg, algo, streams)
            torch.cuda.synchronize()
            _launch_ranks(kar, replayed, tensor_key, ranks, space, cfg, algo, streams)
            torch.cuda.synchronize()
            launches += 1
            ref_y, ref_ro = allreduce_add_rmsnorm_shards_ref(shards, residual, weight, 1e-6)
            tag = f"{algo} T={T} H={H} {dtype} call {rep}"
            for _, _, _, ro, y, _, _, _ in ranks:
                assert torch.equal(ro, ref_ro), tag
                torch.testing.assert_close(y, ref_y, atol=6e-2, rtol=1.6e-2, msg=tag)
            assert torch.equal(ranks[0][4], ranks[1][4]), tag
    for r in range(W):
        assert epochs[r].tolist() == [launches, 0]
        region = bufs[r][space.lamport_offset :]
        assert int((region != 0).sum()) == 0, "Lamport slots not returned to the sentinel"
