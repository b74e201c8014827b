"""The Hugging Face fine-tuning example end to end on the CPU: the loss falls with
experts_implementation="moekit"."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf_moe.py"


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_loss_falls(family):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--family", family, "--steps", "60", "--batch", "8",
         "--seq", "64"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < first - 1.0, proc.stdout
    assert "experts_implementation='moekit'" in proc.stdout
