"""LaunchReplay's bookkeeping on CPU (the replay itself needs compiled CUDA kernels: its
end-to-end checks are the ``gpu`` tests of the ops that use it, e.g. test_grouped_mlp), and on
the GPU the replay of a launch that takes a tile counter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moekit.runtime import replay as _replay
from moekit.runtime.state import STATE


def _axpy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr, SCALE: tl.constexpr = 2):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * alpha * SCALE, mask=m)


_axpy_kernel = triton.jit(_axpy)


def test_full_args_follow_the_signature_with_defaults():
    # a JITFunction whatever TRITON_INTERPRET says (the interpreter's wrapper has no params)
    kernel = triton.runtime.jit.JITFunction(_axpy)
    got = _replay._full_args(kernel, ("x", "y", 10), {"alpha": 0.5, "BLOCK": 64})
    assert got == ["x", "y", 10, 0.5, 64, 2]
    got = _replay._full_args(kernel, ("x", "y", 10, 1.0), {"BLOCK": 8, "SCALE": 3})
    assert got == ["x", "y", 10, 1.0, 8, 3]
    with pytest.raises(KeyError):
        _replay._full_args(kernel, ("x", "y", 10, 1.0), {})


def test_compile_jobs_are_shared_between_modes():
    """A kernel one compile mode is still compiling (e.g. a backward's, started in the
    background by the forward) is waited for by the next mode, not compiled twice; it is
    finalised once, then forgotten; a failed job is forgotten too, so a later one retries."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    gate, compiled, finalized = threading.Event(), [], []

    def compile_fn():
        gate.wait(10)
        compiled.append(1)
        return "kernel"

    pool = ThreadPoolExecutor(2)
    first = _replay._SharedCompiles(pool)
    with first:
        job = first.submit("key", compile_fn, finalized.append)
    second = _replay._SharedCompiles(pool)
    with second:
        assert second.submit("key", compile_fn, finalized.append) is job
    assert "key" in STATE.compiles
    gate.set()
    second.finish()
    first.finish()
    assert compiled == [1] and finalized == ["kernel"]
    assert "key" not in STATE.compiles

    def broken():
        raise RuntimeError("no")

    third = _replay._SharedCompiles(pool)
    with third:
        bad = third.submit("bad", broken, finalized.append)
    third.finish()  # ignore_errors: the real launch reports it
    with pytest.raises(RuntimeError):
        bad.result()
    assert "bad" not in STATE.compiles and finalized == ["kernel"]


def test_not_ready_until_recorded_and_interpreter_launches_never_replay(interpret):
    if not interpret:
        pytest.skip("launches a kernel: needs TRITON_INTERPRET=1 on CPU")
    rep = _replay.LaunchReplay()
    x = torch.arange(100, dtype=torch.float32)
    y = torch.empty_like(x)
    for _ in range(3):
        assert not rep.run((x, y))  # nothing recorded: the caller launches itself
        with rep.recording((x, y)):
            _replay.launch(_axpy_kernel, (2,), x, y, 100, 0.5, BLOCK=64)
        torch.testing.assert_close(y, x)
    # the interpreter compiles nothing a C launcher could call: replay stays off, visibly
    assert rep.disabled and not rep.ready


def test_launch_records_only_inside_recording(interpret):
    if not interpret:
        pytest.skip("launches a kernel: needs TRITON_INTERPRET=1 on CPU")
    x = torch.ones(16)
    y = torch.empty_like(x)
    _replay.launch(_axpy_kernel, (1,), x, y, 16, 1.0, BLOCK=16)
    assert _replay._RECORD.get() is None
    torch.testing.assert_close(y, 2 * x)


class _Ptr:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


def test_issue_function_passes_fixed_arguments_and_swapped_pointers():
    seen = []

    def fake_launcher(*args):
        seen.append(args)

    consts = ("swiglu", 0.5, float("inf"), None, True, 7)
    calls = [
        # template: pointers as 0 at positions 0 and 2 (roles 2 and 0), the rest fixed (any type)
        _replay._Call(fake_launcher, (3, 1, 1), ("fn0", 0, 0, ("meta", 0)),
                      [0, consts[0], 0, *consts[1:]], ((0, 2, 0), (2, 0, 256)), None),
        _replay._Call(fake_launcher, (132, 2, 1), ("fn1", 1, 1, ("meta", 1)),
                      [5, 0], ((1, _replay.COUNTER_ROLE, 0),), (4096, 128)),
    ]  # fmt: skip
    issue = _replay._issue_function(calls)
    # role 1 is used by no launch: neither read nor checked (None, or misaligned, is fine)
    roles = [_Ptr(1 << 20), _Ptr(3), _Ptr(3 << 20)]
    assert issue(roles, 0xC0FFEE0, 77, 0xABC0)
    head0 = (3, 1, 1, 77, "fn0", 0, 0, None, None, ("meta", 0), None, None, None)
    assert seen[0] == (*head0, 3 << 20, "swiglu", (1 << 20) + 256, *consts[1:])
    head1 = (132, 2, 1, 77, "fn1", 1, 1, 0xABC0, None, ("meta", 1), None, None, None)
    assert seen[1] == (*head1, 5, 0xC0FFEE0)
    assert issue([_Ptr(8 << 20), None, _Ptr(9 << 20)], 16, 5, None)  # only the pointers change
    assert seen[2][13] == 9 << 20 and seen[2][15] == (8 << 20) + 256 and seen[3][-1] == 16
    # a used pointer misaligned, or a used role now absent: nothing launched, the op's normal
    # path runs instead
    assert not issue([_Ptr((8 << 20) + 8), None, _Ptr(9 << 20)], 16, 5, None)
    assert not issue([_Ptr(8 << 20), None, None], 16, 5, None)
    assert len(seen) == 4


@pytest.mark.gpu
def test_gpu_replay_of_a_dynamic_ragged_k_launch():
    """A replayed dynamically scheduled launch gets its stream's tile counter (eagerly) or a
    fresh zeroed one (under CUDA-graph capture); results stay right on fresh data."""
    from moekit.kernels import grouped_gemm as G
    from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref
    from moekit.tuning.grouped_gemm import RAGGED_K_CANDIDATES

    cfg = next(c for c in RAGGED_K_CANDIDATES if c.dynamic)
    counts = torch.tensor([0, 300, 5, 1200, 64])
    offsets = counts.cumsum(0).to(torch.int32).cuda()
    T, M, N = int(counts.sum()), 256, 384
    rep = _replay.LaunchReplay()

    def call():
        dy = torch.randn(T, M, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(T, N, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(len(counts), M, N, dtype=torch.bfloat16, device="cuda")
        roles = (dy, x, offsets, out)
        if not rep.run(roles):
            with rep.recording(roles):
                G.grouped_mm_ragged_k(dy.t(), x, offsets, out, False, config=cfg)
        return dy, x, out

    def check(dy, x, out):
        ref = grouped_mm_ragged_k_ref(dy.t().float(), x.float(), offsets, torch.float32)
        err = (out.double() - ref.double()).norm() / ref.double().norm()
        assert err < 2e-2

    for _ in range(4):  # normal, recording, then two replays
        check(*call())
    assert rep.ready and not rep.disabled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dy, x, out = call()  # replayed into the graph with a captured zeroed counter
    for _ in range(3):
        dy.copy_(torch.randn_like(dy))
        x.copy_(torch.randn_like(x))
        graph.replay()
        check(dy, x, out)
    check(*call())  # eager again after the graph
