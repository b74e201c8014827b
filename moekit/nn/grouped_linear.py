"""``GroupedLinear``: E independent linear layers applied to expert-sorted rows in one launch."""

from __future__ import annotations

import math

import torch
from torch import nn

from moekit.ops.grouped_linear import check_features, grouped_linear
from moekit.ops.validation import check_positive


class GroupedLinear(nn.Module):
    """E linear layers packed in one parameter, weight [E, out_features, in_features].

    ``forward(x, offsets)``: x [T, in_features] with rows grouped by expert, offsets [E]
    cumulative end offsets (int32/int64, on x's device) → [T, out_features]. Rows past
    offsets[-1] give zeros. in_features and out_features must each span a multiple of 16
    bytes of the parameters' dtype (8 elements for bf16/fp16, 4 for fp32), checked here. If
    ``weight.main_grad`` (fp32, weight's shape) exists, the weight gradient accumulates into it
    in place instead of producing ``weight.grad``.
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive(num_experts=num_experts, in_features=in_features, out_features=out_features)
        check_features(in_features, out_features, dtype or torch.get_default_dtype())
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, independently per expert.
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        main_grad = getattr(self.weight, "main_grad", None)
        return grouped_linear(x, self.weight, offsets, self.bias, main_grad)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
