"""Tuned configs on disk: a choice the autotuner timed once serves every later process.

One JSON file per software and hardware fingerprint (GPU, compute capability, CUDA, torch,
Triton and moekit versions) under :func:`moekit.config.cache_dir` (``MOEKIT_CACHE_DIR``)::

    {"format": 1, "fingerprint": {...}, "configs": {"<tuner key>": {<config fields>}}}

A file that cannot be read, or was written for another fingerprint or format, is ignored with
a warning (never an error) and replaced by the next save. Several processes may tune at once:
each save re-reads the file under an exclusive lock (``fcntl``, where the platform has it),
adds its entry and replaces the file in one atomic rename, so a reader never sees a partial
file and no writer's entry is lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator

import torch
import triton

from moekit.config import cache_dir
from moekit.runtime.state import STATE
from moekit.version import VERSION

try:
    import fcntl
except ImportError:  # not POSIX: saves are atomic, but concurrent ones may drop an entry
    fcntl = None

__all__ = ["FORMAT", "fingerprint", "lookup", "path_for", "save"]

FORMAT = 1


def fingerprint(device: torch.device) -> dict[str, str]:
    """What a tuned config depends on besides its key: the GPU and the software stack."""
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name,
        "capability": f"{props.major}.{props.minor}",
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "moekit": VERSION,
    }


def path_for(fp: dict[str, str]) -> str:
    digest = hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"tuning-{digest}.json")


def _read(path: str, fp: dict[str, str]) -> dict[str, dict]:
    """The configs of the file at ``path``; {} (with a warning) if it is unusable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"moekit: ignoring unreadable tuning cache {path}: {exc}", stacklevel=3)
        return {}
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or data.get("fingerprint") != fp
        or not isinstance(data.get("configs"), dict)
    ):
        warnings.warn(
            f"moekit: ignoring tuning cache {path}: written by another moekit version or for "
            "another GPU or software stack",
            stacklevel=3,
        )
        return {}
    return {k: v for k, v in data["configs"].items() if isinstance(v, dict)}


def lookup(fp: dict[str, str], key: str) -> dict | None:
    """The stored config fields of ``key``, or None."""
    path = path_for(fp)
    if path not in STATE.tuned:  # this process's view of the file; saves update it
        STATE.tuned[path] = _read(path, fp)
    return STATE.tuned[path].get(key)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def save(fp: dict[str, str], key: str, fields: dict) -> None:
    """Add ``key``'s config to the file (merged with what other processes saved meanwhile).
    A file system that refuses the write costs a warning: the choice still holds in memory."""
    path = path_for(fp)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _locked(path):
            configs = _read(path, fp)
            configs[key] = fields
            data = {"format": FORMAT, "fingerprint": fp, "configs": configs}
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"moekit: could not save tuned config to {path}: {exc}", stacklevel=2)
        configs = {**STATE.tuned.get(path, {}), key: fields}
    STATE.tuned[path] = configs
