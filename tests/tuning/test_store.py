"""The on-disk store of tuned configs: round trip, bad files, concurrent writers, and the
tuner reusing a stored choice instead of timing again."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moekit.runtime.cache import cache_clear
from moekit.runtime.state import STATE
from moekit.tuning import grouped_gemm as tuning
from moekit.tuning import store

FP = {"gpu": "Test GPU", "capability": "9.0", "torch": "t", "triton": "tr", "moekit": "m"}


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(tmp_path))
    STATE.tuned.clear()
    yield tmp_path
    STATE.tuned.clear()


def _fresh_process_view():
    STATE.tuned.clear()  # what another process would see: only the file


def test_round_trip(cache_dir):
    store.save(FP, "k1", {"block_m": 64})
    store.save(FP, "k2", {"block_m": 128})
    _fresh_process_view()
    assert store.lookup(FP, "k1") == {"block_m": 64}
    assert store.lookup(FP, "k2") == {"block_m": 128}
    assert store.lookup(FP, "k3") is None
    assert os.path.dirname(store.path_for(FP)) == str(cache_dir)
    other = {**FP, "triton": "other"}
    assert store.path_for(other) != store.path_for(FP)
    assert store.lookup(other, "k1") is None


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        json.dumps([1, 2]),
        json.dumps({"format": 999, "fingerprint": FP, "configs": {"k1": {}}}),
        json.dumps({"format": store.FORMAT, "fingerprint": {**FP, "gpu": "x"}, "configs": {}}),
        json.dumps({"format": store.FORMAT, "fingerprint": FP, "configs": [1]}),
    ],
    ids=["corrupt", "empty", "list", "stale-format", "other-fingerprint", "bad-configs"],
)
def test_bad_file_is_ignored_with_a_warning_and_replaced(content):
    path = store.path_for(FP)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(content)
    with pytest.warns(UserWarning, match="ignoring"):
        assert store.lookup(FP, "k1") is None
    with pytest.warns(UserWarning, match="ignoring"):
        store.save(FP, "k1", {"block_m": 32})
    _fresh_process_view()
    assert store.lookup(FP, "k1") == {"block_m": 32}  # a valid file again, no warning


def test_unwritable_directory_warns_and_keeps_the_choice_in_memory(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("MOEKIT_CACHE_DIR", str(blocker / "sub"))  # a directory under a file
    with pytest.warns(UserWarning, match="could not save"):
        store.save(FP, "k1", {"block_m": 64})
    assert store.lookup(FP, "k1") == {"block_m": 64}


WRITER = textwrap.dedent(
    """
    import sys
    from moekit.tuning import store
    fp = {fp!r}
    for i in range(40):
        store.save(fp, f"{{sys.argv[1]}}-{{i}}", {{"i": i}})
    """
)


def test_concurrent_writers_leave_a_valid_file_with_every_entry(cache_dir):
    env = dict(os.environ, MOEKIT_CACHE_DIR=str(cache_dir))
    code = WRITER.format(fp=FP)
    procs = [
        subprocess.Popen([sys.executable, "-c", code, name], env=env) for name in ("a", "b", "c")
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    with open(store.path_for(FP)) as f:
        data = json.load(f)
    assert len(data["configs"]) == 120
    _fresh_process_view()
    assert store.lookup(FP, "b-39") == {"i": 39}


def test_tuner_reuses_a_stored_choice_and_logs_what_it_tunes(monkeypatch, caplog):
    """First process: tunes (one log line), saves. Second process (fresh memory): reads the
    choice back without timing anything. A stored config that is no longer a candidate is
    tuned afresh."""
    default = tuning.GemmConfig(128, 256, 64)
    other = tuning.GemmConfig(64, 128, 128, num_warps=4)
    timed = []

    def fake_bench(fn, **_):
        timed.append(fn())
        return 2.0 if timed[-1] == default else 1.0

    monkeypatch.setattr(tuning, "interpret_mode", lambda: False)
    monkeypatch.setattr(tuning, "autotune_enabled", lambda: True)
    monkeypatch.setattr(tuning, "is_capturing", lambda: False)
    monkeypatch.setattr(tuning.triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(tuning.store, "fingerprint", lambda device: FP)

    def choose(cands):
        return tuning.choose_config(
            "m", ("store-test",), torch.bfloat16, torch.device("cuda"), cands,
            lambda: (lambda cfg: cfg,),
        )  # fmt: skip

    cache_clear("tuned")
    with caplog.at_level(logging.INFO, logger="moekit.tuning"):
        assert choose((default, other)) == other
    assert len(timed) == 4  # two candidates, two rounds
    assert sum("tuned m ('store-test',)" in r.getMessage() for r in caplog.records) == 1
    cache_clear("tuned")
    _fresh_process_view()
    timed.clear()
    assert choose((default, other)) == other
    assert timed == []  # read back, not timed
    cache_clear("tuned")
    narrower = dataclasses.replace(other, num_stages=5)
    assert choose((default, narrower)) == narrower  # the stored one is no candidate now
    assert timed
    cache_clear("tuned")
