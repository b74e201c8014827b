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


def replays_like_eager(step: Callable, inputs: tuple[torch.Tensor, ...], tol: float = 1e-2) -> None:
    """Check ``step`` (returning tensors) sync-free and captured: fill ``inputs`` with new
    random values, replay the graph, and compare its outputs with an eager call's (relative
    L2 error below ``tol``): the graph follows new data (a new routing, for an MoE step)."""
    graph, static = sync_free_capture(step)
    with torch.no_grad():
        for t in inputs:
            t.copy_(torch.randn_like(t))
    graph.replay()
    eager = step()
    for got, want in zip(static, eager, strict=True):
        rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)).item()
        assert rel < tol, rel
