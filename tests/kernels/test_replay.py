"""LaunchReplay's bookkeeping on CPU (the replay itself needs compiled CUDA kernels: its
end-to-end checks are the ``gpu`` tests of the ops that use it, e.g. test_grouped_mlp)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moekit.kernels import _replay


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
