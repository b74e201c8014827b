"""Local fused residual add + RMSNorm: kernel (interpreter on CPU, GPU with ``-m gpu``) vs the
reference, forward and backward, edge shapes, bad input, the kernel ops' schemas and fake
implementations (``torch.library.opcheck``), the no-grad path, the dispatcher path, launch replay
and a second backward through the graph."""

from __future__ import annotations

import pytest
import torch

from moekit.nn.rmsnorm import RMSNorm
from moekit.ops.rmsnorm import add_rmsnorm, add_rmsnorm_backward, add_rmsnorm_forward, rmsnorm
from moekit.reference.rmsnorm import add_rmsnorm_bwd_ref, add_rmsnorm_ref
from moekit.runtime.op import dispatcher_only

# (T, H): T=1 (decode), odd H (column masking), a non-power-of-two H, a wider row
SHAPES = [(1, 8), (5, 33), (16, 96), (3, 256)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _inputs(T, H, dtype, device):
    x = torch.randn(T, H, device=device).to(dtype)
    r = torch.randn(T, H, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(H, device=device)).to(dtype)
    return x, r, w


def _check_fwd_bwd(T, H, dtype, device, with_residual):
    x, r, w = _inputs(T, H, dtype, device)
    r = r if with_residual else None
    tol = TOL[dtype]
    xs = x.clone().requires_grad_()
    rs = r.clone().requires_grad_() if r is not None else None
    ws = w.clone().requires_grad_()
    n, ro = add_rmsnorm(xs, rs, ws, 1e-6)
    rn, rro, _ = add_rmsnorm_ref(x, r, w, 1e-6)
    # residual_out: a single rounding of an fp32 sum, identical to the reference up to the
    # interpreter's fp32→bf16 truncation (one ulp)
    torch.testing.assert_close(ro.float(), rro.float(), atol=tol * 4, rtol=tol)
    torch.testing.assert_close(n.float(), rn.float(), atol=tol * 4, rtol=tol)
    dn, dro = torch.randn_like(n), torch.randn_like(ro)
    (n.float() * dn.float() + ro.float() * dro.float()).sum().backward()
    xr = x.float().clone().requires_grad_()
    rr = r.float().clone().requires_grad_() if r is not None else None
    wr = w.float().clone().requires_grad_()
    n2, ro2, _ = add_rmsnorm_ref(xr, rr, wr, 1e-6)
    (n2 * dn.float() + ro2 * dro.float()).sum().backward()
    gtol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(xs.grad.float(), xr.grad, atol=gtol, rtol=gtol)
    if r is not None:
        torch.testing.assert_close(rs.grad.float(), rr.grad, atol=gtol, rtol=gtol)
    torch.testing.assert_close(ws.grad.float(), wr.grad, atol=gtol * H**0.5, rtol=gtol)


@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_cpu(T, H, dtype, with_residual):
    _check_fwd_bwd(T, H, dtype, "cpu", with_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [*SHAPES, (4096, 4096), (257, 7168), (2, 16384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_rmsnorm_gpu(T, H, dtype):
    _check_fwd_bwd(T, H, dtype, "cuda", True)


def test_bwd_reference_matches_autograd():
    # the explicit backward formula (twin of the kernel) against torch autograd
    T, H = 7, 40
    x, r, w = _inputs(T, H, torch.float32, "cpu")
    xr, rr, wr = (t.clone().requires_grad_() for t in (x, r, w))
    n, ro, rstd = add_rmsnorm_ref(xr, rr, wr, 1e-6)
    dn, dro = torch.randn(T, H), torch.randn(T, H)
    (n * dn + ro * dro).sum().backward()
    dx, dw = add_rmsnorm_bwd_ref(dn, dro, ro.detach(), w, rstd.detach())
    torch.testing.assert_close(dx, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, rr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, wr.grad, atol=1e-4, rtol=1e-5)


def test_bad_input():
    x, r, w = _inputs(4, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rmsnorm(x, r[:2], w)
    with pytest.raises(ValueError, match=r"weight must have shape \(H,\) = \(8,\)"):
        add_rmsnorm(x, r, w[:3])
    with pytest.raises(TypeError, match="x must have dtype"):
        add_rmsnorm(x.to(torch.int32), r, w)
    with pytest.raises(ValueError, match="hidden size H"):
        rmsnorm(torch.randn(4, 0), torch.randn(0))
    with pytest.raises(TypeError, match=r"weight must have x's dtype \(float32\), got float64"):
        add_rmsnorm(x, r, w.double())
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        add_rmsnorm(x, r.double(), w)
    with pytest.raises(ValueError, match="residual must be on x's device"):
        add_rmsnorm(x, r.to("meta"), w)
    with pytest.raises(ValueError, match="x must be contiguous"):
        add_rmsnorm(torch.randn(8, 4).t(), None, torch.ones(8))
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        RMSNorm(0)


@pytest.mark.parametrize("with_residual", [True, False])
def test_kernel_ops_opcheck(with_residual):
    x, r, w = _inputs(5, 16, torch.float32, "cpu")
    r = r if with_residual else None
    for store_rstd in (True, False):
        torch.library.opcheck(add_rmsnorm_forward.op, (x, r, w, 1e-6, store_rstd))
    _, ro, rstd = add_rmsnorm_forward(x, r, w, 1e-6, True)
    ro = ro if with_residual else x
    dro = torch.randn(5, 16) if with_residual else None
    torch.library.opcheck(add_rmsnorm_backward.op, (torch.randn(5, 16), dro, ro, w, rstd))


def test_no_grad_dispatcher_and_identity_paths():
    x, r, w = _inputs(6, 24, torch.float32, "cpu")
    n, ro = add_rmsnorm(x, r, w)  # no input needs grad: the kernel op alone
    with dispatcher_only():
        n2, ro2 = add_rmsnorm(x, r, w)
    wg = w.clone().requires_grad_()
    n3, ro3 = add_rmsnorm(x, r, wg)  # through the autograd Function
    for a, b in ((n2, n), (ro2, ro), (n3, n), (ro3, ro)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert add_rmsnorm(x, None, wg)[1] is x  # no residual: residual_out is x itself
    torch.testing.assert_close(rmsnorm(x, w), add_rmsnorm(x, None, w)[0], atol=0, rtol=0)


@pytest.mark.parametrize("shape", [(4, 32), (2, 2, 32)])
def test_backward_twice_with_retain_graph(shape):
    # x and residual share one gradient; each .grad must still get its own storage, or the
    # second backward would accumulate into both twice
    x, r, w = _inputs(4, 32, torch.float32, "cpu")
    x, r, w = x.view(shape).requires_grad_(), r.view(shape).requires_grad_(), w.requires_grad_()
    n, ro = add_rmsnorm(x, r, w)
    loss = (n * 2 + ro).sum()
    loss.backward(retain_graph=True)
    assert x.grad.data_ptr() != r.grad.data_ptr()
    first = [t.grad.clone() for t in (x, r, w)]
    loss.backward()
    for t, g in zip((x, r, w), first):
        torch.testing.assert_close(t.grad, 2 * g)


@pytest.mark.gpu
def test_gpu_launch_replay_matches_first_call():
    # the first call launches normally, the second records, later ones replay
    x, r, w = (t.requires_grad_() for t in _inputs(64, 4096, torch.bfloat16, "cuda"))
    outs = []
    for _ in range(4):
        n, ro = add_rmsnorm(x, r, w)
        n.float().sum().backward()
        outs.append((n, ro, x.grad.clone(), w.grad.clone()))
        x.grad = r.grad = w.grad = None
    for got in outs[1:]:
        for a, b in zip(got, outs[0]):
            assert torch.equal(a, b)
