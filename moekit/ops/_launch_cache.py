"""Launch replay for ops whose kernel launches depend only on static facts (kernels/_replay.py).

An op builds a key from everything its launchers' arguments depend on except tensor addresses
(shapes, strides, dtypes, devices, flags), allocates its outputs, and calls ``replayed`` with
its tensors ("roles") and a body that runs the launchers the normal way. From the third call of
a key on, the recorded launches are re-issued with only the pointers swapped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moekit.kernels._replay import LaunchReplay

_REPLAYS: dict[tuple, LaunchReplay] = {}
_MAX_REPLAYS = 512


def sig(t: torch.Tensor | None) -> tuple | None:
    """What a launcher's non-pointer arguments may take from a tensor."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def replayed(
    key: tuple | None, roles: Sequence[torch.Tensor | None], body: Callable[[], object]
) -> None:
    """Run ``body``'s launches for these tensors: replayed when recorded, else run (and
    recorded on the second call of ``key``). ``key`` None (CPU, interpreter) just runs it."""
    if key is None:
        body()
        return
    rep = _REPLAYS.get(key)
    if rep is None:
        if len(_REPLAYS) >= _MAX_REPLAYS:
            _REPLAYS.clear()
        rep = _REPLAYS[key] = LaunchReplay()
    run_or_record(rep, roles, body)


def run_or_record(
    rep: LaunchReplay, roles: Sequence[torch.Tensor | None], body: Callable[[], object]
) -> None:
    """Replay ``rep``'s recorded launches for these tensors, or run ``body`` (recording when
    due): for ops that keep their LaunchReplay objects themselves (e.g. in a plan)."""
    if not rep.run(roles):
        with rep.recording(roles):
            body()
