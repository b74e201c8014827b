"""The custom fusion-rule example (docs/fusion.md): its rule applies where it should, declines
where it should, matches the unfused chain and the reference, and is gone afterwards."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

import moekit.fusion as mf

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fusion_custom_rule.py"


def _rule_names() -> set[str]:
    return {r.name for p in ("forward", "backward") for r in mf.registered_rules(p)}


def test_example_fuses_checks_and_unregisters(capsys):
    before = _rule_names()
    example = runpy.run_path(str(EXAMPLE))  # not as __main__: main() is called below
    rule = example["RULE"]
    assert rule not in before
    res = example["main"]()
    out = capsys.readouterr().out
    assert "[0:2] linear_bias(Linear, Bias)" in out
    assert "linear_bias (the Linear already has a bias)" in out
    assert "tensor-parallel: linear_bias" in out
    assert out.rstrip().splitlines()[-1].startswith("OK: ")
    assert res["plan"].fused("forward") == [rule] == res["plan"].fused("backward")
    assert res["max_rel_err"] < 1e-5
    assert _rule_names() == before  # unregistered at the end


def test_example_unregisters_when_a_check_fails(monkeypatch):
    """The rule is removed even when main() raises half-way."""
    before = _rule_names()
    example = runpy.run_path(str(EXAMPLE))

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    # run_path returns a copy of the module's globals; main() reads its own
    monkeypatch.setitem(example["main"].__globals__, "_run", broken)
    with pytest.raises(RuntimeError, match="boom"):
        example["main"]()
    assert _rule_names() == before
