"""``GroupedMLP``: E expert MLPs (fc1 → activation → fc2) as one fused op."""

from __future__ import annotations

import math

import torch
from torch import nn

from moekit.activations import Activation, resolve_activation
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.validation import check_byte_aligned, check_positive


class GroupedMLP(nn.Module):
    """Expert MLPs packed in two parameters: ``fc1_weight`` [E, 2F, H] for gated activations
    ([E, F, H] otherwise; gate rows first, or blocks of ``glu_interleave`` rows alternating
    gate/up) and ``fc2_weight`` [E, H, F].

    ``forward(x, offsets, probs=None)``: x [R, H] expert-sorted rows, offsets [E] cumulative
    end offsets on x's device, probs [R] optional routing probs scaling each row's activation
    output → [R, H] (``zero_tail=False``: rows past offsets[-1] left unwritten, see
    :func:`moekit.ops.grouped_mlp`). When a weight has an fp32 ``main_grad`` attribute, its gradient
    accumulates there in place instead of producing ``.grad``. ``hidden_size`` must span a
    multiple of 16 bytes of the parameters' dtype (checked here); ``ffn_hidden_size`` may be
    any size (see :func:`moekit.ops.grouped_mlp`).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str | Activation = "swiglu",
        glu_interleave: int | None = None,
        bias: bool = False,
        recompute_activation: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive(
            num_experts=num_experts, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size
        )
        # One rule on every path: the kernels read hidden rows of 16 bytes; an F whose rows are
        # not 16-byte multiples runs the unfused composition (see moekit.ops.grouped_mlp).
        check_byte_aligned(
            "hidden_size", hidden_size, dtype or torch.get_default_dtype(), "hidden_size"
        )
        self.activation = resolve_activation(activation)
        if glu_interleave is not None and (
            not self.activation.gated or glu_interleave <= 0 or ffn_hidden_size % glu_interleave
        ):
            raise ValueError(
                "glu_interleave must be a positive divisor of ffn_hidden_size "
                f"({ffn_hidden_size}) and needs a gated activation, got {glu_interleave} with "
                f"{self.activation.name!r}"
            )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.glu_interleave = glu_interleave
        self.recompute_activation = recompute_activation
        w1_rows = ffn_hidden_size * (2 if self.activation.gated else 1)
        kw = {"device": device, "dtype": dtype}
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, w1_rows, hidden_size, **kw))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size, **kw))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, w1_rows, **kw)) if bias else None
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation per expert
        for w, b, fan_in in (
            (self.fc1_weight, self.fc1_bias, self.hidden_size),
            (self.fc2_weight, self.fc2_bias, self.ffn_hidden_size),
        ):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(w, -bound, bound)
            if b is not None:
                nn.init.uniform_(b, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        probs: torch.Tensor | None = None,
        *,
        zero_tail: bool = True,
    ) -> torch.Tensor:
        return grouped_mlp(
            x, offsets, self.fc1_weight, self.fc2_weight, probs,
            activation=self.activation, glu_interleave=self.glu_interleave,
            recompute_activation=self.recompute_activation, b1=self.fc1_bias, b2=self.fc2_bias,
            zero_tail=zero_tail,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"ffn_hidden_size={self.ffn_hidden_size}, activation={self.activation.name!r}, "
            f"glu_interleave={self.glu_interleave}, bias={self.fc1_bias is not None}, "
            f"recompute_activation={self.recompute_activation}"
        )
