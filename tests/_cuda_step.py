"""A training step checked the way the GPU tests need it: warmed up on a side stream, run once
with host syncs turned into errors, then captured in a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable

import torch


def sync_free_capture(step: Callable, warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run ``step`` ``warmup`` times on a side stream, once under
    ``set_sync_debug_mode("error")`` (a host sync raises), then capture one call in a CUDA
    graph. Returns the graph and the captured call's (static) outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static
