"""Regression tests for defects that gave silent wrong answers or confusing errors.

Each test names the defect it pins; each failed before its fix. The permute token-dropping
defect (out_rows smaller than the rows the routing needs) is tested in tests/ops/test_permute.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import tomllib
import torch

import moekit
from moekit.config import interpret_mode
from moekit.nn import GroupedLinear, GroupedMLP
from moekit.ops import grouped_linear, grouped_mlp, grouped_mm
from moekit.reference.grouped_gemm import grouped_mm_ragged_k_ref, grouped_mm_ragged_m_ref
from moekit.reference.grouped_mlp import grouped_mlp_ref

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def _strided_offsets(counts):
    """Cumulative offsets as every other element of a longer tensor (stride 2)."""
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    full = torch.stack([ends, torch.full_like(ends, -7)], dim=1).flatten()
    view = full[::2]
    assert view.stride() == (2,) and torch.equal(view, ends)
    return view


def test_strided_offsets_on_every_gemm_path():
    # Defect: offsets[::2] gave wrong results on the kernel path (the kernels read offsets as
    # contiguous); the reference path was right.
    counts = [7, 0, 12, 5]
    off = _strided_offsets(counts)
    T, E, K, N = sum(counts) + 2, len(counts), 16, 24
    a, b = torch.randn(T, K), torch.randn(E, K, N)
    assert _rel(grouped_mm(a, b, off), grouped_mm_ragged_m_ref(a, b, off, torch.float32)) < 1e-4
    dy = torch.randn(T, N)
    got = grouped_mm(dy.t(), a, off)
    assert _rel(got, grouped_mm_ragged_k_ref(dy.t(), a, off, torch.float32)) < 1e-4
    w = torch.randn(E, N, K)
    ref = grouped_mm_ragged_m_ref(a, w.transpose(1, 2), off, torch.float32)
    assert _rel(grouped_linear(a, w, off), ref) < 1e-4
    w1, w2 = torch.randn(E, 32, K) / 4, torch.randn(E, K, 16) / 4
    p = torch.rand(T)
    assert _rel(grouped_mlp(a, off, w1, w2, p), grouped_mlp_ref(a, off, w1, w2, p)) < 1e-4


def test_bf16_gemm_under_the_interpreter_is_refused_not_wrong():
    # Defect: bf16 under TRITON_INTERPRET=1 returned garbage (relative error ~1e9) from every
    # GEMM path; now a TypeError naming the dtype (the reference path computes it correctly).
    off = torch.tensor([3, 8], dtype=torch.int32)
    a, b = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    w1, w2 = torch.randn(2, 32, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16).bfloat16()
    calls = [
        lambda: grouped_mm(a, b, off),
        lambda: grouped_linear(a, b.transpose(1, 2), off),
        lambda: grouped_mlp(a, off, w1, w2),
    ]
    for call in calls:
        if interpret_mode():
            with pytest.raises(TypeError, match=r"bfloat16.*interpreter"):
                call()
        else:
            assert torch.isfinite(call().float()).all()
    if not interpret_mode():
        ref = grouped_mm_ragged_m_ref(a, b, off, torch.float32)
        assert _rel(grouped_mm(a, b, off), ref) < 2e-2


def _run(code: str, env_interpret: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if env_interpret is not None:
        env["TRITON_INTERPRET"] = env_interpret
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT,
        timeout=300,
    )  # fmt: skip


def test_interpreter_switched_on_after_import_gives_a_clear_error():
    # Defect: setting TRITON_INTERPRET=1 after `import moekit` failed inside Triton with
    # "0 active drivers"; now a RuntimeError says to set it before importing moekit.
    code = (
        "import os, torch, moekit\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "off = torch.tensor([4], dtype=torch.int32)\n"
        "try:\n"
        "    moekit.ops.grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 8), off)\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    out = _run(code, None)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "before importing moekit" in out.stdout


def test_install_metadata_covers_the_interpreter_path():
    # Defect: `pip install .` could not run the interpreter path (numpy was only a test extra)
    # and build/ was not ignored.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(d.replace(" ", "").startswith("numpy") for d in project["dependencies"])
    assert "build/" in (ROOT / ".gitignore").read_text().split()


def test_grouped_linear_errors_speak_the_modules_terms():
    # Defect: GroupedLinear's errors spoke in grouped_mm's internal terms (transposed weight
    # shapes, "b.shape[1]") and misaligned sizes surfaced only at forward time.
    with pytest.raises(ValueError, match=r"in_features.*multiple of 8.*got 30"):
        GroupedLinear(4, 30, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out_features.*multiple of 4.*got 6"):
        GroupedLinear(4, 16, 6, dtype=torch.float32)
    layer = GroupedLinear(4, 16, 8)
    off = torch.tensor([1, 2, 3, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"in_features = 16.*got x of shape \(5, 24\)"):
        layer(torch.randn(5, 24), off)
    with pytest.raises(ValueError, match=r"num_experts = weight.shape\[0\]"):
        layer(torch.randn(5, 16), off[:3])
    for message in ("b.shape", "a.shape"):
        try:
            layer(torch.randn(5, 24), off)
        except ValueError as e:
            assert message not in str(e)


ALIGNMENT_CASES = [
    # (name, call, accepted)
    ("grouped_mm K=6 fp16", lambda: grouped_mm(torch.randn(4, 6).half(),
                                               torch.randn(1, 6, 8).half(), _off(4)), False),
    ("grouped_mm N=12 fp32", lambda: grouped_mm(torch.randn(4, 8), torch.randn(1, 8, 12),
                                                _off(4)), True),
    ("grouped_linear out=4 fp16", lambda: grouped_linear(torch.randn(4, 8).half(),
                                                         torch.randn(1, 4, 8).half(), _off(4)),
     False),
    ("grouped_mlp H=12 fp16", lambda: grouped_mlp(torch.randn(4, 12).half(), _off(4),
                                                  torch.randn(1, 16, 12).half(),
                                                  torch.randn(1, 12, 8).half()), False),
    ("GroupedMLP hidden_size=12 fp16", lambda: GroupedMLP(1, 12, 16, dtype=torch.float16),
     False),
    ("grouped_mlp F=12 fp16 (unfused)", lambda: grouped_mlp(torch.randn(4, 16).half(), _off(4),
                                                            torch.randn(1, 24, 16).half(),
                                                            torch.randn(1, 16, 12).half()),
     True),
]  # fmt: skip


def _off(n):
    return torch.tensor([n], dtype=torch.int32)


def _accepted(call) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the unfused path says so once
            call()
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("case", ALIGNMENT_CASES, ids=[c[0] for c in ALIGNMENT_CASES])
def test_alignment_rule_here(case):
    # Defect: alignment rules differed by path and op (GroupedLinear's sizes were found at
    # forward time, GroupedMLP's never at construction). Each op has one documented rule,
    # checked before dispatch, and each module checks its sizes at construction.
    _, call, accepted = case
    assert _accepted(call) == accepted


def test_alignment_rules_identical_on_the_other_path():
    # The same cases on the other CPU path (reference vs interpreter) in a fresh process.
    other = None if interpret_mode() else "1"
    out = _run(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', "
        "'tests/test_regressions.py', '-k', 'alignment_rule_here']))",
        other,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_readme_states_the_paths_the_rules_and_every_public_name():
    # Defect: README did not say that CPU tensors run the reference unless TRITON_INTERPRET=1,
    # did not state the alignment rules, and left some public modules to docs/ only.
    text = (ROOT / "README.md").read_text()
    assert "TRITON_INTERPRET=1" in text and "reference" in text
    assert "16 bytes" in text
    names = [*moekit.ops.__all__, *moekit.nn.__all__, "Activation"]
    missing = [n for n in names if n not in text]
    assert not missing, f"README does not mention {missing}"


def test_grouped_mlp_module_runs_where_the_functional_op_runs():
    # GroupedMLP with an F whose rows are not 16-byte multiples takes the unfused path on the
    # kernel path and the reference on CPU; both give the reference result.
    mlp = GroupedMLP(2, 16, 12, dtype=torch.float16)
    x = torch.randn(9, 16, dtype=torch.float16)
    off = torch.tensor([4, 9], dtype=torch.int32)
    ref = grouped_mlp_ref(x, off, mlp.fc1_weight, mlp.fc2_weight)
    assert _rel(mlp(x, off), ref) < 2e-3
