"""The benchmarks that have a --smoke mode run end to end on tiny shapes and write their outputs.

Each runs in its own process, as a user runs it. The grouped-MLP and small-shape ones run the
PyTorch reference (their kernels in Triton's interpreter would take minutes); the permute one
runs its kernels in the interpreter, which its routing-metadata row needs off CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize(
    ("script", "stem", "interpret", "extra"),
    [
        ("benchmark_grouped_mlp.py", "grouped_mlp", False, []),
        ("benchmark_permute.py", "permute_bench", True, []),
        ("benchmark_small_shapes.py", "small_shapes", False, []),
        ("benchmark_moe_layer.py", "moe_layer", False, ["--autocast"]),
        ("benchmark_hf.py", "hf", False, []),
        ("benchmark_fusion.py", "fusion", False, []),
        ("benchmark_sort_chunks.py", "sort_chunks", True, []),
    ],
)
def test_smoke_mode_runs_end_to_end(tmp_path, script, stem, interpret, extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(tmp_path), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / f"{stem}.json").read_text())
    assert result["rows"]
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / f"{stem}.png").stat().st_size > 0


@pytest.mark.dist
def test_fusion_tensor_parallel_smoke(tmp_path):
    # the --tp mode under torchrun: two gloo ranks on the CPU, the all-reduce rule applied
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        str(BENCHMARKS / "benchmark_fusion.py"), "--tp", "--smoke", "--out", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "fusion_tp.json").read_text())
    assert result["rows"] and all(r["applied"] for r in result["rows"])
