"""``moekit_fusions``: Megatron-Core's fused permute and fused router run moekit's ops, checked
against Megatron's own unfused functions (``moe_utils.permute`` / ``unpermute`` /
``sort_chunks_by_idxs`` / ``topk_routing_with_score_function`` with ``fused=False``) on the same
inputs, forward and gradients, on CPU: dropless maps, tokens with fewer than k experts,
``num_out_tokens`` below the routed rows, idle experts, one token; every routing the router
swap takes; the declines; and that the block restores Megatron's functions and the flags."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
mg_fusions = pytest.importorskip("moekit.integrations.megatron.fusions")

from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

moekit_fusions = mg_fusions.moekit_fusions
T, E, H, K = 24, 6, 16, 2


def config(**kw) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E,
                moe_ffn_hidden_size=32, ffn_hidden_size=32, gated_linear_unit=True,
                activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                moe_router_topk=K, moe_token_dispatcher_type="alltoall",
                params_dtype=torch.float32)  # fmt: skip
    base.update(kw)
    return TransformerConfig(**base)


def routing(T: int, k: int, seed: int, fewer: bool = False, idle: int | None = None):
    """(tokens [T, H], probs [T, E], routing map [T, E]): k distinct experts a token (fewer for
    some tokens with ``fewer``, none of them expert ``idle``)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if idle is not None:
        scores[:, idle] = -1.0
    idx = scores.topk(k, dim=1).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, idx, True)
    if fewer:
        routing_map[::3, idx[::3, 0]] = False
    probs = torch.rand(T, E, generator=g) * routing_map
    return torch.randn(T, H, generator=g), probs, routing_map


def dispatch_round_trip(tokens, probs, routing_map, num_out, fused: bool):
    """Megatron's permute → rows · row probs · 3 → unpermute with the probs, its outputs and
    the gradients of tokens and probs."""
    tokens = tokens.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    rows, row_probs, mapping = moe_utils.permute(
        tokens, routing_map, probs=probs, num_out_tokens=num_out, fused=fused)[:3]  # fmt: skip
    mixed = rows * (3.0 * row_probs[:, None])
    out = moe_utils.unpermute(mixed, mapping, tokens.shape, probs=probs,
                              routing_map=routing_map, fused=fused)  # fmt: skip
    dy = torch.randn_like(out, generator=torch.Generator().manual_seed(5))
    ((out * dy).sum() + (row_probs * torch.arange(len(row_probs))).sum()).backward()
    return rows.detach(), row_probs.detach(), out.detach(), tokens.grad, probs.grad


@pytest.mark.parametrize(
    "case",
    [dict(), dict(fewer=True), dict(idle=3), dict(T=1), dict(k=1), dict(drop=5)],
    ids=["dropless", "fewer_than_k", "idle_expert", "one_token", "top1", "num_out_short"],
)
def test_permute_and_unpermute_match_megatrons(case):
    n, k = case.get("T", T), case.get("k", K)
    tokens, probs, routing_map = routing(n, k, 0, case.get("fewer", False), case.get("idle"))
    routed = int(routing_map.sum())
    num_out = routed - case.get("drop", 0)
    # Megatron's unfused permute has no num_out_tokens cut (0.16 ignores it, 0.19 keeps the
    # probs uncut): it permutes every routed row and the cut is made by hand
    want = dispatch_round_trip(tokens, probs, routing_map, routed, fused=False)
    if case.get("drop"):
        keep = num_out
        want = (want[0][:keep], want[1][:keep], *want[2:])
    with moekit_fusions(config(moe_router_topk=k, moe_router_pre_softmax=k == 1), router=False):
        got = dispatch_round_trip(tokens, probs, routing_map, num_out, fused=True)
    names = ("rows", "row probs", "tokens", "d tokens", "d probs")
    for name, a, b in zip(names, got, want, strict=True):
        if case.get("drop") and name in ("tokens", "d tokens", "d probs"):
            continue  # the unfused path keeps the cut rows; checked against the cut below
        torch.testing.assert_close(a, b, msg=name)
    if case.get("drop"):
        assert got[0].shape[0] == num_out


def test_pad_to_capacity_routes_a_token_to_more_than_k_experts():
    """moe_pad_expert_input_to_capacity: each expert takes its top-capacity tokens, so a token
    may go to more than moe_router_topk experts; every slot is kept, as Megatron's own
    drop-and-pad permute keeps it."""
    g = torch.Generator().manual_seed(8)
    tokens, probs = torch.randn(T, H, generator=g), torch.rand(T, E, generator=g)
    capacity = 6  # each expert's top-capacity tokens, as Megatron's router pads to capacity
    top = probs.topk(capacity, dim=0).indices
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(0, top, True)
    assert int(routing_map.sum(1).max()) > K and int(routing_map.sum()) == capacity * E
    probs = probs * routing_map
    want = dispatch_round_trip(tokens, probs, routing_map, capacity * E, fused=False)
    cfg = config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    with moekit_fusions(cfg, router=False):
        got = dispatch_round_trip(tokens, probs, routing_map, capacity * E, fused=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_token_past_topk_raises():
    tokens, probs, routing_map = routing(T, K + 1, 9)
    match = "more than moe_router_topk = 2 experts"
    with moekit_fusions(config(), router=False), pytest.raises(ValueError, match=match):
        moe_utils.permute(tokens, routing_map, probs=probs, num_out_tokens=T * K, fused=True)


def test_cut_rows_drop_their_slots():
    """num_out_tokens below the routed rows: the last rows of the expert order are dropped,
    and the unpermute sums only what is left (TransformerEngine's contract)."""
    tokens, probs, routing_map = routing(T, K, 1)
    num_out = int(routing_map.sum()) - 4
    with moekit_fusions(config(), router=False):
        rows, _, mapping = moe_utils.permute(tokens, routing_map, probs=probs,
                                             num_out_tokens=num_out, fused=True)[:3]  # fmt: skip
        out = moe_utils.unpermute(rows, mapping, tokens.shape, probs=probs, fused=True)
    full, _, full_map = moe_utils.permute(tokens, routing_map, probs=probs,
                                          num_out_tokens=int(routing_map.sum()))[:3]  # fmt: skip
    expert_of_row = routing_map.T.nonzero()[:, 0]
    kept = torch.zeros(T, E, dtype=torch.bool)
    kept[full_map[:num_out], expert_of_row[:num_out]] = True
    want = moe_utils.unpermute(full[:num_out], full_map[:num_out], tokens.shape,
                               probs=probs * kept, routing_map=kept)  # fmt: skip
    torch.testing.assert_close(rows, full[:num_out])
    torch.testing.assert_close(out, want)


def test_unweighted_unpermute_and_permute_without_probs():
    tokens, _, routing_map = routing(T, K, 2)
    num_out = int(routing_map.sum())
    want_rows, _, want_map = moe_utils.permute(tokens, routing_map, num_out_tokens=num_out)[:3]
    want = moe_utils.unpermute(want_rows * 2.0, want_map, tokens.shape)
    with moekit_fusions(config(), router=False):
        rows, row_probs, mapping = moe_utils.permute(
            tokens, routing_map, num_out_tokens=num_out, fused=True)[:3]  # fmt: skip
        out = moe_utils.unpermute(rows * 2.0, mapping, tokens.shape, fused=True)
    assert row_probs is None
    torch.testing.assert_close(rows, want_rows)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("with_probs", [False, True])
def test_sort_chunks_matches_megatrons(with_probs):
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([3, 0, 5, 2, 4, 1])
    order = torch.tensor([0, 3, 1, 4, 2, 5])
    x = torch.randn(int(sizes.sum()), H, generator=g, requires_grad=True)
    p = torch.rand(x.shape[0], generator=g, requires_grad=True) if with_probs else None

    def run(fused):
        out, out_p = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs=p, fused=fused)
        loss = (out * torch.arange(out.numel()).view_as(out)).sum()
        if out_p is not None:
            loss = loss + (out_p * torch.arange(len(out_p))).sum()
        grads = torch.autograd.grad(loss, [x] + ([p] if with_probs else []))
        return (out.detach(), None if out_p is None else out_p.detach(), *grads)

    want = run(False)
    with moekit_fusions(config(), router=False):
        got = run(True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


ROUTINGS = {
    "softmax": dict(),
    "pre_softmax_scaled": dict(use_pre_softmax=True, scaling_factor=2.5),
    "sigmoid_bias": dict(score_function="sigmoid", expert_bias=True),
    "sigmoid_top1": dict(score_function="sigmoid", topk=1),
    "sigmoid_groups": dict(score_function="sigmoid", expert_bias=True, num_groups=3, group_topk=1),
    "pre_softmax_groups": dict(use_pre_softmax=True, num_groups=3, group_topk=1),
}


@pytest.mark.parametrize("name", ROUTINGS)
def test_router_matches_megatrons(name):
    kw = dict(ROUTINGS[name])
    topk = kw.pop("topk", K)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    if kw.pop("expert_bias", False):
        kw["expert_bias"] = torch.randn(E, generator=g) * 0.1

    def run(fused):
        probs, routing_map = moe_utils.topk_routing_with_score_function(
            logits, topk, fused=fused, **kw)  # fmt: skip
        (d_logits,) = torch.autograd.grad((probs * torch.arange(T * E).view(T, E)).sum(), logits)
        return probs.detach(), routing_map, d_logits

    want = run(False)
    cfg = config(moe_router_topk=topk, moe_router_score_function=kw.get("score_function",
                 "softmax"), moe_router_pre_softmax=kw.get("use_pre_softmax", False),
                 moe_router_num_groups=kw.get("num_groups"),
                 moe_router_group_topk=kw.get("group_topk"),
                 moe_router_enable_expert_bias="expert_bias" in kw)  # fmt: skip
    with moekit_fusions(cfg, permute=False):
        got = run(True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_pieces_match_megatrons(score):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(T, E, generator=g, requires_grad=True)

    def run(fused):
        routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(
            logits, K, score, fused=fused)  # fmt: skip
        loss = moe_utils.switch_load_balancing_loss_func(
            scores, routing_map.sum(0), T, K, E, 0.01, fused=fused)  # fmt: skip
        return routing_map, scores.detach(), loss.detach(), torch.autograd.grad(loss, logits)[0]

    want = run(False)
    with moekit_fusions(config(moe_router_score_function=score), permute=False):
        got = run(True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(moe_router_score_function="sigmoid", moe_router_num_groups=3,
              moe_router_group_topk=3), "moe_router_topk = 2 \\* group_topk"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_pre_softmax"),
        (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
        (dict(moe_router_padding_for_quantization=True), "padding_for_quantization"),
    ],
    ids=["group_ratio", "groups_on_logits", "flex", "quant_padding"],
)  # fmt: skip
def test_declines_what_differs_and_changes_nothing(kw, match):
    cfg = config()
    for name, value in kw.items():  # set after the config's own checks, which refuse some
        setattr(cfg, name, value)
    before = moe_utils.fused_permute, moe_utils.HAVE_TE, cfg.moe_permute_fusion
    with pytest.raises(ValueError, match=match), moekit_fusions(cfg):
        pass
    assert (moe_utils.fused_permute, moe_utils.HAVE_TE, cfg.moe_permute_fusion) == before


def test_the_block_sets_and_restores_megatrons_state():
    cfg = config()
    before = {n: getattr(moe_utils, n) for n in ("fused_permute", "fused_topk_with_score_function",
                                                 "HAVE_TE")}  # fmt: skip
    with pytest.raises(KeyError), moekit_fusions(cfg) as same:
        assert same is cfg and cfg.moe_permute_fusion and cfg.moe_router_fusion
        assert moe_utils.HAVE_TE and moe_utils.fused_permute is not None
        with pytest.raises(RuntimeError, match="not re-entrant"), moekit_fusions(cfg):
            pass
        raise KeyError("an error inside the block")
    assert {n: getattr(moe_utils, n) for n in before} == before
    assert not cfg.moe_permute_fusion and not cfg.moe_router_fusion
    with pytest.raises(TypeError, match="TransformerConfig"), moekit_fusions(object()):
        pass
