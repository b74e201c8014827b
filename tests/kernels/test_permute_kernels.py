"""The permute kernels directly, at sizes that cross their internal block boundaries.

Runs in Triton's interpreter (TRITON_INTERPRET=1) or on CUDA; skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from moekit.config import interpret_mode
from moekit.kernels import permute as kern
from moekit.reference import permute as ref

pytestmark = [
    pytest.mark.skipif(
        not (interpret_mode() or torch.cuda.is_available()),
        reason="needs TRITON_INTERPRET=1 or a CUDA GPU",
    ),
    pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning"),
]

DEVICE = "cpu" if interpret_mode() else "cuda"


@pytest.mark.parametrize(
    "T,k,E,align",
    [
        (300, 4, 6, 1),  # 1200 pairs: five 256-pair blocks, the last one partly masked
        (130, 16, 3, 8),  # k = 16, few experts: long runs of one expert across blocks
        (70, 2, 1000, 16),  # E near the 1024 cap of the tests: the histogram's widest bins
        (40, 3, 1, 128),  # E = 1: every pair in one segment
        (1, 1, 5, 16),  # one pair: a block of 256 with 255 masked positions
    ],
)
def test_routing_metadata_kernel(T, k, E, align):
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    indices[::7, 0] = -1  # masked slots in every block (they sort after every expert)
    got = kern.routing_metadata(indices, E, align)
    want = ref.routing_metadata_torch(indices, E, align)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_routing_metadata_scan_loop_and_int32_indices(monkeypatch):
    # The scan walks the blocks in steps of _SCAN_BLOCK_B (512 on GPU: loops only past 2^19
    # pairs); a step of 2 makes it loop here, with a running prefix carried across steps.
    # int32 indices and out-of-range experts on both sides (−1 and E) are dropped slots.
    monkeypatch.setattr(kern, "_SCAN_BLOCK_B", 2)
    indices = torch.randint(-1, 10, (700, 2), device=DEVICE, dtype=torch.int32)  # 6 blocks
    got = kern.routing_metadata(indices, 9, 16)
    want = ref.routing_metadata_torch(indices, 9, 16)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_routing_metadata_launches_compose():
    # The benchmark times the launches one by one: run in order, they give routing_metadata.
    indices = torch.randint(0, 7, (90, 3), device=DEVICE)
    outputs, launches = kern.routing_metadata_launches(indices, 7, 8)
    assert [name for name, _ in launches] == ["hist", "scan", "rows"]
    for _, launch in launches:
        launch()
    for g, w in zip(outputs, ref.routing_metadata_torch(indices, 7, 8)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_scatter_weighted_dot_and_gather_vals():
    # The unpermute backward flags (WEIGHTED, DOT) and the permute backward flag (GATHER_VALS).
    T, k, E, H, align = 21, 3, 4, 48, 8
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    row_index, tpe, _, offsets = kern.routing_metadata(indices, E, align)
    R = T * k + min(E, T * k) * (align - 1)
    x = torch.randn(T, H, device=DEVICE)
    row_w = torch.rand(R, device=DEVICE)
    dot_src = torch.randn(R, H, device=DEVICE)
    out, dots = kern.scatter_rows(
        x, row_index, R, offsets, tpe, row_weight=row_w, dot_src=dot_src, tail_lo=T * k
    )
    rows = row_index.long()
    want = torch.zeros(R, H, device=DEVICE)
    want[rows.reshape(-1)] = (x[:, None] * row_w[rows][..., None]).reshape(-1, H)
    torch.testing.assert_close(out, want)
    want_dots = torch.zeros(R, device=DEVICE)
    want_dots[rows.reshape(-1)] = (x[:, None] * dot_src[rows]).sum(-1).reshape(-1)
    torch.testing.assert_close(dots, want_dots)

    vals = torch.randn(R, device=DEVICE)
    summed, gathered = kern.gather_rows(out, row_index, row_vals=vals)
    torch.testing.assert_close(summed, ref.gather_rows_torch(out, row_index))
    torch.testing.assert_close(gathered, vals[rows])


def test_scatter_respects_num_rows():
    # Rows at or past R are never written, whatever row_index says (out_rows set too small).
    T, k, E, H = 8, 2, 2, 16
    indices = torch.zeros(T, k, dtype=torch.long, device=DEVICE)
    row_index, tpe, _, offsets = kern.routing_metadata(indices, E, 1)
    out, _ = kern.scatter_rows(torch.ones(T, H, device=DEVICE), row_index, 5, offsets, tpe)
    assert out.shape == (5, H) and bool((out == 1).all())


# ------------------------------------------------------------------------------------------------
# The benchmark's plumbing (it is run on the GPU by hand; these keep it from rotting unseen)
# ------------------------------------------------------------------------------------------------


def _load_benchmark(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_gpu_time_split_by_flush_marker():
    # GPU time per call = the device activities between two flush markers, the markers' own
    # durations excluded; events arrive unordered and activity before the first marker is dropped.
    bench = _load_benchmark("benchmark_permute")
    m = bench.FLUSH_MARKER
    events = [
        ("warm_kernel", 0.0, 5.0),
        (f"{m}_0d1d", 10.0, 110.0),
        ("_routing_hist_kernel", 111.0, 113.0),
        ("Memset (Device)", 113.0, 113.5),
        (f"{m}_0d1d", 200.0, 300.0),
        ("_scatter_rows_kernel", 300.0, 340.0),
        ("_routing_rows_kernel", 120.0, 127.5),  # out of order: belongs to the first call
    ]
    assert bench.per_call_us(events) == [2.0 + 0.5 + 7.5, 40.0]


def test_benchmark_permute_smoke(tmp_path):
    # The whole benchmark on tiny shapes: correctness check, copy, metadata, grid, JSON, table.
    import json

    bench = _load_benchmark("benchmark_permute")
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "permute_bench.json").read_text())
    assert out["summary"]["correctness_failures"] == [] and out["summary"]["failed_cells"] == {}
    cells = {(r["align"], r["op"], r["pass"]) for r in out["rows"] if r["ours_us"] is not None}
    assert len(cells) == 8  # align None and 16, both ops, both passes
    if torch.cuda.is_available():  # on a GPU the profiler's times must be there too
        assert all(r["gpu_us"] is not None for r in out["rows"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["scatter", "gather"])
def test_every_copy_config_candidate(kind, dtype):
    # The sweep (benchmarks/sweep_permute_kernels.py) times these configs, and the best one may
    # become the default: each must give the reference result with the flag sets the ops use.
    # T odd (a half-empty last program with 2 tokens per program), k = 3 (K_PAD = 4), H = 1100
    # (several 512/1024-wide chunks, the last one partial), dropped slots and padding rows.
    T, k, E, H, align = 13, 3, 5, 1100, 8
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    indices[::4, 1] = -1
    row_index, tpe, _, offsets = kern.routing_metadata(indices, E, align)
    R = T * k + min(E, T * k) * (align - 1)
    rows = row_index.long()
    keep = rows >= 0
    safe = torch.where(keep, rows, 0)
    x = torch.randn(T, H, device=DEVICE).to(dtype)
    src = torch.randn(R, H, device=DEVICE).to(dtype)
    slot_vals = torch.rand(T, k, device=DEVICE)
    row_w = torch.rand(R, device=DEVICE)
    cands = kern.copy_config_candidates(kind, k, H)
    assert next(iter(cands)) == "default" and cands["default"] == kern._copy_config(kind, k, H)
    assert len(set(cands.values())) == len(cands) >= 8  # no duplicates after fitting to H
    for name, cfg in cands.items():
        msg = f"{kind} candidate {name}: {cfg}"
        if kind == "scatter":
            # permute forward: rows and probs, padding and tail zeroed
            out, vals = kern.scatter_rows(
                x, row_index, R, offsets, tpe, slot_vals=slot_vals, config=cfg
            )
            want, want_vals = ref.scatter_rows_torch(x, row_index, R, slot_vals)
            torch.testing.assert_close(out, want, rtol=0, atol=0, msg=msg)
            torch.testing.assert_close(vals, want_vals, rtol=0, atol=0, msg=msg)
            # unpermute backward: rows scaled by their weight, the prob gradient as a dot
            out, dots = kern.scatter_rows(
                x, row_index, R, offsets, tpe, row_weight=row_w, dot_src=src, config=cfg
            )
            scaled = (x.float()[:, None] * row_w[safe][..., None]).to(dtype)
            want = torch.zeros(R, H, device=DEVICE, dtype=dtype)
            want[rows[keep]] = scaled[keep]
            want_dots = torch.zeros(R, device=DEVICE)
            want_dots[rows[keep]] = (x.float()[:, None] * src.float()[safe]).sum(-1)[keep]
            torch.testing.assert_close(out, want, rtol=0, atol=0, msg=msg)
            torch.testing.assert_close(dots, want_dots, rtol=1e-4, atol=1e-3, msg=msg)
        else:
            # unpermute forward: weighted sum in fp32
            out, _ = kern.gather_rows(src, row_index, row_weight=row_w, config=cfg)
            want = ref.gather_rows_torch(src, row_index, row_w)
            torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3, msg=msg)
            # permute backward: unweighted sum, the probs' gradient gathered alongside
            out, vals = kern.gather_rows(src, row_index, row_vals=row_w, config=cfg)
            want = ref.gather_rows_torch(src, row_index)
            torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3, msg=msg)
            want_vals = torch.where(keep, row_w[safe], 0.0)
            torch.testing.assert_close(vals, want_vals, rtol=0, atol=0, msg=msg)


def test_every_meta_config_candidate():
    # The sweep times these metadata variants (block size, warps, scan tiles); each must give the
    # reference result. N = 600 pairs: 5 blocks of 128, 3 of 256, 2 of 512 (the last ones partly
    # masked), one of 2048; dropped slots (−1) in most blocks.
    T, k, E, align = 200, 3, 13, 16
    indices = torch.randint(-1, E, (T, k), device=DEVICE)
    want = ref.routing_metadata_torch(indices, E, align)
    cands = kern.meta_config_candidates(T * k)
    assert next(iter(cands)) == "default" and cands["default"] == kern._meta_config(T * k)
    assert {c.block_n for c in cands.values()} >= {128, 256, 512, 2048}
    for name, cfg in cands.items():
        got = kern.routing_metadata(indices, E, align, config=cfg)
        for label, g, w in zip(("row_index", "tokens_per_expert", "counts", "offsets"), got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"{name} {cfg}: {label}")


def test_sweep_smoke(tmp_path):
    # The config sweep on tiny shapes (four candidates per kernel, copy section): every candidate
    # passes its check against the default and gets a time.
    import json

    sweep = _load_benchmark("sweep_permute_kernels")
    assert sweep.main(["--smoke", "--sections", "copy", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "permute_sweep.json").read_text())
    assert len(out["copy"]) == 2
    for shape in out["copy"]:
        assert set(shape["uses"]) == set(sweep.USES)
        for res in shape["uses"].values():
            # up to four per kernel (fewer where candidates coincide after fitting to H)
            assert res["errors"] == {} and 2 <= len(res["cells"]) <= 4
            assert res["default"] is not None and "default" in res["cells"]
