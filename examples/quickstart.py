"""moekit quickstart: GroupedLinear and the fused GroupedMLP, forward + backward, checked
against the pure-PyTorch reference.

On a CUDA machine the Triton kernels run on the GPU (bf16). Without one, the same Triton
kernels run in Triton's CPU interpreter (fp32, small shapes), so the printed agreement is a
real kernel-vs-reference comparison on either machine.
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

from moekit.nn import GroupedLinear, GroupedMLP
from moekit.reference.grouped_gemm import grouped_mm_ragged_m_ref
from moekit.reference.grouped_mlp import grouped_mlp_ref


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def main() -> None:
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    E, H, F, T = (8, 1024, 2048, 8192) if cuda else (4, 64, 96, 200)

    # Skewed routing: counts per expert, one expert idle, summed into cumulative offsets.
    share = torch.distributions.Gamma(0.7, 1.0).sample((E,))
    share[1] = 0.0
    counts = torch.floor(share / share.sum() * T).long()
    counts[0] += T - int(counts.sum())
    offsets = counts.cumsum(0).to(torch.int32).to(device)

    layer = GroupedLinear(E, H, F, bias=True, device=device, dtype=dtype)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(T, F, device=device, dtype=dtype)

    t0 = time.perf_counter()
    y = layer(x, offsets)
    y.backward(grad)
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0

    # Reference: per-expert fp32 matmuls (pure PyTorch) and their autograd.
    xr = x.detach().float().requires_grad_()
    wr = layer.weight.detach().float().requires_grad_()
    br = layer.bias.detach().float().requires_grad_()
    yr = grouped_mm_ragged_m_ref(xr, wr.transpose(1, 2), offsets, torch.float32, br)
    yr.backward(grad.float())

    backend = "Triton on " + torch.cuda.get_device_name() if cuda else "Triton CPU interpreter"
    print(f"moekit GroupedLinear  E={E} in={H} out={F} T={T} {str(dtype)[6:]}  [{backend}]")
    print(f"  rows per expert: {counts.tolist()}")
    print(f"  forward+backward (first call, incl. compile): {elapsed * 1e3:.1f} ms")
    checks = {
        "y": rel_err(y, yr),
        "dx": rel_err(x.grad, xr.grad),
        "dW": rel_err(layer.weight.grad, wr.grad),
        "dbias": rel_err(layer.bias.grad, br.grad),
    }
    tol = 2e-2 if cuda else 1e-4
    report(checks, tol)

    # The fused expert MLP: fc1 -> SwiGLU scaled by the routing probs -> fc2, one autograd op.
    mlp = GroupedMLP(E, H, F // 2, activation="swiglu", device=device, dtype=dtype)
    probs = torch.rand(T, device=device, requires_grad=True)
    x.grad = None
    t0 = time.perf_counter()
    y = mlp(x, offsets, probs)
    y.backward(torch.randn_like(y))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    leaves = (x, mlp.fc1_weight, mlp.fc2_weight, probs)
    dy = torch.randn_like(y)
    y = mlp(x, offsets, probs)
    got = torch.autograd.grad(y, leaves, dy)
    yr = grouped_mlp_ref(x, offsets, mlp.fc1_weight, mlp.fc2_weight, probs)
    ref = torch.autograd.grad(yr, leaves, dy)
    print(f"moekit GroupedMLP  E={E} H={H} F={F // 2} swiglu, prob-scaled  [{backend}]")
    print(f"  forward+backward (first call, incl. compile): {elapsed * 1e3:.1f} ms")
    checks = {"y": rel_err(y, yr)}
    checks.update({n: rel_err(g, r) for n, g, r in zip(("dx", "dW1", "dW2", "dprobs"), got, ref)})
    report(checks, tol)


def report(checks: dict[str, float], tol: float) -> None:
    for name, err in checks.items():
        verdict = "ok" if err < tol else "MISMATCH"
        print(f"  {name:6s} relative error vs reference: {err:.2e}  {verdict}")
    if any(err >= tol for err in checks.values()):
        raise SystemExit("quickstart: kernel and reference disagree")


if __name__ == "__main__":
    main()
