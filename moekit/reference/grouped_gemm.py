"""Pure-PyTorch grouped GEMM: the test oracle and the CPU path of ``moekit.ops.grouped_mm``.

Offsets are read on the host here, which is free for CPU tensors; the Triton kernels never do.
Products are computed in float32 and cast once, like the kernels' fp32 accumulators.
"""

from __future__ import annotations

import torch


def _bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends))


def grouped_mm_ragged_m_ref(
    a: torch.Tensor,  # [T, K]
    b: torch.Tensor,  # [E, K, N]
    offsets: torch.Tensor,  # [E] int, cumulative end offsets
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [E, N]
) -> torch.Tensor:  # [T, N]; rows past offsets[-1] are zero
    T, N = a.shape[0], b.shape[-1]
    out = torch.zeros(T, N, dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            out[s:t] = a[s:t].float() @ b[e].float()
            if bias is not None:
                out[s:t] += bias[e].float()
    return out.to(out_dtype)


def grouped_mm_ragged_k_ref(
    a: torch.Tensor,  # [M, T]
    b: torch.Tensor,  # [T, N]
    offsets: torch.Tensor,  # [E] int, cumulative end offsets along T
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [E, M, N]; experts with no columns give zeros
    E, M, N = offsets.shape[0], a.shape[0], b.shape[1]
    out = torch.zeros(E, M, N, dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(_bounds(offsets)):
        if t > s:
            out[e] = a[:, s:t].float() @ b[s:t].float()
    return out.to(out_dtype)
