"""The expert-parallel token exchange (``moekit.ops.expert_exchange``).

Both backends against the oracle of ``moekit.reference.exchange`` (every rank draws every
rank's inputs from one seed, so each checks its own part): received rows, local ids and probs,
the combine's sums, and the gradients of both passes; rounds of uneven routing in one process
group (ranks that send or receive nothing, all tokens to one rank, dropped slots, one token),
so the barriers' epochs must stay in step. The all-to-all backend runs over gloo; the symmetric
backend's kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) across processes that
share file-backed buffers (``tests/_shared_pool.py``).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moekit.distributed import set_pool
from moekit.kernels.exchange import exchange_layout
from moekit.ops.expert_exchange import POOL_USE, ExpertExchange, exchange_routes
from moekit.reference.exchange import combine_ref, dispatch_ref
from tests._multiproc import finish_worker
from tests._shared_pool import SharedFilePool, make_files

H, K, E_LOCAL, MAX_T = 16, 3, 2, 9


def _round(i: int, world: int):
    """Every rank's (x, indices, probs) of round i: the token counts, the routing's skew and the
    dropped slots change from round to round."""
    gen = torch.Generator().manual_seed(1000 + i)
    E = world * E_LOCAL
    xs, ids, ps = [], [], []
    for r in range(world):
        T = [MAX_T, 1, 5 + r, 0 if r == 1 else 4][i % 4]
        idx = torch.randint(0, E, (T, K), generator=gen)
        if i % 4 == 1:
            idx[:] = torch.randint(0, E_LOCAL, (T, K), generator=gen)  # all to rank 0
        if i % 3 == 2:
            idx[torch.rand(T, K, generator=gen) < 0.3] = -1  # capacity-dropped slots
        xs.append(torch.randn(T, H, generator=gen))
        ids.append(idx)
        ps.append(torch.rand(T, K, generator=gen))
    return xs, ids, ps


def _one_round(rank, world, i, backend):
    xs, ids, ps = _round(i, world)
    x = xs[rank].clone().requires_grad_()
    p = ps[rank].clone().requires_grad_()
    ex = ExpertExchange(ids[rank], world * E_LOCAL, dist.group.WORLD, MAX_T, backend)
    rows, rprobs, rids = ex.dispatch(x, p)
    assert ex.backend == backend
    want_rows, want_ids, want_p = dispatch_ref(xs, ids, ps, E_LOCAL)[rank]
    n = want_rows.shape[0]
    assert rows.shape[0] == (world * MAX_T if backend == "symmetric" else n)
    assert torch.equal(rows[:n], want_rows)
    assert torch.equal(rids[:n], want_ids) and torch.equal(rprobs[:n], want_p)
    assert (rids[n:] == -1).all() and (rprobs[n:] == 0).all()  # the bound's tail routes nowhere
    # combine: each owner's rows for its received tokens (the tail must not matter)
    gen = torch.Generator().manual_seed(7 + i)
    parts = [torch.randn(dispatch_ref(xs, ids, ps, E_LOCAL)[d][0].shape[0], H, generator=gen)
             for d in range(world)]  # fmt: skip
    y = torch.full((rows.shape[0], H), float("nan"))
    y[:n] = parts[rank]
    y.requires_grad_()
    out = ex.combine(y)
    torch.testing.assert_close(out, combine_ref(parts, ids, E_LOCAL)[rank], rtol=0, atol=1e-6)
    # gradients: the combine's backward is the dispatch of dout, the dispatch's the combine of
    # the received rows' gradients
    gen = torch.Generator().manual_seed(70 + i)
    douts = [torch.randn(t.shape[0], H, generator=gen) for t in xs]
    g_rows = [torch.randn(dispatch_ref(xs, ids, ps, E_LOCAL)[d][0].shape[0], H, generator=gen)
              for d in range(world)]  # fmt: skip
    g_probs = [torch.randn(dispatch_ref(xs, ids, ps, E_LOCAL)[d][0].shape[0], K, generator=gen)
               for d in range(world)]  # fmt: skip
    (dy,) = torch.autograd.grad(out, y, douts[rank])
    torch.testing.assert_close(dy[:n], dispatch_ref(douts, ids, ps, E_LOCAL)[rank][0])
    gr = torch.zeros_like(rows)
    gr[:n] = g_rows[rank]
    gp = torch.zeros_like(rprobs)
    gp[:n] = g_probs[rank]
    gx, gpx = torch.autograd.grad([rows, rprobs], [x, p], [gr, gp])
    torch.testing.assert_close(gx, combine_ref(g_rows, ids, E_LOCAL)[rank], rtol=0, atol=1e-6)
    # a slot's prob gradient comes from its owner only (other owners hold it as 0, id −1)
    want_gp = combine_ref([torch.where(dispatch_ref(xs, ids, ps, E_LOCAL)[d][1] >= 0,
                                       g_probs[d], 0.0) for d in range(world)],
                          ids, E_LOCAL)[rank]  # fmt: skip
    torch.testing.assert_close(gpx, want_gp, rtol=0, atol=1e-6)


def _worker(rank, world, store, paths, backend, rounds):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if backend == "symmetric":
            nbytes = exchange_layout(world, MAX_T, H, 4, K).nbytes
            set_pool(SharedFilePool(dist.group.WORLD, paths, nbytes), use=POOL_USE)
        for i in range(rounds):
            _one_round(rank, world, i, backend)
        finish_worker()
    finally:
        dist.destroy_process_group()


def _spawn(world, backend, rounds):
    with tempfile.TemporaryDirectory() as d:
        nbytes = exchange_layout(world, MAX_T, H, 4, K).nbytes
        paths = make_files(d, world, nbytes)
        store = os.path.join(d, "store")
        mp.spawn(_worker, args=(world, store, paths, backend, rounds), nprocs=world, join=True)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_exchange_matches_reference(world):
    _spawn(world, "all_to_all", 6)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_symmetric_exchange_in_interpreter(world, interpret):
    if not interpret:
        pytest.skip("runs the cross-rank kernels in Triton's interpreter (TRITON_INTERPRET=1)")
    _spawn(world, "symmetric", 6)


def test_routes_example():
    """The example of ExchangeRoutes' docstring."""
    r = exchange_routes(torch.tensor([[0, 3], [1, 0], [2, -1]]), 2, 2)
    assert r.sends.tolist() == [2, 2]
    assert r.lists[:4].tolist() == [0, 1, 0, 2]
    assert r.rank_index.tolist() == [[0, 2], [1, -1], [-1, 3]]


def test_bad_input():
    class G:
        def size(self):
            return 2

        def rank(self):
            return 0

    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="divisible by the group size 2"):
        ExpertExchange(idx, 3, G(), 8)
    with pytest.raises(ValueError, match="more than max_tokens = 3"):
        ExpertExchange(idx, 4, G(), 3)
    with pytest.raises(ValueError, match="backend must be one of"):
        ExpertExchange(idx, 4, G(), 8, "nccl")
    ex = ExpertExchange(idx, 4, G(), 8, "all_to_all")
    with pytest.raises(ValueError, match="probs must have indices' shape"):
        ex.dispatch(torch.randn(4, 8), torch.rand(4, 3))
    with pytest.raises(ValueError, match=r"indices must be an integer \[T = 5"):
        ExpertExchange(idx, 4, G(), 8, "all_to_all").dispatch(torch.randn(5, 8), torch.rand(4, 2))
