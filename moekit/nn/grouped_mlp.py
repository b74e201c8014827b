"""``GroupedMLP``: E expert MLPs (fc1 → activation → fc2) as one fused op."""

from __future__ import annotations

import math

import torch
from torch import nn

from moekit.activations import Activation, resolve_activation
from moekit.ops.fp8_mlp import grouped_mlp_fp8
from moekit.ops.grouped_mlp import grouped_mlp
from moekit.ops.quantize import Fp8Recipe, Fp8Tensor
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

    ``fp8``: an :class:`~moekit.ops.Fp8Recipe` runs both GEMMs in FP8
    (:func:`moekit.ops.grouped_mlp_fp8`; the weights stay in their dtype and are quantized once
    per version); x may then also be an :class:`~moekit.ops.Fp8Tensor` of the rows, as
    ``permute(..., fp8=)`` gives them. Needs hidden and ffn sizes that are multiples of 16 and
    no biases.
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
        fp8: Fp8Recipe | None = None,
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
        self.fp8 = _check_fp8(fp8, hidden_size, ffn_hidden_size, bias)
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
        if self.fp8 is not None or isinstance(x, Fp8Tensor):
            return grouped_mlp_fp8(
                x, offsets, self.fc1_weight, self.fc2_weight, probs, activation=self.activation,
                glu_interleave=self.glu_interleave, recipe=self.fp8,
            )  # fmt: skip
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
            + (f", fp8={self.fp8}" if self.fp8 is not None else "")
        )


def _check_fp8(fp8: object, hidden_size: int, ffn_hidden_size: int, bias: bool) -> Fp8Recipe | None:
    """The module's FP8 recipe, checked against what the FP8 GEMMs take."""
    if fp8 is None:
        return None
    if not isinstance(fp8, Fp8Recipe):
        raise TypeError(f"fp8 must be a moekit.ops.Fp8Recipe or None, got {type(fp8).__name__}")
    for name, size in (("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
        if size % 16:
            raise ValueError(f"{name} must be a multiple of 16 for the FP8 GEMMs, got {size}")
    if bias:
        raise ValueError("the FP8 expert MLP has no biases: bias=True needs fp8=None")
    return fp8
