"""RMSNorm, the module over add_rmsnorm: forward with and without the fused residual add over
leading batch dims, against the rmsnorm op. The op and its kernel are tested in
tests/ops/test_rmsnorm.py.
"""

from __future__ import annotations

import torch

from moekit.nn.rmsnorm import RMSNorm
from moekit.ops.rmsnorm import rmsnorm


def test_batch_dims_and_module():
    x = torch.randn(2, 3, 16)
    r = torch.randn(2, 3, 16)
    norm = RMSNorm(16)
    y, ro = norm(x, r)
    assert y.shape == (2, 3, 16) and ro.shape == (2, 3, 16)
    torch.testing.assert_close(norm(x), rmsnorm(x, norm.weight), atol=0, rtol=0)
    torch.testing.assert_close(ro, x + r, atol=1e-6, rtol=0)
