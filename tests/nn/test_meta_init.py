"""Every moekit module and fusion chain can be built on the meta device (how large models are
built before FSDP2 shards them): ``to_empty`` then ``reset_parameters`` of each submodule, in
module order and from the same seed, gives the weights a plain construction gives, and the
module runs."""

from __future__ import annotations

import pytest
import torch

import moekit.fusion as mf
from moekit.nn import GroupedLinear, GroupedMLP, MoELayer, RMSNorm, RowParallelLinear, TopKRouter
from moekit.ops import RouterConfig

MODULES = {
    "router": lambda: TopKRouter(
        16, 8, 2, RouterConfig(expert_bias=True, score="sigmoid", num_groups=4, topk_groups=2)
    ),
    "grouped_linear": lambda: GroupedLinear(4, 16, 8, bias=True),
    "grouped_mlp": lambda: GroupedMLP(4, 16, 8),
    "moe": lambda: MoELayer(
        16, 8, 4, 2, router=RouterConfig(expert_bias=True, aux_loss_coeff=0.01),
        shared_expert_ffn_size=8,
    ),
    "rmsnorm": lambda: RMSNorm(16),
    "row_parallel_linear": lambda: RowParallelLinear(8, 16),
    "fusion_chain": lambda: mf.Sequential(mf.Linear(16, 16, bias=True), mf.Bias(16),
                                          mf.LayerNorm(16), mf.RMSNorm(16)),
    "fusion_moe": lambda: mf.Sequential(mf.Router(16, 4, 2), mf.Permute(4),
                                        mf.GroupedLinear(4, 16, 16), mf.ScaledSwiGLU(),
                                        mf.GroupedLinear(4, 8, 16), mf.Unpermute()),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODULES))
def test_meta_device_build_then_reset_equals_a_plain_build(name):
    torch.manual_seed(0)
    plain = MODULES[name]()
    with torch.device("meta"):
        meta = MODULES[name]()
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in meta.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    want = plain.state_dict()
    got = meta.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    if name in ("moe", "fusion_chain", "fusion_moe"):
        x = torch.randn(10, 16, requires_grad=True)
        torch.testing.assert_close(meta(x), plain(x))
