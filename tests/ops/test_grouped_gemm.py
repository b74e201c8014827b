"""grouped_mm vs the pure-PyTorch reference.

CPU tests run the Triton kernels in the interpreter under ``make test`` (TRITON_INTERPRET=1), in
fp16/fp32 (the interpreter's bf16 dot is wrong). GPU tests (``-m gpu``) use bf16 at real shapes
and bound the kernel's error by torch's own bf16 error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moekit.ops import grouped_mm
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref


def offsets_from_counts(counts, device="cpu") -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def random_counts(T: int, E: int) -> list[int]:
    cuts = sorted(torch.randint(0, T + 1, (E - 1,)).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, T])]


def assert_close(out, ref, dtype):
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    err = (out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)
    assert err < tol, f"relative error {err:.2e} >= {tol}"


# Each case: (name, T, counts) — why it exists is in the name.
RAGGED_CASES = [
    ("random", 57, None),
    ("zero_count_experts", 40, [0, 17, 0, 23, 0]),
    ("all_rows_one_expert", 37, [0, 0, 37, 0, 0]),
    ("offsets_end_below_T", 50, [5, 9, 0, 11, 3]),  # rows 28.. belong to no expert → zero
    ("single_row", 1, [0, 1, 0, 0, 0]),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", RAGGED_CASES, ids=[c[0] for c in RAGGED_CASES])
def test_ragged_m_matches_reference(case, dtype):
    _, T, counts = case
    E, K, N = 5, 24, 40  # K, N: multiples of 8 but not of the block
    counts = counts or random_counts(T, E)
    offsets = offsets_from_counts(counts)
    a = torch.randn(T, K, dtype=dtype)
    b = torch.randn(E, K, N, dtype=dtype)
    out = grouped_mm(a, b, offsets)
    assert out.shape == (T, N) and out.dtype == dtype
    assert_close(out, grouped_mm_ragged_m_ref(a, b, offsets, torch.float32), dtype)
    end = sum(counts)
    assert torch.all(out[end:] == 0)


def test_ragged_m_transposed_weight_view_and_bias():
    # b = weight.transpose(-2, -1) of an nn.Linear-style [E, N, K] weight, read without a copy.
    T, E, K, N = 45, 4, 32, 48
    offsets = offsets_from_counts(random_counts(T, E))
    a = torch.randn(T, K, dtype=torch.float16)
    weight = torch.randn(E, N, K, dtype=torch.float16)
    bias = torch.randn(E, N, dtype=torch.float16)
    out = grouped_mm(a, weight.transpose(-2, -1), offsets, bias=bias)
    ref = grouped_mm_ragged_m_ref(a, weight.transpose(-2, -1), offsets, torch.float32, bias)
    assert_close(out, ref, torch.float16)


def test_ragged_m_non_contiguous_inputs_and_fp32_out():
    T, E, K, N = 33, 3, 16, 24
    offsets = offsets_from_counts(random_counts(T, E))
    wide = torch.randn(T, K + 8, dtype=torch.float16)
    a = wide[:, :K]  # strided rows, 16-byte aligned: read in place
    b = torch.randn(E, 2 * K, N, dtype=torch.float16)[:, ::2]  # no unit-stride dim pair: copied
    out = grouped_mm(a, b, offsets, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, grouped_mm_ragged_m_ref(a, b, offsets, torch.float32), torch.float16)


def test_ragged_m_single_expert_and_empty():
    a = torch.randn(20, 16, dtype=torch.float16)
    b = torch.randn(1, 16, 8, dtype=torch.float16)
    offsets = torch.tensor([20], dtype=torch.int64)  # E = 1, int64 offsets
    assert_close(grouped_mm(a, b, offsets), a.float() @ b[0].float(), torch.float16)
    empty = grouped_mm(a[:0], b, torch.tensor([0], dtype=torch.int32))  # T = 0
    assert empty.shape == (0, 8)


def test_ragged_m_out_argument():
    T, E, K, N = 30, 3, 16, 16
    offsets = offsets_from_counts([10, 0, 15])
    a, b = torch.randn(T, K, dtype=torch.float16), torch.randn(E, K, N, dtype=torch.float16)
    out = torch.full(
        (T, N), float("nan"), dtype=torch.float16
    )  # poisoned: every row must be written
    res = grouped_mm(a, b, offsets, out=out)
    assert res is out
    assert_close(out, grouped_mm_ragged_m_ref(a, b, offsets, torch.float32), torch.float16)


K_CASES = [
    ("random", 45, None),
    ("zero_count_experts", 40, [0, 17, 0, 23, 0]),
    ("all_columns_one_expert", 29, [0, 29, 0, 0, 0]),
    ("offsets_end_below_T", 40, [3, 9, 0, 11, 2]),
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", K_CASES, ids=[c[0] for c in K_CASES])
def test_ragged_k_matches_reference(case, out_dtype):
    _, T, counts = case
    E, M, N = 5, 24, 40
    counts = counts or random_counts(T, E)
    offsets = offsets_from_counts(counts)
    dy = torch.randn(T, M, dtype=torch.float16)
    x = torch.randn(T, N, dtype=torch.float16)
    out = grouped_mm(dy.t(), x, offsets, out_dtype=out_dtype)  # a is a transposed view
    assert out.shape == (E, M, N) and out.dtype == out_dtype
    ref = grouped_mm_ragged_k_ref(dy.t(), x, offsets, torch.float32)
    assert_close(out, ref, torch.float16)
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.all(out[e] == 0), "an expert with no columns must give exact zeros"


def test_ragged_k_row_major_operands_and_fp32_inputs():
    T, E, M, N = 36, 3, 8, 12  # fp32: 16-byte alignment is 4 elements
    offsets = offsets_from_counts(random_counts(T, E))
    a = torch.randn(M, T)
    b = torch.randn(N, T).t()  # b's unit stride along T
    out = grouped_mm(a, b, offsets)
    assert_close(out, grouped_mm_ragged_k_ref(a, b, offsets, torch.float32), torch.float32)


def test_ragged_k_accumulate_into_main_grad():
    T, E, M, N = 40, 4, 16, 24
    counts = [12, 0, 20, 8]
    offsets = offsets_from_counts(counts)
    dy, x = torch.randn(T, M, dtype=torch.float16), torch.randn(T, N, dtype=torch.float16)
    main_grad = torch.randn(E, M, N)
    before = main_grad.clone()
    res = grouped_mm(dy.t(), x, offsets, out=main_grad, accumulate=True)
    assert res is main_grad
    ref = before + grouped_mm_ragged_k_ref(dy.t(), x, offsets, torch.float32)
    assert_close(main_grad, ref, torch.float16)
    assert torch.equal(main_grad[1], before[1]), "an empty expert must leave main_grad untouched"


def test_ragged_k_empty_T():
    a, b = torch.randn(8, 0, dtype=torch.float16), torch.randn(0, 8, dtype=torch.float16)
    offsets = torch.zeros(3, dtype=torch.int32)
    assert torch.equal(grouped_mm(a, b, offsets), torch.zeros(3, 8, 8, dtype=torch.float16))


def test_ragged_m_gradients_match_reference():
    T, E, K, N = 37, 4, 16, 24
    offsets = offsets_from_counts([9, 0, 20, 5])  # includes an empty expert and tail rows
    a = torch.randn(T, K, requires_grad=True)
    w = torch.randn(E, N, K, requires_grad=True)
    bias = torch.randn(E, N, requires_grad=True)
    grad = torch.randn(T, N)
    grouped_mm(a, w.transpose(1, 2), offsets, bias=bias).backward(grad)
    got = (a.grad, w.grad, bias.grad)
    a2, w2, b2 = (t.detach().clone().requires_grad_() for t in (a, w, bias))
    grouped_mm_ragged_m_ref(a2, w2.transpose(1, 2), offsets, torch.float32, b2).backward(grad)
    for g, r in zip(got, (a2.grad, w2.grad, b2.grad)):
        assert_close(g, r, torch.float32)


def test_ragged_k_gradients_match_reference():
    T, E, M, N = 30, 3, 8, 12
    offsets = offsets_from_counts([10, 0, 14])
    a, b = torch.randn(M, T, requires_grad=True), torch.randn(T, N, requires_grad=True)
    grad = torch.randn(E, M, N)
    grouped_mm(a, b, offsets).backward(grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    grouped_mm_ragged_k_ref(a2, b2, offsets, torch.float32).backward(grad)
    assert_close(a.grad, a2.grad, torch.float32)
    assert_close(b.grad, b2.grad, torch.float32)


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def _ok_inputs():
    return torch.randn(16, 8, dtype=torch.float16), torch.randn(2, 8, 8, dtype=torch.float16)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a, b, o: (a.int(), b, o), TypeError, "a must have dtype"),
        (lambda a, b, o: (a, b.float(), o), TypeError, "b must have a's dtype"),
        (lambda a, b, o: (a, b, o.float()), TypeError, "offsets must have dtype"),
        (lambda a, b, o: (a, b[:, :4], o), ValueError, r"b.shape\[1\] must equal"),
        (lambda a, b, o: (a, b, o[:1]), ValueError, r"offsets has 1 entries .* \(b.shape\[0\]\)"),
        (lambda a, b, o: (a, b, o.to("meta")), ValueError, "offsets must be on a's device"),
        (lambda a, b, o: (a[:, :6], b[:, :6], o), ValueError, "multiple of 8"),
        (lambda a, b, o: (a, b[..., :6], o), ValueError, "N .* must be a multiple of 8"),
        (lambda a, b, o: (a, b[0, 0], o), ValueError, r"b has shape \(8,\): grouped_mm takes"),
        (lambda a, b, o: (a[0, 0], b, o), ValueError, r"a has shape \(\): .* a \[T, K\]"),
        (lambda a, b, o: (a, b[0, 0, 0], o), ValueError, r"b has shape \(\): .* b \[E, K, N\]"),
        (lambda a, b, o: (a, b, o[0]), ValueError, r"offsets must be 1-D \[E\]"),
        (lambda a, b, o: (a, b, o.view(1, 2)), ValueError, "offsets must be 1-D"),
    ],
)
def test_bad_input_raises_clear_error(mutate, exc, match):
    a, b = _ok_inputs()
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    a, b, offsets = mutate(a, b, offsets)
    with pytest.raises(exc, match=match):
        grouped_mm(a, b, offsets)


# Offsets out of order or past the rows: CPU tensors (the interpreter's included) are checked
# on the host on every call; the GPU branch (torch._assert_async) only under validate=True or
# MOEKIT_DEBUG=1.
_BAD_OFFSETS = [
    ([9, 4, 16], r"offsets must be non-decreasing .*offsets\[1\] = 4 < offsets\[0\] = 9"),
    ([3, 9, 8], r"offsets must be non-decreasing .*offsets\[2\] = 8 < offsets\[1\] = 9"),
    ([-1, 4, 16], r"offsets must be non-decreasing .*offsets\[0\] = -1 < 0"),
    ([9, 12, 17], r"offsets\[-1\] = 17 exceeds a\.shape\[0\] \(T\) = 16"),
]


def _ragged_m_case(offsets):
    a, b = torch.randn(16, 8), torch.randn(3, 8, 8)
    return a, b, torch.tensor(offsets, dtype=torch.int32)


@pytest.mark.parametrize("validate", [False, True])
@pytest.mark.parametrize("offsets, match", _BAD_OFFSETS)
def test_bad_offsets_raise_on_cpu(offsets, match, validate):
    a, b, off = _ragged_m_case(offsets)
    with pytest.raises(ValueError, match=match):
        grouped_mm(a, b, off, validate=validate)


def test_bad_offsets_raise_on_cpu_ragged_k():
    a, b = torch.randn(8, 16), torch.randn(16, 8)  # [M, T] x [T, N]
    with pytest.raises(ValueError, match=r"offsets\[1\] = 4 < offsets\[0\] = 9"):
        grouped_mm(a, b, torch.tensor([9, 4, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 17 exceeds a\.shape\[1\] \(T"):
        grouped_mm(a, b, torch.tensor([9, 17], dtype=torch.int32))
    # ending short is a padding tail: those columns belong to no expert
    out = grouped_mm(a, b, torch.tensor([5, 12], dtype=torch.int32))
    torch.testing.assert_close(out[1], a[:, 5:12] @ b[5:12], rtol=1e-4, atol=1e-4)


def _device_side_checks(monkeypatch):
    """Make the checks take their GPU branch (torch._assert_async) on CPU tensors, where a
    failed assert raises RuntimeError at once."""
    import moekit.ops.validation as validation

    monkeypatch.setattr(validation, "values_on_host", lambda t: False)


@pytest.mark.parametrize("offsets", [o for o, _ in _BAD_OFFSETS])
def test_bad_offsets_device_side_check(offsets, monkeypatch):
    _device_side_checks(monkeypatch)
    a, b, off = _ragged_m_case(offsets)
    match = r"offsets must be non-decreasing .* ending at most at a\.shape\[0\] \(T\) = 16"
    with pytest.raises(RuntimeError, match=match):
        grouped_mm(a, b, off, validate=True)
    monkeypatch.setenv("MOEKIT_DEBUG", "1")  # every call validates
    with pytest.raises(RuntimeError, match=match):
        grouped_mm(a, b, off)
    with pytest.raises(RuntimeError, match=r"ending at most at a\.shape\[1\] \(T"):
        grouped_mm(a.t().contiguous(), a, off)  # ragged K: [8, 16] x [16, 8]
    a, b, good = _ragged_m_case([4, 4, 12])
    grouped_mm(a, b, good, validate=True)


def test_offsets_device_side_check_reads_nothing_on_the_host(monkeypatch):
    from moekit.ops.validation import check_offsets_values

    _device_side_checks(monkeypatch)
    bad = torch.tensor([9, 4, 17], dtype=torch.int32)
    for attr in ("__bool__", "item", "tolist"):  # the host reads that would sync a GPU
        monkeypatch.setattr(torch.Tensor, attr, lambda *a, **k: pytest.fail("host read"))
    check_offsets_values(bad, 16, device_check=False)  # the hot path: nothing at all
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        check_offsets_values(bad, 16, device_check=True)


_GPU_BAD_OFFSETS_SCRIPT = """
import torch
from moekit.ops import grouped_mm
a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4, 128, 128, device="cuda", dtype=torch.bfloat16)
offsets = torch.tensor({offsets}, device="cuda", dtype=torch.int32)
grouped_mm(a, b, torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32))  # warm-up
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    grouped_mm(a, b, offsets, validate={validate})  # must not sync
finally:
    torch.cuda.set_sync_debug_mode(0)
print("launched", flush=True)
torch.cuda.synchronize()
print("not detected", flush=True)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [[16, 8, 32, 64], [16, 32, 48, 65]])
@pytest.mark.parametrize("how", ["validate", "MOEKIT_DEBUG"])
def test_gpu_bad_offsets_detected_on_the_device_without_sync(offsets, how):
    # A device-side assert poisons the CUDA context: each case runs in its own process. The
    # assert surfaces at the final synchronize (or at a later launch); a host sync inside
    # grouped_mm, or a clean exit, is a failure.
    script = _GPU_BAD_OFFSETS_SCRIPT.format(offsets=offsets, validate=how == "validate")
    env = dict(os.environ, MOEKIT_DEBUG="1" if how == "MOEKIT_DEBUG" else "0")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
        cwd=root, env=env, timeout=300,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "called a synchronizing CUDA operation" not in output, output
    assert "launched" in output and "not detected" not in output, output
    assert "offsets must be non-decreasing" in output or "device-side assert" in output, output


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["validate", "MOEKIT_DEBUG"])
def test_gpu_checked_call_of_good_offsets_has_no_sync(how, monkeypatch):
    monkeypatch.setenv("MOEKIT_DEBUG", "1" if how == "MOEKIT_DEBUG" else "0")
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 128, 128, device="cuda", dtype=torch.bfloat16)
    offsets = torch.tensor([16, 16, 40, 60], device="cuda", dtype=torch.int32)  # a tail
    want = grouped_mm_ragged_m_ref(a, b, offsets, torch.bfloat16)
    grouped_mm(a, b, offsets), grouped_mm(a.t(), a, offsets)  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grouped_mm(a, b, offsets, validate=how == "validate")
        got_k = grouped_mm(a.t(), a, offsets, validate=how == "validate")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert_close(got, want, torch.bfloat16)
    assert_close(got_k, grouped_mm_ragged_k_ref(a.t(), a, offsets, torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize(
    "a_shape, b_shape, offsets, match",
    [
        # one weight shared by all rows ([T, K] @ [K, N]) taken for the ragged-K form
        ((32, 8), (16, 8), [16, 32], r"b\.shape\[0\] must equal a\.shape\[1\]"),
        ((32, 8), (8, 16), [16, 32], r"offsets\[-1\] = 32 exceeds a\.shape\[1\]"),
    ],
)
def test_ragged_k_errors_name_the_form_taken(a_shape, b_shape, offsets, match):
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    with pytest.raises(ValueError, match=match) as info:
        grouped_mm(a, b, torch.tensor(offsets, dtype=torch.int32))
    msg = str(info.value)
    assert "grouped_mm took the ragged-K form (chosen because b is 2-D)" in msg
    assert "a [M, T] @ b [T, N] -> [E, M, N]" in msg and "pass b as [E, K, N]" in msg
    assert f"got a {a_shape} and b {b_shape}" in msg


def test_ragged_m_errors_name_the_form_taken():
    a, b = torch.randn(16, 8), torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"b\.shape\[1\] must equal a\.shape\[1\]") as info:
        grouped_mm(a, b, torch.tensor([8, 16], dtype=torch.int32))
    msg = str(info.value)
    assert "grouped_mm took the ragged-M form (chosen because b is 3-D)" in msg
    assert "a [T, K] @ b [E, K, N] -> [T, N]" in msg


def test_argument_combinations_rejected():
    a, b = _ok_inputs()
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        grouped_mm(a.t(), a, offsets, accumulate=True)
    with pytest.raises(ValueError, match="ragged-K form"):
        grouped_mm(a, b, offsets, out=torch.empty(16, 8, dtype=torch.float16), accumulate=True)
    with pytest.raises(ValueError, match="bias is supported for the ragged-M"):
        grouped_mm(a.t(), a, offsets, bias=torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        grouped_mm(a, b, offsets, out=torch.empty(15, 8, dtype=torch.float16))
    with pytest.raises(TypeError, match="out_dtype"):
        grouped_mm(a, b, offsets, out_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor"):
        grouped_mm(a, b, offsets, out=3)
    with pytest.raises(TypeError, match="validate must be a bool"):
        grouped_mm(a, b, offsets, validate="no")
    with pytest.raises(TypeError, match="accumulate must be a bool"):
        grouped_mm(a.t(), a, offsets, out=torch.zeros(2, 8, 8), accumulate=1)
    grouped_mm(a, b, offsets)  # a cached plan must not skip the checks of later calls
    with pytest.raises(ValueError, match="accumulate=True needs out="):
        grouped_mm(a, b, offsets, accumulate=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ragged_m_out_at_a_misaligned_address(device):
    """A contiguous out that starts 4 bytes past a 16-byte boundary (the kernel's TMA store
    needs an aligned base): written correctly, not a crash."""
    T, E, K, N = 40, 3, 32, 16
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    offsets = offsets_from_counts([10, 0, 25], device)
    a = torch.randn(T, K, device=device).to(dtype)
    b = torch.randn(E, K, N, device=device).to(dtype)
    buf = torch.full((T * N + 2,), float("nan"), device=device, dtype=dtype)
    out = buf[2:].view(T, N)
    assert out.data_ptr() % 16 != 0
    assert grouped_mm(a, b, offsets, out=out) is out
    torch.testing.assert_close(out, grouped_mm(a, b, offsets))


# --------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes, no host sync, CUDA graphs
# --------------------------------------------------------------------------------------------


def _skewed_counts(T, E, gen):
    share = torch.distributions.Gamma(0.5, 1.0).sample((E,))
    share[0] = 0.0  # an idle expert
    counts = torch.floor(share / share.sum() * T).long()
    counts[int(torch.argmax(counts))] += T - int(counts.sum())
    return counts.tolist()


def _torch_bf16_ragged_m(a, b, counts):
    out, s = torch.zeros(a.shape[0], b.shape[2], device=a.device, dtype=a.dtype), 0
    for e, c in enumerate(counts):
        out[s : s + c] = a[s : s + c] @ b[e]
        s += c
    return out


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T,E,K,N", [(8192, 16, 2048, 1536), (4096, 128, 2880, 2880), (3000, 8, 1024, 4096)]
)
def test_gpu_ragged_m_bf16_error_bounded_by_torch(T, E, K, N):
    counts = _skewed_counts(T, E, None)
    offsets = offsets_from_counts(counts, "cuda")
    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    ref = grouped_mm_ragged_m_ref(a, w.transpose(1, 2), offsets, torch.float32)
    err_torch = _rel(_torch_bf16_ragged_m(a, w.transpose(1, 2), counts), ref)
    for b in (w.transpose(1, 2), w.transpose(1, 2).contiguous()):
        out = grouped_mm(a, b, offsets)
        assert _rel(out, ref) <= 2 * err_torch + 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_ragged_k_bf16(out_dtype):
    T, E, M, N = 8192, 16, 1536, 2048
    counts = _skewed_counts(T, E, None)
    offsets = offsets_from_counts(counts, "cuda")
    dy = torch.randn(T, M, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    ref = grouped_mm_ragged_k_ref(dy.t(), x, offsets, torch.float32)
    out = grouped_mm(dy.t(), x, offsets, out_dtype=out_dtype)
    torch_out = torch.stack(
        [
            dy.t()[:, s : s + c] @ x[s : s + c]
            for s, c in zip([0, *torch.tensor(counts).cumsum(0).tolist()], counts)
        ]
    )
    assert _rel(out, ref) <= 2 * _rel(torch_out, ref) + 1e-5
    assert torch.all(out[0] == 0)
    main_grad = torch.randn(E, M, N, device="cuda")
    before = main_grad.clone()
    grouped_mm(dy.t(), x, offsets, out=main_grad, accumulate=True)
    assert _rel(main_grad, before + ref) < 1e-3
    assert torch.equal(main_grad[0], before[0])


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph_replay():
    from moekit.nn import GroupedLinear

    T, E, K, N = 4096, 8, 1024, 512
    layer = GroupedLinear(E, K, N, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offsets = offsets_from_counts(_skewed_counts(T, E, None), "cuda")
    for _ in range(2):  # warm-up: compile and autotune outside the checked region
        layer(x, offsets).sum().backward()
        grouped_mm(x.detach().t(), x.detach(), offsets, out_dtype=torch.float32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, offsets)
        y.backward(torch.ones_like(y))
        grouped_mm(x.detach().t(), x.detach(), offsets, out_dtype=torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    static_offsets = offsets.clone()
    a = x.detach()
    w = layer.weight.detach()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        grouped_mm(a, w.transpose(1, 2), static_offsets)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static_out = grouped_mm(a, w.transpose(1, 2), static_offsets)
        static_wg = grouped_mm(a.t(), a, static_offsets, out_dtype=torch.float32)
    for counts in (_skewed_counts(T, E, None), [0] * (E - 1) + [T], [T // 2] + [0] * (E - 1)):
        new = offsets_from_counts(counts, "cuda")
        static_offsets.copy_(new)
        graph.replay()
        ref = grouped_mm_ragged_m_ref(a, w.transpose(1, 2), new, torch.float32)
        assert _rel(static_out, ref) < 1e-2
        assert torch.all(static_out[sum(counts) :] == 0)
        assert _rel(static_wg, grouped_mm_ragged_k_ref(a.t(), a, new, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_fp32_inputs_use_tf32_kernels():
    T, E, K, N = 2048, 6, 512, 256
    offsets = offsets_from_counts(_skewed_counts(T, E, None), "cuda")
    a = torch.randn(T, K, device="cuda")
    w = torch.randn(E, N, K, device="cuda") / K**0.5
    out = grouped_mm(a, w.transpose(1, 2), offsets)
    assert _rel(out, grouped_mm_ragged_m_ref(a, w.transpose(1, 2), offsets, torch.float32)) < 5e-3
    g = grouped_mm(a.t(), out, offsets)
    assert _rel(g, grouped_mm_ragged_k_ref(a.t(), out, offsets, torch.float32)) < 5e-3


@pytest.mark.gpu
def test_gpu_plan_path_matches_the_checked_path():
    """Repeated calls take the cached plan (and the replayed launch); they must give exactly
    what the fully checked path gives (``validate=True`` skips the plan), also when a call of
    the same static layout arrives at a misaligned address (copied, not replayed), and with
    aligned and misaligned calls interleaved."""
    from moekit.runtime.op import dispatcher_only

    T, E, K, N = 1000, 8, 256, 384
    offsets = offsets_from_counts(_skewed_counts(T, E, None), "cuda")
    dt = torch.bfloat16
    w = torch.randn(E, N, K, device="cuda", dtype=dt)
    buf = torch.randn(T * K + 1, device="cuda", dtype=dt)
    aligned, misaligned = buf[:-1].view(T, K), buf[1:].view(T, K)  # same strides
    dy = torch.randn(T, N, device="cuda", dtype=dt)
    for a in (aligned, misaligned, aligned, aligned, misaligned, aligned):
        for b in (w.transpose(1, 2), w.transpose(1, 2).contiguous()):
            ref = grouped_mm(a, b, offsets, validate=True)
            assert torch.equal(grouped_mm(a, b, offsets), ref)
            with dispatcher_only():
                assert torch.equal(grouped_mm(a, b, offsets), ref)
        ref_k = grouped_mm(dy.t(), a, offsets, validate=True)
        assert torch.equal(grouped_mm(dy.t(), a, offsets), ref_k)
    # a gradient wanted: the same plan, through the autograd Function
    a = aligned.detach().requires_grad_()
    for _ in range(3):
        y = grouped_mm(a, w.transpose(1, 2), offsets)
        (ga,) = torch.autograd.grad(y, a, dy)
        assert torch.equal(y, grouped_mm(aligned, w.transpose(1, 2), offsets, validate=True))
        assert torch.equal(ga, grouped_mm(dy, w, offsets, validate=True))
