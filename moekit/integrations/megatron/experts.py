"""``MoekitExperts``: the experts of a ``megatron.core`` MoELayer as moekit's fused grouped MLP.

Called as Megatron calls its experts: ``experts(permuted_hidden [R, H], tokens_per_expert [E],
permuted_probs [R]) -> (output [R, H], None)``, with the tokens already dispatched (Megatron's
token dispatcher keeps the communication). The routing probs scale each row's activation output
inside the fused kernel; fc2's bias, where there is one, is scaled by them too (as in
Megatron's ``SequentialMLP``).

Parameters: ``fc1_weight`` [E, 2F, H] ([gate | up] rows for gated activations, [E, F, H]
otherwise) and ``fc2_weight`` [E, H, F], with F this expert-tensor-parallel rank's share, and
``fc1_bias`` [E, 2F] / ``fc2_bias`` [E, H] with ``add_bias_linear``. The state dict uses
TransformerEngine's ``TEGroupedMLP`` keys (``linear_fc1.weight<i>``...), and the sharded state
dict for ``megatron.core.dist_checkpointing`` the keys, shapes and offsets of ``SequentialMLP``
and ``TEGroupedMLP``: checkpoints move between the three backends (see
:mod:`moekit.integrations.megatron.checkpoint`).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn import Parameter

from moekit.integrations.megatron import checkpoint
from moekit.integrations.megatron.options import experts_options
from moekit.ops.grouped_mlp import grouped_mlp

__all__ = ["MoekitExperts"]


def expert_offsets(tokens_per_expert: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[E] cumulative row ends on ``device`` from Megatron's counts, wherever they live: a
    device tensor stays on the device, a host one is summed there and copied without a wait."""
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise TypeError(
            f"tokens_per_expert must be a tensor, got {type(tokens_per_expert).__name__}"
        )
    return tokens_per_expert.cumsum(0).to(device, non_blocking=True)


class MoekitExperts(MegatronModule):
    """Megatron-Core experts module running :func:`moekit.ops.grouped_mlp` (see the module
    docstring). Built by Megatron from a layer spec (:func:`with_moekit_experts`) as
    ``MoekitExperts(num_local_experts, config, pg_collection=...)``."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: object = None,  # Megatron's MLPSubmodules: moekit's experts have no linears
        pg_collection: object = None,
        name: str | None = None,
    ) -> None:
        super().__init__(config=config)
        pg = pg_collection if pg_collection is not None else get_default_pg_collection()
        self.ep_group, self.tp_group, self.dp_group = pg.ep, pg.expt_tp, pg.expt_dp
        self.num_local_experts = num_local_experts
        self.options = opts = experts_options(config, self.tp_group.size())
        E, H, F = num_local_experts, opts.hidden_size, opts.ffn_hidden_size
        rows = 2 * F if opts.activation.gated else F
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        kw = {"device": device, "dtype": config.params_dtype}
        self.fc1_weight = Parameter(torch.empty(E, rows, H, **kw))
        self.fc2_weight = Parameter(torch.empty(E, H, F, **kw))
        self.fc1_bias = Parameter(torch.zeros(E, rows, **kw)) if opts.bias else None
        self.fc2_bias = Parameter(torch.zeros(E, H, **kw)) if opts.bias else None
        if config.perform_initialization:
            self._initialize_weights()
        self._mark_parameters()

    def _initialize_weights(self) -> None:
        """Megatron's init methods, expert by expert, as its expert linears apply them: on the
        GPU to this rank's shard under the expert-parallel RNG state; on the CPU
        (``use_cpu_initialization``) to the whole expert weight, of which this rank keeps its
        expert-tensor-parallel shard (the same weights at any split). Biases start at zero."""
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        gated = self.options.activation.gated
        init1, init2 = self.config.init_method, self.config.output_layer_init_method
        if self.fc1_weight.is_cuda:
            rng = get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
            with rng, torch.no_grad():
                for w, method in ((self.fc1_weight, init1), (self.fc2_weight, init2)):
                    for i in range(self.num_local_experts):
                        method(w[i])
            return
        with torch.no_grad():
            for i in range(self.num_local_experts):
                w1 = torch.empty(self.fc1_weight.shape[1] * tp, self.fc1_weight.shape[2])
                init1(w1)
                halves = w1.chunk(2) if gated else (w1,)
                self.fc1_weight[i].copy_(torch.cat([h.chunk(tp)[rank] for h in halves]))
                w2 = torch.empty(self.fc2_weight.shape[1], self.fc2_weight.shape[2] * tp)
                init2(w2)
                self.fc2_weight[i].copy_(w2.chunk(tp, dim=1)[rank])

    def _mark_parameters(self) -> None:
        """The attributes Megatron's DDP, optimizer and grad-norm read off expert parameters:
        expert-parallel ones are reduced over the expert-data-parallel group, and the
        tensor-parallel dims are fc1's rows and fc2's columns."""
        local = self.config.expert_model_parallel_size <= 1
        for p, dim in ((self.fc1_weight, 1), (self.fc2_weight, 2), (self.fc1_bias, 1)):
            if p is not None:
                set_tensor_model_parallel_attributes(p, is_parallel=True, dim=dim, stride=1)
        for p in self.parameters():
            p.allreduce = local

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,  # [R, H], rows sorted by local expert
        tokens_per_expert: torch.Tensor,  # [E] rows per local expert, on the host or device
        permuted_probs: torch.Tensor,  # [R] each row's routing prob
    ) -> tuple[torch.Tensor, None]:
        x, probs = permuted_local_hidden_states, permuted_probs
        offsets = expert_offsets(tokens_per_expert, x.device)
        if self.options.probs_on_input:
            x, probs = (probs.unsqueeze(-1) * x).to(x.dtype), None
        y = grouped_mlp(
            x, offsets, self.fc1_weight, self.fc2_weight, probs,
            activation=self.options.activation,
            recompute_activation=self.options.recompute_activation, b1=self.fc1_bias,
        )  # fmt: skip
        if self.fc2_bias is not None:
            y = (y + self._fc2_bias_rows(offsets, x.shape[0], probs)).to(y.dtype)
        return y, None

    def _fc2_bias_rows(
        self, offsets: torch.Tensor, rows: int, probs: torch.Tensor | None
    ) -> torch.Tensor:
        """[R, H]: each row's expert's fc2 bias times the row's prob (Megatron's expert bias)."""
        expert = torch.searchsorted(offsets, torch.arange(rows, device=offsets.device), right=True)
        bias = self.fc2_bias[expert.clamp_(max=self.num_local_experts - 1)]
        return bias if probs is None else bias * probs.unsqueeze(-1)

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass (``delay_wgrad_compute`` is
        declined at construction); nothing is left for Megatron to run here."""

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for key, t in checkpoint.grouped_tensors(self).items():
            destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
        error_msgs,
    ) -> None:  # fmt: skip
        checkpoint.load_grouped(self, state_dict, prefix, strict, missing_keys,
                                unexpected_keys, error_msgs)  # fmt: skip

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        return checkpoint.sharded_experts(self, prefix, sharded_offsets, metadata)
