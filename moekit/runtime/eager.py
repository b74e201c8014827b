"""Whether a call runs in plain eager mode, where ops may skip the dispatcher (moekit.runtime.op),
and whether a backward may overwrite the gradient it was handed."""

from __future__ import annotations

import sys
import threading

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from moekit.runtime.state import STATE

__all__ = ["owned_gradient", "plain_eager", "values_on_host"]

# Argument types that need no closer look (a tensor subclass is not among them).
_SIMPLE = frozenset(
    (torch.Tensor, nn.Parameter, type(None), int, float, bool, str, tuple, list, torch.dtype)
)


def plain_eager(args: tuple) -> bool:
    """True when nothing between a caller and an op's implementation needs the dispatcher:
    no ``torch.compile`` tracing, no functorch transform (vmap, grad), no dispatch mode
    (``FakeTensorMode``, tracing, functionalisation) and no tensor subclass among ``args``.

    ``torch.compiler.is_compiling()`` comes first: Dynamo folds it to True, so it never
    traces the checks after it."""
    if torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active() or torch._C._len_torch_dispatch_stack():
        return False
    # a loop, not all(...): a generator costs more than the checks on a hot path
    for a in args:  # noqa: SIM110
        if type(a) not in _SIMPLE and isinstance(a, torch.Tensor):
            return False
    return True


def values_on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values may be read now without a device sync: a real CPU tensor, outside
    tracing (``torch.compile``/export trace with stand-ins that hold no values)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and not is_fake(t)


def _python_refs(t: torch.Tensor) -> int:
    return sys.getrefcount(t)


def _references(grad: torch.Tensor) -> tuple[int, int, int] | None:
    """(references to the tensor object, to its TensorImpl, to its storage); None where this
    torch does not expose them."""
    try:
        storage = torch._C._storage_Use_Count(grad.untyped_storage()._cdata) - 1  # not ours
        return _python_refs(grad), grad._use_count(), storage
    except (AttributeError, RuntimeError, TypeError):
        return None


class _Calibration(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sink):
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _record(grad, ctx.sink)
        return grad, None


def _record(grad: torch.Tensor, sink: list) -> None:
    sink.append(_references(grad))  # at the call depth of owned_gradient's look


def _calibrate(keep: bool) -> tuple[int, int, int] | None:
    """The references the gradient of a tiny CPU graph has inside its Function's backward;
    ``keep``: a hook also keeps that gradient."""
    kept: list[torch.Tensor] = []
    sink: list = []
    no_anomaly = torch.autograd.set_detect_anomaly(False)
    with torch.inference_mode(False), torch.enable_grad(), no_anomaly:
        y = _Calibration.apply(torch.zeros(2, requires_grad=True), sink)
        if keep:
            y.register_hook(kept.append)
        (y * 2.0).sum().backward()
    return sink[0] if sink else None


def _exclusive_references() -> tuple[int, int, int] | None:
    """The references a gradient that nothing else holds has inside a Function's backward (the
    count of Python references depends on how torch calls the backward, so it is measured,
    not assumed), or None where a kept gradient does not count differently. Measured once, on
    first use, in a thread of its own: a top-level backward there, whatever the caller is in
    (a backward, anomaly detection, a no-grad region) — all of which could count differently."""
    found: list = []

    def measure() -> None:
        try:
            alone, kept = _calibrate(keep=False), _calibrate(keep=True)
        except RuntimeError:
            alone = kept = None
        found.append(alone if alone is not None and kept != alone else None)

    worker = threading.Thread(target=measure, name="moekit-calibrate")
    worker.start()
    worker.join()
    return found[0] if found else None


_UNMEASURED = object()


def owned_gradient(grad: torch.Tensor) -> bool:
    """Whether ``grad``, the gradient an autograd Function's ``backward`` was handed (call this
    from ``backward`` itself, passing its argument), is referenced by nothing else: no other
    node, hook, ``.grad`` or user variable holds the tensor, a view of it or its storage. Such
    a gradient is dead once the backward has read it, so its memory may take an output.
    Conservative: False whenever a count is unavailable or differs from a lone gradient's."""
    if grad._base is not None or not grad.is_contiguous() or torch.is_anomaly_enabled():
        return False
    exclusive = STATE.lookups.get("exclusive_gradient_references", _UNMEASURED)
    if exclusive is _UNMEASURED:
        exclusive = STATE.lookups["exclusive_gradient_references"] = _exclusive_references()
    return exclusive is not None and _references(grad) == exclusive
