"""Sequence-aware placement and its cost model: coverage, equal token counts, balance, locality, bad input.

Fast (no processes): ``.venv/bin/python -m pytest tests/test_placement.py -q``.
"""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.sequence.cost_model import CostModel, block_area, causal_area
from megatron_hsap.sequence.doc_lengths import bimodal_doc_lengths, sample_doc_lengths
from megatron_hsap.sequence.layouts import check_layout
from megatron_hsap.sequence.placement import sequence_aware_placement
from megatron_hsap.sequence.placement_config import PlacementConfig

Segment = Tuple[int, int, int]


def _place(lengths: Sequence[int], ring: int, ulysses: int, members_per_node: int,
           extra: int = 0, placement: Optional[PlacementConfig] = None) -> List[List[Segment]]:
    cp = ring * ulysses
    tokens_per_rank = -(-sum(lengths) // cp) + extra
    segments = sequence_aware_placement(lengths, ring_size=ring, ulysses_size=ulysses,
                                        ring_members_per_node=members_per_node, tokens_per_rank=tokens_per_rank,
                                        placement=placement)
    assert len(segments) == cp
    check_layout(segments, lengths, tokens_per_rank)  # every token exactly once, no rank over capacity
    counts = [sum(e - s for _, s, e in rank) for rank in segments]
    total = sum(lengths)
    # Equal tokens per rank; the only padding is at the tail of the last ranks.
    assert counts == [min(tokens_per_rank, max(0, total - c * tokens_per_rank)) for c in range(cp)]
    return segments


def _members_of_docs(segments: List[List[Segment]], ulysses: int) -> Dict[int, Set[int]]:
    where: Dict[int, Set[int]] = {}
    for c, rank in enumerate(segments):
        for doc, _, _ in rank:
            where.setdefault(doc, set()).add(c // ulysses)
    return where


def _member_area(segments: List[List[Segment]], ring: int, ulysses: int) -> List[int]:
    area = [0] * ring
    for c, rank in enumerate(segments):
        area[c // ulysses] += sum(causal_area(s, e) for _, s, e in rank)
    return area


def _member_cost(segments: List[List[Segment]], ring: int, ulysses: int, model: CostModel) -> List[float]:
    cost = [0.0] * ring
    for c, rank in enumerate(segments):
        cost[c // ulysses] += sum(model.segment_cost(s, e) for _, s, e in rank)
    return cost


def _imbalance(values: Sequence[float]) -> float:
    return max(values) / (sum(values) / len(values))


# ---- cost model ---------------------------------------------------------------------------------

def test_block_area_matches_brute_force() -> None:
    for q0, q1, k0, k1 in itertools.product(range(7), repeat=4):
        for causal in (True, False):
            expected = sum(1 for q in range(q0, q1) for k in range(k0, k1) if k <= q or not causal)
            assert block_area(q0, q1, k0, k1, causal) == expected, (q0, q1, k0, k1, causal)
        if q1 >= q0:
            assert causal_area(q0, q1) == sum(q + 1 for q in range(q0, q1))


def test_cost_model_defaults_are_llama3_8b() -> None:
    model = CostModel()
    assert model.pair_flops == 4 * 32 * 128
    # Q (4096x4096), K and V (4096x1024 each), O (4096x4096), SwiGLU MLP (3 x 4096x14336); 2 FLOPs per weight.
    assert model.token_flops == 2 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert model.linear_weight == model.token_flops / model.pair_flops
    assert model.attention_flops(10) == 10 * model.pair_flops
    assert model.flops(10, 3) == 10 * model.pair_flops + 3 * model.token_flops
    assert model.segment_cost(5, 9) == causal_area(5, 9) + 4 * model.linear_weight


@pytest.mark.parametrize("field", ["num_heads_q", "num_heads_kv", "head_dim", "hidden_size", "ffn_hidden_size"])
def test_cost_model_rejects_non_positive_sizes(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CostModel(**{field: 0})


# ---- placement: structure -------------------------------------------------------------------------

LAYOUTS = [  # (ring_size, ulysses_size, ring_members_per_node)
    (1, 8, 1), (2, 8, 1), (4, 8, 1), (8, 1, 8), (16, 1, 8), (4, 2, 2), (3, 1, 1), (6, 1, 3),
]


@pytest.mark.parametrize("ring,ulysses,per_node", LAYOUTS)
def test_many_short_documents_are_never_split(ring: int, ulysses: int, per_node: int) -> None:
    rng = random.Random(ring * 100 + ulysses)
    lengths = [rng.randint(1, 300) for _ in range(1500)] + [rng.randint(1, 8) for _ in range(200)]
    rng.shuffle(lengths)
    segments = _place(lengths, ring, ulysses, per_node)
    split = {doc for doc, members in _members_of_docs(segments, ulysses).items() if len(members) > 1}
    assert split == set()


@pytest.mark.parametrize("ring,ulysses,per_node", LAYOUTS)
def test_zero_and_one_token_documents(ring: int, ulysses: int, per_node: int) -> None:
    lengths = [0, 1, 0, 0, 1, 5, 0, 1, 1, 17, 0, 1, 0]
    _place(lengths, ring, ulysses, per_node)
    _place([0, 0, 0], ring, ulysses, per_node)  # an empty batch: every rank is padding
    _place([1], ring, ulysses, per_node, extra=3)


@pytest.mark.parametrize("balance", ["tight", "traffic"])
@pytest.mark.parametrize("ring,ulysses,per_node", LAYOUTS + [(32, 1, 8), (5, 1, 1)])
def test_one_document_spanning_everything_is_causally_balanced(ring: int, ulysses: int, per_node: int,
                                                               balance: str) -> None:
    for tokens_per_rank in (1000, 997):
        length = ring * ulysses * tokens_per_rank
        segments = _place([length], ring, ulysses, per_node, placement=PlacementConfig(balance=balance))
        area = _member_area(segments, ring, ulysses)
        assert sum(area) == causal_area(0, length)
        if balance == "tight":  # every bisection cuts it so that both sides end within 0.1 % of their targets
            assert max(area) / min(area) <= 1.01, area
        else:  # the bisections between nodes may spend the 2 % the attention target allows
            assert _imbalance(area) <= 1.02, area
        # Few pieces per rank (each cut gives one side a middle piece, the other a head and a tail).
        for c, rank in enumerate(segments):
            assert len(rank) <= 4, (c, rank)


def test_documents_that_fit_a_node_stay_inside_it() -> None:
    # Pure ring, 2 nodes x 8 ranks: medium documents, none heavy enough to need a cut for balance.
    rng = random.Random(7)
    lengths = [rng.randint(200, 3000) for _ in range(300)] + [rng.randint(1, 20) for _ in range(100)]
    segments = _place(lengths, 16, 1, 8)
    nodes = {doc: {m // 8 for m in members} for doc, members in _members_of_docs(segments, 1).items()}
    assert all(len(n) == 1 for n in nodes.values()), {d: n for d, n in nodes.items() if len(n) > 1}


def test_document_longer_than_a_member_stays_inside_its_node() -> None:
    # Pure ring, 2 nodes x 8 members of 2048 tokens: a 3000-token document carries ~3.5 members' share of the
    # attention, so it is cut over several members -- all of them on one node.
    rng = random.Random(3)
    lengths = [3000]
    while sum(lengths) < 16 * 2048:
        lengths.append(min(rng.randint(300, 1500), 16 * 2048 - sum(lengths)))
    segments = _place(lengths, 16, 1, 8)
    members = _members_of_docs(segments, 1)
    assert len(members[0]) >= 3 and len({m // 8 for m in members[0]}) == 1, members[0]
    assert _imbalance(_member_cost(segments, 16, 1, CostModel())) <= 1.05


# ---- placement: balance ---------------------------------------------------------------------------

@pytest.mark.parametrize("total", [1 << 20, 4 << 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ring,ulysses,per_node", [(2, 8, 1), (4, 8, 1), (8, 1, 8), (16, 1, 8)])
def test_long_tail_batches_are_balanced(total: int, seed: int, ring: int, ulysses: int, per_node: int) -> None:
    lengths = sample_doc_lengths(total, seed=seed)
    segments = _place(lengths, ring, ulysses, per_node)
    model = CostModel()
    assert _imbalance(_member_cost(segments, ring, ulysses, model)) <= 1.05


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_balance_and_locality_at_1m_on_2x8(seed: int) -> None:
    # The target layout: 2 nodes x 8 ranks, Ulysses inside the node.
    lengths = sample_doc_lengths(1 << 20, seed=seed)
    segments = _place(lengths, 2, 8, 1)
    assert _imbalance(_member_area(segments, 2, 8)) <= 1.05
    members = _members_of_docs(segments, 8)
    crossing = [doc for doc, m in members.items() if len(m) > 1]
    # Only documents that carry a noticeable part of the attention, plus at most one filler cut, cross nodes.
    total_area = sum(causal_area(0, n) for n in lengths)
    light = [doc for doc in crossing if causal_area(0, lengths[doc]) < 0.005 * total_area]
    assert len(light) <= 1 and len(crossing) <= 3, crossing


def test_padded_member_holds_a_full_members_attention_on_denser_documents() -> None:
    # 2 members of 40000 slots; the batch leaves 1000 padding slots on the last member. The attention target is on
    # attention alone: the padded member holds as much as the full one, on fewer (so denser) tokens, whatever the
    # cost model says its missing tokens' linear work is worth.
    rng = random.Random(11)
    lengths: List[int] = []
    while sum(lengths) < 79000:
        lengths.append(min(rng.randint(500, 4000), 79000 - sum(lengths)))

    def member_areas(model: CostModel) -> List[int]:
        segments = sequence_aware_placement(lengths, ring_size=2, ulysses_size=1, ring_members_per_node=1,
                                            tokens_per_rank=40000, cost_model=model)
        check_layout(segments, lengths, 40000)
        return _member_area(segments, 2, 1)

    padded = member_areas(CostModel())
    assert _imbalance(padded) <= 1.02
    assert padded[1] / 39000 > padded[0] / 40000  # denser
    assert member_areas(CostModel(hidden_size=1, ffn_hidden_size=1, num_heads_q=1, num_heads_kv=1, head_dim=1)) \
        == padded


# ---- placement: properties --------------------------------------------------------------------------

def _layouts_up_to_8() -> List[Tuple[int, int, int]]:
    out = []
    for cp in range(1, 9):
        for nodes in (1, 2, 4):
            if cp % nodes:
                continue
            per_node = cp // nodes
            out.extend((cp // u, u, per_node // u) for u in range(1, per_node + 1) if per_node % u == 0)
    return out


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 1), st.integers(0, 40), st.integers(0, 500)), max_size=40),
       layout=st.sampled_from(_layouts_up_to_8()), extra=st.sampled_from([0, 0, 1, 5]))
def test_placement_properties(lengths: List[int], layout: Tuple[int, int, int], extra: int) -> None:
    ring, ulysses, per_node = layout
    first = _place(lengths, ring, ulysses, per_node, extra)
    assert first == _place(list(lengths), ring, ulysses, per_node, extra)  # deterministic
    # Inside a rank a document's pieces are merged: no two adjacent segments of one document.
    for rank in first:
        for (d0, _, e0), (d1, s1, _) in zip(rank, rank[1:]):
            assert not (d0 == d1 and e0 == s1), rank


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(ring_size=0), "ring_size"),
    (dict(ulysses_size=-1), "ulysses_size"),
    (dict(ring_members_per_node=0), "ring_members_per_node"),
    (dict(tokens_per_rank=-1), "tokens_per_rank"),
    (dict(tokens_per_rank=3), "tokens_per_rank"),  # 2 ranks x 3 < 10 tokens
    (dict(ring_size=1.5), "ring_size"),
])
def test_bad_sizes_raise_value_error_naming_the_argument(kwargs: dict, name: str) -> None:
    args = dict(ring_size=2, ulysses_size=1, ring_members_per_node=1, tokens_per_rank=5)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        sequence_aware_placement([4, 6], **args)


@pytest.mark.parametrize("lengths,index", [([3, -1, 2], 1), ([2.5], 0), ([True, 1], 0)])
def test_bad_document_lengths_raise_value_error(lengths: list, index: int) -> None:
    with pytest.raises(ValueError, match=rf"doc_lengths\[{index}\]"):
        sequence_aware_placement(lengths, ring_size=1, ulysses_size=1, ring_members_per_node=1, tokens_per_rank=10)


# ---- v2: balance gates on heavy-tailed batches, traffic formula, prefix division, zigzag, lower bound ----------

from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence import placement as placement_module  # noqa: E402
from megatron_hsap.sequence import analysis as analysis_module  # noqa: E402
from megatron_hsap.sequence.analysis import inter_node_rows_lower_bound, two_node_rows_lower_bound  # noqa: E402
from megatron_hsap.sequence.doc_lengths import (  # noqa: E402
    bimodal_doc_lengths, cu_seqlens_from_lengths, lognormal_doc_lengths, pack_lengths)
from megatron_hsap.sequence.plan import needed_rows, plan_batch  # noqa: E402
from megatron_hsap.sequence.schedule import member_pieces  # noqa: E402
from tests.stdlib_corpus import stdlib_3_11_doc_lengths  # noqa: E402


def _heavy_tailed(seed: int) -> List[int]:
    """1M tokens of Python 3.11's standard library files (bytes as tokens): a few documents of several 100K
    tokens (frozen sizes, so every Python draws the same batches: tests/stdlib_corpus.py)."""
    corpus = stdlib_3_11_doc_lengths()
    return pack_lengths(corpus, 1 << 20, offset=(seed * 7919) % len(corpus))


@pytest.mark.parametrize("nodes,per_node", [(2, 8), (4, 8), (4, 4)])
@pytest.mark.parametrize("mix", ["stdlib", "lognormal"])
def test_attention_balanced_within_2_percent_on_heavy_tailed_batches(nodes: int, per_node: int, mix: str) -> None:
    topo = CPTopology.offline(nodes * per_node, per_node, per_node)
    for seed in range(4):
        lengths = _heavy_tailed(seed) if mix == "stdlib" else lognormal_doc_lengths(1 << 20, seed=seed)
        stats = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware").stats(32, 8, 128)
        assert stats.flops_imbalance <= 1.02, (seed, stats.flops_imbalance)
        assert stats.padding_tokens == [0] * topo.cp_size and len(set(stats.tokens)) == 1
        # One member per node: forwarding changes nothing. Never below the lower bound with token capacities
        # at the balance reached (a member is a node here).
        inter = sum(stats.send_bytes_inter)
        assert sum(stats.recv_bytes_inter_forwarded) == inter
        bound = inter_node_rows_lower_bound(lengths, nodes, stats.flops_imbalance, (1 << 20) // nodes)
        assert inter >= bound * 2 * 8 * 128 * 2


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 200), members=st.integers(2, 5), data=st.data())
def test_horizon_formula_matches_the_schedules_needed_rows(length: int, members: int, data) -> None:
    """A document split anyhow over members moves, summed over every holder but the one holding its last
    token, that holder's last position + 1 -- exactly what the schedule's needed rows add up to."""
    cuts = sorted(set(data.draw(st.lists(st.integers(1, length - 1), max_size=6)) if length > 1 else []))
    bounds = [0] + cuts + [length]
    owners = [data.draw(st.integers(0, members - 1)) for _ in bounds[1:]]
    rank_segments: List[List[Segment]] = [[] for _ in range(members)]
    for owner, s, e in zip(owners, bounds, bounds[1:]):
        rank_segments[owner].append((0, s, e))
    pieces = member_pieces(rank_segments, length, 1)
    moved = sum(needed_rows(pieces[a], pieces[b], True) for a in range(members) for b in range(members) if a != b)
    last_holder = owners[-1]
    horizons = {owner: e for owner, e in zip(owners, bounds[1:])}  # segments are in order: the last one wins
    assert moved == sum(h for owner, h in horizons.items() if owner != last_holder)


@settings(max_examples=80, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 40)), min_size=1, max_size=3), data=st.data())
def test_prefix_division_hits_the_area_at_the_smallest_horizon(ranges, data) -> None:
    # An item: increasing disjoint ranges of one document (gap, length) pairs.
    spans, position = [], 0
    for gap, n in ranges:
        spans.append((position + gap, position + gap + n))
        position += gap + n
    item = placement_module._Item(0, tuple(spans))
    tau = data.draw(st.integers(1, item.length))
    least = item.area_before(tau)
    most = item.area - item.area_before(item.length - tau)
    area = data.draw(st.integers(least, most))
    horizon = placement_module._horizon_for(item, tau, area)
    assert horizon is not None and tau <= horizon <= item.length

    def densest(x: int) -> int:  # the most area tau tokens ending at stream offset x can carry
        return item.area_before(x) - item.area_before(x - tau)

    assert densest(horizon) >= area and (horizon == tau or densest(horizon - 1) < area)
    start = horizon - tau  # the piece the placement cuts: the densest tau tokens below the horizon
    piece = item.sub(start, start + tau)
    assert piece.length == tau
    # The least area >= the requested one: one token earlier would fall short (areas grow with the start).
    assert piece.area >= area and (start == 0 or item.area_before(start - 1 + tau) - item.area_before(start - 1) < area)


def test_a_dominant_document_is_cut_once_with_a_middle_piece() -> None:
    # One document holds ~80 % of the area and is longer than a node: the node not holding its last token
    # gets one middle piece [p, p + tau) so that tokens and area both come out exact, for `p + tau` rows.
    rng = random.Random(5)
    lengths = [300_000]
    while sum(lengths) < 2 * 262_144:
        lengths.append(min(rng.randint(100, 3000), 2 * 262_144 - sum(lengths)))
    segments = _place(lengths, 2, 8, 1)
    area = _member_area(segments, 2, 8)
    assert max(area) / min(area) <= 1.005
    where = _members_of_docs(segments, 8)
    assert sorted(d for d, m in where.items() if len(m) > 1) == [0]
    holder_pieces = [[(s, e) for c in range(m * 8, m * 8 + 8) for d, s, e in segments[c] if d == 0] for m in (0, 1)]
    last = next(m for m in (0, 1) if any(e == lengths[0] for _, e in holder_pieces[m]))
    other = _merge_ranges(holder_pieces[1 - last])
    assert len(other) == 1  # one contiguous piece; its end is the only traffic
    cu = cu_seqlens_from_lengths(lengths)
    stats = plan_batch(cu, CPTopology.offline(16, 8, 8), "sequence-aware").stats(32, 8, 128)
    assert sum(stats.send_bytes_inter) == other[0][1] * 2 * 8 * 128 * 2


def _merge_ranges(ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for s, e in sorted(ranges):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 300), min_size=1, max_size=30),
       shape=st.sampled_from([(2, 1), (4, 1), (4, 2), (6, 3), (8, 4), (8, 2), (16, 8), (16, 1)]))
def test_zigzag_is_pad_free_and_few_ranges_per_member(lengths: List[int], shape: Tuple[int, int]) -> None:
    cp, ulysses = shape
    lengths = lengths + [(-sum(lengths)) % cp]  # a total divisible by the CP size: no padding at all
    plan = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(cp, ulysses, cp), "zigzag")
    stats = plan.stats(ulysses, ulysses, 4, torch.float32)
    assert stats.padding_tokens == [0] * cp and len(set(stats.tokens)) == 1
    ring = cp // ulysses
    pieces = member_pieces(plan.rank_segments, plan.tokens_per_rank, ulysses)
    for member in range(ring):
        for doc, doc_pieces in pieces[member].items():
            # After the all-to-all a document is one or two contiguous ranges of the member buffer.
            assert len(doc_pieces) <= 2, (member, doc, doc_pieces)
    for doc, n in enumerate(lengths):  # chunk sizes differ by at most one token
        shares = [sum(e - s for _, s, e in pieces[m].get(doc, [])) for m in range(ring)]
        assert sum(shares) == n and max(shares) - min(shares) <= 2


def test_lower_bound_counts_only_area_beyond_one_node() -> None:
    assert inter_node_rows_lower_bound([100, 100], 2) == 0
    assert inter_node_rows_lower_bound([1000], 1) == 0
    # One document over 2 nodes: the non-last node must hold half its area below its horizon h.
    total = causal_area(0, 1000)
    h = inter_node_rows_lower_bound([1000], 2)
    assert causal_area(0, h) >= total / 2 > causal_area(0, h - 1)
    # Over 4 nodes, three holders: horizons for 3/4, 2/4 and 1/4 of the area.
    expected = sum(next(x for x in range(1001) if causal_area(0, x) >= total * k / 4) for k in (1, 2, 3))
    assert inter_node_rows_lower_bound([1000], 4) == expected
    with pytest.raises(ValueError, match="num_nodes"):
        inter_node_rows_lower_bound([10], 0)
    with pytest.raises(ValueError, match="imbalance"):
        inter_node_rows_lower_bound([10], 2, imbalance=0.5)


def test_plan_batch_passes_the_cost_model_through(monkeypatch) -> None:
    seen = []
    real = placement_module.sequence_aware_table

    def spy(*args, **kwargs):
        seen.append(kwargs["cost_model"])
        return real(*args, **kwargs)

    monkeypatch.setattr(placement_module, "sequence_aware_table", spy)
    cu = cu_seqlens_from_lengths([3001, 17, 4242, 999])  # lengths no other test plans: not cached yet
    topo = CPTopology.offline(4, 1, 2)
    tiny = CostModel(hidden_size=1, ffn_hidden_size=1, num_heads_q=1, num_heads_kv=1, head_dim=1)
    default = plan_batch(cu, topo, "sequence-aware")
    assert plan_batch(cu, topo, "sequence-aware", cost_model=CostModel())._data is default._data  # same entry
    light = plan_batch(cu, topo, "sequence-aware", cost_model=tiny)
    assert light._data is not default._data
    assert seen == [None, tiny]
    assert plan_batch(cu, topo, "zigzag", cost_model=tiny)._data is plan_batch(cu, topo, "zigzag")._data
    with pytest.raises(ValueError, match="cost_model"):
        plan_batch(cu, topo, "sequence-aware", cost_model="llama")


def _fewest_rows_by_brute_force(lengths: List[int], nodes: int, node_tokens: int, imbalance: float) -> Optional[int]:
    """Fewest inter-node key/value rows over every assignment of tokens to nodes within the caps (horizon
    formula per document), or None when no assignment meets them."""
    tokens = [(d, p) for d, n in enumerate(lengths) for p in range(n)]
    cap = imbalance * sum(causal_area(0, n) for n in lengths) / nodes
    best = None
    for assign in itertools.product(range(nodes), repeat=len(tokens)):
        count, area = [0] * nodes, [0] * nodes
        for (_, p), x in zip(tokens, assign):
            count[x] += 1
            area[x] += p + 1
        if max(count) > node_tokens or max(area) > cap + 1e-9:
            continue
        rows, i = 0, 0
        for n in lengths:
            owners, i = assign[i:i + n], i + n
            horizons = {x: p + 1 for p, x in enumerate(owners)}
            rows += sum(h for x, h in horizons.items() if n and x != owners[-1])
        best = rows if best is None else min(best, rows)
    return best


def test_lower_bound_with_token_capacities_is_a_true_bound_by_brute_force() -> None:
    rng = random.Random(0)
    tighter = uncapped_cases = 0
    for _ in range(80):
        nodes = rng.choice([2, 2, 3])
        limit = 9 if nodes == 2 else 6
        lengths = [rng.randint(0, limit) for _ in range(rng.randint(1, 3))]
        while sum(lengths) > limit:
            lengths[rng.randrange(len(lengths))] //= 2
        if not sum(lengths):
            continue
        node_tokens = -(-sum(lengths) // nodes) + rng.choice([0, 0, 1])
        imbalance = rng.choice([1.0, 1.1, 1.25, 1.5, 2.0])
        bound = inter_node_rows_lower_bound(lengths, nodes, imbalance, node_tokens)
        free = inter_node_rows_lower_bound(lengths, nodes, imbalance)
        assert bound >= free
        best = _fewest_rows_by_brute_force(lengths, nodes, node_tokens, imbalance)
        if best is not None:
            assert bound <= best, (lengths, nodes, node_tokens, imbalance)
            tighter += bound > free
        # Capacity-free: a bound for any token counts (what plan_report's zigzag verdict reads).
        uncapped = _fewest_rows_by_brute_force(lengths, nodes, sum(lengths), imbalance)
        if uncapped is not None:
            assert free <= uncapped, (lengths, nodes, imbalance)
            uncapped_cases += 1
    assert tighter >= 5  # the capacities matter on some of these cases
    assert uncapped_cases >= 40
    with pytest.raises(ValueError, match="node_tokens"):
        inter_node_rows_lower_bound([10, 10], 2, node_tokens=9)


def test_lower_bound_charges_the_documents_a_node_must_take_partly() -> None:
    # Two nodes of 6 tokens: the 4-token document's node must take 2 more tokens of area <= 2 (the cap is
    # 12.5 - 10); only the heads of other documents are that sparse, and a head taken alone moves its rows.
    cases = [([4, 3, 2, 2], 2, 6), ([3, 3, 4], 2, 5), ([4, 2, 2, 3], 2, 6)]
    for lengths, nodes, node_tokens in cases:
        best = _fewest_rows_by_brute_force(lengths, nodes, node_tokens, 1.0)
        assert inter_node_rows_lower_bound(lengths, nodes, 1.0, node_tokens) == best == 1
        # The terms without the charges.
        assert inter_node_rows_lower_bound(lengths, nodes, 1.0, node_tokens, charged_candidates=0) == 0
    # At scale (a 105K-token file in 1M tokens on 4 nodes of 262K): its node must also take ~157K tokens of
    # area at most 2.5 % of a node's; the sparsest positions of all documents have it, whole documents do not.
    lengths = _heavy_tailed(9)
    charged = inter_node_rows_lower_bound(lengths, 4, 1.0, 1 << 18)
    assert charged > 2 * inter_node_rows_lower_bound(lengths, 4, 1.0, 1 << 18, charged_candidates=0)
    # A term the capacity bound leaves at 0 is charged too: an 81K-token file of 1.9 node areas in 1M tokens on
    # 8 nodes fits two nodes by area, but their 262K tokens cannot be filled that sparsely with whole documents.
    lengths = _heavy_tailed(7)
    d, cap = lengths.index(80823), sum(causal_area(0, n) for n in lengths) / 8
    counted = [e for e, n in enumerate(lengths) if causal_area(0, n) > cap]
    two_nodes = analysis_module._charged_horizons((d,), (0,), lengths, counted, 2 << 17, 2 * cap)
    assert analysis_module._capacity_horizon(d, 2, lengths, 8, 1 << 17, 2 * cap,
                                             analysis_module._Sparsest(lengths)) == 0 < 10_000 < two_nodes
    bound = inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17)
    assert bound >= inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17, charged_candidates=0) + two_nodes


def test_lower_bound_shares_the_charged_rows_among_several_terms() -> None:
    # stdlib batch 33 on 8 nodes: terms k = 1..4 of its 107K-token file each gain from the charges. Charging the
    # other documents' rows in shares (summing to 1) to several terms beats charging them to the best term alone,
    # and the bound stays below what the placement moves at the balance it reaches.
    lengths = _heavy_tailed(33)
    shared = inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17)
    # Whole shares: one term charged.
    assert shared > inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17, shares=1) + 10_000
    stats = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(64, 8, 8), "sequence-aware").stats(32, 8, 128)
    assert sum(stats.send_bytes_inter) >= inter_node_rows_lower_bound(lengths, 8, stats.flops_imbalance, 1 << 17) * 4096


def test_lower_bound_pairs_two_documents_competing_for_sparse_tokens() -> None:
    # Lognormal batch 3 on 8 nodes: files of 144K and 122K tokens need 4 and 3 nodes' area, and those 7 nodes
    # must also take ~650K tokens of little area; each document's terms alone give it the batch's sparsest
    # tokens, the pair's term shares them (one term of each, on the union of their nodes).
    lengths = lognormal_doc_lengths(1 << 20, seed=3)
    paired = inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17)
    assert paired > inter_node_rows_lower_bound(lengths, 8, 1.0, 1 << 17, paired_candidates=0) + 30_000
    stats = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(64, 8, 8), "sequence-aware").stats(32, 8, 128)
    assert sum(stats.send_bytes_inter) >= inter_node_rows_lower_bound(lengths, 8, stats.flops_imbalance, 1 << 17) * 4096


@pytest.mark.parametrize("layout", ["sequence-aware", "zigzag", "contiguous"])
@pytest.mark.parametrize("cp,ulysses,per_node", [(8, 1, 4), (8, 2, 4), (6, 1, 3), (4, 2, 2)])
def test_forwarded_bytes_count_each_remote_row_once_per_node(layout: str, cp: int, ulysses: int,
                                                              per_node: int) -> None:
    rng = random.Random(cp * 100 + ulysses * 10 + per_node)
    topo = CPTopology.offline(cp, ulysses, per_node)
    for _ in range(3):
        lengths = [rng.choice([1, 5, 40, 200]) for _ in range(rng.randint(1, 8))]
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, layout)
        stats = plan.stats(4, 4, 2, torch.float32)
        row_bytes = 2 * 4 * 2 * 4  # k and v, 4 KV heads, head_dim 2, fp32: all Ulysses ranks together
        holder: Dict[Tuple[int, int], int] = {}  # (doc, position) -> node
        for c, segments in enumerate(plan.rank_segments):
            for doc, s, e in segments:
                for p in range(s, e):
                    holder[(doc, p)] = topo.node_of_cp_rank[c]
        nodes = sorted(set(topo.node_of_cp_rank))
        expected = []
        for node in nodes:
            last_query = {}  # doc -> the node's latest query position
            for (doc, p), where in holder.items():
                if where == node:
                    last_query[doc] = max(last_query.get(doc, -1), p)
            rows = sum(1 for (doc, p), where in holder.items() if where != node and p <= last_query.get(doc, -1))
            expected.append(rows * row_bytes)
        assert stats.recv_bytes_inter_forwarded == expected
        assert sum(expected) <= sum(stats.recv_bytes_inter)
        if per_node == ulysses:  # one member per node
            assert sum(expected) == sum(stats.recv_bytes_inter)


def test_a_bisection_error_is_shared_by_the_bins_below_it() -> None:
    """Pure ring 2 x 8 on the stdlib batch whose node split misses by 0.3 %: with targets rescaled to what
    each side received, the 8 members of a node share it (one of them was 2.2 % over before)."""
    topo = CPTopology.offline(16, 1, 8)
    stats = plan_batch(cu_seqlens_from_lengths(_heavy_tailed(12)), topo, "sequence-aware").stats(32, 8, 128)
    assert stats.flops_imbalance <= 1.01, stats.flops_imbalance


def test_whole_document_items_match_the_general_path() -> None:
    # `_Item.whole` skips the general constructor for the batch's documents; every field, the density sort key
    # above all, must be what the general path computes.
    for doc, length in [(0, 1), (1, 2), (7, 3), (2, 1000), (5, 131072), (9, 999_983), (3, 1 << 20)]:
        fast, general = placement_module._Item.whole(doc, length), placement_module._Item(doc, ((0, length),))
        assert [getattr(fast, f) for f in placement_module._Item.__slots__ if f != "_areas"] == \
            [getattr(general, f) for f in placement_module._Item.__slots__ if f != "_areas"]


def test_few_items_between_nodes_are_split_by_trying_every_subset() -> None:
    # Every result fills both sides exactly, within the slack of the targets, with at most one cut; over many
    # random bisections it moves fewer rows than the greedy one (which cuts again when a cut left a side at
    # the edge of feasibility).
    rng = random.Random(3)
    exhaustive = greedy = 0
    for _ in range(60):
        lengths = [rng.choice([rng.randint(1, 300), rng.randint(300, 3000)]) for _ in range(rng.randint(2, 12))]
        items = [placement_module._Item(d, ((0, n),)) for d, n in enumerate(lengths)]
        total = sum(lengths)
        rooms = (total // 2 + rng.randint(-total // 8, total // 8), 0)
        rooms = (rooms[0], total - rooms[0])
        area = sum(it.area for it in items)
        targets = (area * rooms[0] / total, area * rooms[1] / total)
        slack = placement_module._Bisection(items, rooms, targets, PlacementConfig(), True).slack
        sides = placement_module._exhaustive_bisection(items, rooms, targets, slack)
        plain = placement_module._bisect_items(items, rooms, targets, True, PlacementConfig(exhaustive=0, reopened=0))
        if sides is None:
            continue
        assert [sum(it.length for it in side) for side in sides] == list(rooms)
        for side, target in zip(sides, targets):
            assert abs(sum(it.area for it in side) - target) <= slack + max(lengths)
        assert len({it.doc for it in sides[0]} & {it.doc for it in sides[1]}) <= 1
        exhaustive += placement_module._cut_rows(sides)
        greedy += placement_module._cut_rows(plain)
    assert exhaustive < greedy, (exhaustive, greedy)
    # No subset within the slack and no item longer than a room left to fill: the greedy bisection decides.
    ones = [placement_module._Item(d, ((0, 1),)) for d in range(3)]
    assert placement_module._exhaustive_bisection(ones, (1, 2), (1.5, 1.5), 0.1) is None


def test_cuts_of_the_greedy_bisection_are_searched_again() -> None:
    # Between nodes, a bisection too large for every subset is split by the greedy steps; the documents they cut
    # and the heaviest and shortest items are then searched again over every subset (`_reopened`), kept only when
    # fewer rows move, or when the greedy sides missed the slack: never more rows than the greedy steps within the
    # slack, exact rooms and the slack kept when kept, fewer rows in all.
    rng = random.Random(5)
    reopened = greedy = kept = 0
    for _ in range(40):
        lengths = [rng.choice([rng.randint(1, 300), rng.randint(300, 3000), rng.randint(3000, 20000)])
                   for _ in range(rng.randint(13, 40))]
        items = [placement_module._Item(d, ((0, n),)) for d, n in enumerate(lengths)]
        total = sum(lengths)
        left = total // 2 + rng.randint(-total // 8, total // 8)
        rooms = (left, total - left)
        area = sum(it.area for it in items)
        targets = (area * rooms[0] / total, area * rooms[1] / total)
        sides = placement_module._bisect_items(items, rooms, targets, True)
        plain = placement_module._bisect_items(items, rooms, targets, True, PlacementConfig(reopened=0))
        rows, plain_rows = placement_module._cut_rows(sides), placement_module._cut_rows(plain)
        slack = placement_module._Bisection(items, rooms, targets, PlacementConfig(), True).slack
        missed = abs(plain[0].total_area() - targets[0]) > slack
        assert rows <= plain_rows or missed
        if rows < plain_rows or (missed and rows != plain_rows):
            kept += 1
            assert [sum(it.length for it in side) for side in sides] == list(rooms)
            for side, target in zip(sides, targets):
                assert abs(sum(it.area for it in side) - target) <= slack
            assert len({it.doc for it in sides[0]} & {it.doc for it in sides[1]}) <= 1
        reopened += rows
        greedy += plain_rows
    assert kept >= 20 and reopened < greedy, (kept, reopened, greedy)


# ---- v3: the placement's knobs as one value, slack spent on traffic, analysis off the runtime path ---------------

@pytest.mark.parametrize("kwargs,name", [
    (dict(balance="loose"), "balance"), (dict(attention_target=0.99), "attention_target"),
    (dict(token_target=0.5), "token_target"), (dict(heavy=-0.1), "heavy"), (dict(exchange=2.5), "exchange"),
    (dict(visits=True), "visits"), (dict(rounds_inside_node=0), "rounds_inside_node"),
    (dict(slack=float("nan")), "slack"), (dict(attention_target=1.0005), "slack"),
    (dict(lookahead=[0.5]), "lookahead"), (dict(lookahead=(1.0,)), "lookahead"), (dict(lookahead=(0,)), "lookahead"),
    (dict(alternatives=-1), "alternatives"), (dict(lookahead_nodes=-1), "lookahead_nodes"),
    (dict(head_cuts=(0.25, 1.5)), "head_cuts"), (dict(head_cuts=0.25), "head_cuts"),
    (dict(head_cut_items=-1), "head_cut_items"), (dict(head_cut_splits=1.5), "head_cut_splits"),
    (dict(head_cut_share=-0.1), "head_cut_share"), (dict(whole_lengths=-1), "whole_lengths"),
])
def test_placement_config_refuses_bad_values_naming_the_field(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        PlacementConfig(**kwargs)


def _node_rows(segments: Sequence[Sequence[Tuple[int, int, int]]], ranks_per_node: int) -> int:
    """Key/value rows crossing nodes with node-level forwarding (``PlanStats.recv_bytes_inter_forwarded``'s
    rows, written out): each node needs every row of a document below its last query that it does not hold."""
    last: Dict[Tuple[int, int], int] = {}
    held: Dict[Tuple[int, int], int] = {}
    for rank, segs in enumerate(segments):
        for doc, start, end in segs:
            key = (doc, rank // ranks_per_node)
            last[key] = max(last.get(key, 0), end)
            held[key] = held.get(key, 0) + end - start
    return sum(last[key] - held[key] for key in last)


@pytest.mark.parametrize("seed, members_per_node, off, on", [
    # The first bisection's cheapest cut of the 423K-token document gives one side a 182K-token piece: the level
    # below has 80K tokens left next to it for the 342K-token document's area and cuts it at 267K. A piece of at
    # most 3/4 of those tokens (130K) costs 17K rows more there and leaves that cut at 204K (the other side's at
    # 332K instead of 329K): 753K rows in all instead of 796K.
    (2, 4, PlacementConfig(lookahead=(), head_cuts=()), PlacementConfig(head_cuts=())),
    # The first bisection cuts the 354K-token document where the 293K-token one fits the rooms alike (a piece of
    # the same positions carries the same area): with that one cut instead, the level below cuts the 354K one
    # once (at 210K) instead of cutting its rest on one side and the 293K one on the other: 675K rows, not 934K.
    (4, 1, PlacementConfig(lookahead=(), head_cuts=()), PlacementConfig(lookahead=(), alternatives=2, head_cuts=())),
    # Two cuts between the halves: the 267K-token document (longer than a node) gives its head (a quarter, 67K
    # tokens) to the half holding the 410K-token one, as sparse filler next to that one's dense tail, and its rest
    # goes whole to one node of the other half; no split with one cut does that: 526K rows, not 815K.
    (10, 1, PlacementConfig(head_cuts=()), PlacementConfig()),
])
def test_lookahead_weighs_the_cut_between_nodes_with_the_level_below(seed: int, members_per_node: int,
                                                                     off: PlacementConfig,
                                                                     on: PlacementConfig) -> None:
    """Bimodal 1M-token batches on 4 nodes: the bisection between two halves of the nodes chosen with the rows of
    the bisections below it moves fewer rows in all than the one cut at its own fewest rows, within the target."""
    lengths = bimodal_doc_lengths(1 << 20, seed=seed)
    rows = {}
    for name, config in (("off", off), ("on", on)):
        members = 4 * members_per_node
        per_rank = -(-sum(lengths) // members)
        segments = sequence_aware_placement(lengths, ring_size=members, ulysses_size=1,
                                            ring_members_per_node=members_per_node, tokens_per_rank=per_rank,
                                            placement=config)
        check_layout(segments, lengths, per_rank)
        area = [sum(causal_area(s, e) for _, s, e in segs) for segs in segments]
        assert _imbalance(area) <= config.attention_target, name
        rows[name] = _node_rows(segments, members_per_node)
    assert rows["on"] < 0.95 * rows["off"], rows


@pytest.mark.parametrize("lengths, config", [
    ([2, 94, 50, 46, 6], PlacementConfig(short_tokens=500, exhaustive=0)),
    ([7, 47, 1, 56, 4], PlacementConfig(heavy=0.01, short=0.2, short_tokens=500, exhaustive=0)),
])
def test_lookahead_keeps_the_nodes_below_within_the_budget(lengths: List[int], config: PlacementConfig) -> None:
    """Three nodes of one member: a split with a second cut (``head_cuts``) moves fewer rows with the level below, but
    that level cannot then balance its nodes (attention imbalance 1.47 and 1.15 when step 6 took it); step 6 weighs
    only candidates whose nodes below hold no more over their share than the budget or the first split's."""
    per_rank = -(-sum(lengths) // 3)
    segments = sequence_aware_placement(lengths, ring_size=3, ulysses_size=1, ring_members_per_node=1,
                                        tokens_per_rank=per_rank, placement=config)
    check_layout(segments, lengths, per_rank)
    assert _imbalance([sum(causal_area(s, e) for _, s, e in segs) for segs in segments]) <= config.attention_target


def test_lookahead_runs_on_at_most_lookahead_nodes() -> None:
    """At 8 nodes the lookahead is off by default (``lookahead_nodes`` 4): the plan is that of ``lookahead=()``.
    With ``lookahead_nodes=8`` it weighs the bisections between two halves of 4 nodes, which on this stdlib
    batch (1M tokens, 8 nodes of one member) moves fewer rows, within the target."""
    lengths = _heavy_tailed(10)
    per_rank = -(-sum(lengths) // 8)
    plans = {}
    for name, config in (("default", PlacementConfig()), ("off", PlacementConfig(lookahead=(), head_cuts=())),
                         ("eight", PlacementConfig(head_cuts=(), lookahead_nodes=8))):
        segments = sequence_aware_placement(lengths, ring_size=8, ulysses_size=1, ring_members_per_node=1,
                                            tokens_per_rank=per_rank, placement=config)
        check_layout(segments, lengths, per_rank)
        assert _imbalance([sum(causal_area(s, e) for _, s, e in segs) for segs in segments]) <= 1.02, name
        plans[name] = segments
    assert plans["default"] == plans["off"]
    assert _node_rows(plans["eight"], 1) < 0.95 * _node_rows(plans["off"], 1)


def test_placement_config_is_part_of_the_plan_cache_key() -> None:
    cu = cu_seqlens_from_lengths([3002, 19, 4241, 998, 70_000])  # lengths no other test plans
    topo = CPTopology.offline(4, 1, 2)
    default = plan_batch(cu, topo, "sequence-aware")
    assert plan_batch(cu, topo, "sequence-aware", placement=PlacementConfig())._data is default._data
    tight = plan_batch(cu, topo, "sequence-aware", placement=PlacementConfig(balance="tight"))
    assert tight._data is not default._data
    zigzag = plan_batch(cu, topo, "zigzag")
    assert plan_batch(cu, topo, "zigzag", placement=PlacementConfig(balance="tight"))._data is zigzag._data
    with pytest.raises(ValueError, match="placement"):
        plan_batch(cu, topo, "sequence-aware", placement={"balance": "tight"})


@pytest.mark.parametrize("nodes,per_node,ulysses", [(2, 8, 8), (2, 8, 1), (4, 4, 4)])
def test_traffic_balance_spends_the_slack_on_inter_node_rows(nodes: int, per_node: int, ulysses: int) -> None:
    """Bimodal batches (90 % of documents 200-2,000 tokens, 10 % 64K-512K): with the attention target's slack spent
    between nodes fewer rows cross them than balanced tightly, never more on any batch, while attention stays
    within 1.02, every rank holds the same tokens and nothing is padded."""
    topo = CPTopology.offline(nodes * per_node, ulysses, per_node)
    moved = {"tight": 0, "traffic": 0}
    for seed in range(3):
        cu = cu_seqlens_from_lengths(bimodal_doc_lengths(1 << 20, seed=seed))
        rows = {}
        for balance in moved:
            stats = plan_batch(cu, topo, "sequence-aware",
                               placement=PlacementConfig(balance=balance)).stats(8, 8, 1, torch.float32)
            assert stats.flops_imbalance <= 1.02, (balance, seed, stats.flops_imbalance)
            assert stats.padding_tokens == [0] * topo.cp_size and len(set(stats.tokens)) == 1
            rows[balance] = sum(stats.recv_bytes_inter_forwarded)
            moved[balance] += rows[balance]
        assert rows["traffic"] <= rows["tight"], (seed, rows)
    # Two nodes: one bisection between nodes gets the whole slack (a quarter of the rows or more saved); four
    # nodes: two levels share it.
    assert moved["traffic"] < (0.9 if nodes == 2 else 1.0) * moved["tight"], moved


def test_a_placement_over_the_target_is_planned_again_with_less_slack() -> None:
    """With light items dealt as a window up to 20 % of a side's target (``heavy=0.2``), a 16K-token bucket batch on a
    pure ring of 2 x 8 misses the target at the widest slack between nodes; the placement kept is planned again
    with less slack and meets it."""
    lengths = sample_doc_lengths(1 << 14, seed=0)
    config = PlacementConfig(heavy=0.2)
    slacks = placement_module._node_slacks(config, 2, 8)
    assert len(slacks) > 1 and slacks[-1] == config.slack  # tight is the last resort
    docs = [placement_module._Item.whole(d, n) for d, n in enumerate(lengths) if n > 0]
    target = sum(it.area for it in docs) / 16
    widest = placement_module._split(docs, [list(range(8)), list(range(8, 16))], [1024] * 16, [target] * 16, config,
                                     slacks[0])
    assert max(sum(it.area for it in items) for items in widest) > 1.02 * target
    segments = _place(lengths, 16, 1, 8, placement=config)
    assert _imbalance(_member_area(segments, 16, 1)) <= 1.02
    assert placement_module._node_slacks(PlacementConfig(balance="tight"), 8, 1) == [0.001]


def test_training_never_imports_the_analysis_module() -> None:
    """The lower bounds serve the report and the tests; the training path (loop, packing, planning workers, a
    sequence-aware plan, its schedule and stats) must not load them."""
    code = ("import sys\n"
            "import megatron_hsap.training.loop, megatron_hsap.training.plan_workers\n"
            "from megatron_hsap.parallel_state import CPTopology\n"
            "from megatron_hsap.sequence.plan import plan_batch\n"
            "from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths\n"
            "plan = plan_batch(cu_seqlens_from_lengths([5000, 300, 20000]), CPTopology.offline(16, 8, 8), "
            "'sequence-aware')\n"
            "plan.member_schedule(True, 0), plan.stats(8, 8, 16)\n"
            "print('analysis' , 'megatron_hsap.sequence.analysis' in sys.modules)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": root}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "analysis False", out.stdout


def test_exact_two_node_optimum_matches_the_brute_force() -> None:
    """``analysis.fewest_rows_two_nodes`` (the report's exact yardstick) equals the brute force over every
    token-to-node assignment on tiny batches, feasible or not, and never exceeds what the planner moves."""
    rng = random.Random(1)
    nonzero = 0
    for _ in range(60):
        lengths = [rng.randint(0, 9) for _ in range(rng.randint(1, 3))]
        while sum(lengths) > 10:
            lengths[rng.randrange(len(lengths))] //= 2
        if not sum(lengths):
            continue
        node_tokens = -(-sum(lengths) // 2) + rng.choice([0, 0, 1])
        imbalance = rng.choice([1.0, 1.02, 1.1, 1.25, 1.5, 2.0])
        best = analysis_module.fewest_rows_two_nodes(lengths, node_tokens, imbalance)
        assert best == _fewest_rows_by_brute_force(lengths, 2, node_tokens, imbalance), (lengths, node_tokens)
        nonzero += bool(best)
    assert nonzero >= 10
    lengths = [9, 3, 7, 1, 2, 6]  # 28 tokens, 2 nodes of one rank: the plan within its own balance moves no less
    stats = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(2, 1, 1), "sequence-aware").stats(
        1, 1, 1, torch.float32)
    best = analysis_module.fewest_rows_two_nodes(lengths, 14, max(1.02, stats.flops_imbalance))
    assert best is not None and sum(stats.recv_bytes_inter_forwarded) // 8 >= best



def test_two_node_bound_never_exceeds_the_exact_optimum_and_is_close_to_it() -> None:
    """``analysis.two_node_rows_lower_bound`` against ``fewest_rows_two_nodes`` on small bimodal-like batches (a few
    long documents among short ones), token capacities and imbalances varied: never above the optimum whatever
    the documents enumerated (1: all but the longest fluid); enumerating the five longest it is the optimum on
    most batches (it relaxes only the part's token count to a real number and the shortest documents)."""
    rng = random.Random(2)
    cases = equal = 0
    bound_sum = optimum_sum = 0
    while cases < 24:
        tokens = rng.randint(12, 32)
        lengths: List[int] = []
        while sum(lengths) < tokens:
            n = rng.randint(tokens // 6, tokens // 2) if rng.random() < 0.3 else rng.randint(1, 4)
            lengths.append(min(n, tokens - sum(lengths)))
        node_tokens = -(-tokens // 2) + rng.choice([0, 0, 1, 3])
        imbalance = rng.choice([1.0, 1.02, 1.1, 1.3])
        best = analysis_module.fewest_rows_two_nodes(lengths, node_tokens, imbalance)
        if best is None:
            continue
        cases += 1
        for enumerated in (1, 3):
            assert two_node_rows_lower_bound(lengths, node_tokens, imbalance, enumerated=enumerated) <= best
        bound = two_node_rows_lower_bound(lengths, node_tokens, imbalance, enumerated=5)
        assert bound <= best, (lengths, node_tokens, imbalance)
        equal += bound == best
        bound_sum, optimum_sum = bound_sum + bound, optimum_sum + best
    assert equal >= 21 and bound_sum >= 0.9 * optimum_sum > 0, (equal, bound_sum, optimum_sum)


def test_two_node_bound_sees_the_document_every_placement_cuts() -> None:
    """Bimodal batch 4 at 2 x 8: its three longest documents (293K-383K tokens) fit no node of 524,288 tokens two
    at a time, so every placement cuts one; the per-document bound is 0 there. The two-node relaxation is within
    1 % of what the planner moves (172,961 rows when written), and never above it (the planner's nodes: equal
    tokens, within its balance)."""
    lengths = bimodal_doc_lengths(1 << 20, seed=4)
    assert inter_node_rows_lower_bound(lengths, 2, 1.02, 1 << 19) == 0
    topo = CPTopology.offline(16, 8, 8)
    stats = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware").stats(32, 8, 128)
    rows = sum(stats.recv_bytes_inter_forwarded) // (2 * 8 * 128 * 2)
    bound = two_node_rows_lower_bound(lengths, 1 << 19, max(1.02, stats.flops_imbalance))
    assert 171_000 <= bound <= rows, (bound, rows)
    # Without token capacities no cut is needed for tokens: a weaker, still nonzero, bound (the areas).
    assert 0 < two_node_rows_lower_bound(lengths, None, 1.02) < bound


@pytest.mark.parametrize("seed", [1, 2])
def test_two_node_bound_is_below_the_planners_rows(seed: int) -> None:
    """Smaller bimodal batches (256K tokens, long documents 16K-128K) at 2 x 8 hybrid and 2 x 4 pure ring: the
    bound at the plan's own balance and node tokens never exceeds the rows the plan moves across nodes."""
    lengths = bimodal_doc_lengths(1 << 18, seed=seed, long=(1 << 14, 1 << 17))
    for topo in (CPTopology.offline(16, 8, 8), CPTopology.offline(8, 1, 4)):
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware")
        stats = plan.stats(8, 8, 128)
        rows = sum(stats.recv_bytes_inter_forwarded) // (2 * 8 * 128 * 2)  # k and v, 8 KV heads of 128 in bf16
        node_tokens = plan.tokens_per_rank * topo.cp_size // 2
        assert two_node_rows_lower_bound(lengths, node_tokens, max(1.02, stats.flops_imbalance)) <= rows


def test_two_node_bound_refuses_bad_arguments() -> None:
    for kwargs, message in (({"enumerated": 0}, "enumerated=0 must be an int >= 1"),
                            ({"max_boxes": 0}, "max_boxes=0 must be an int >= 1"),
                            ({"gap": 1.0}, r"gap=1.0 must be in \[0, 1\)"),
                            ({"imbalance": 0.9}, "imbalance=0.9 must be >= 1.0")):
        with pytest.raises(ValueError, match=message):
            two_node_rows_lower_bound([10, 10], 10, **kwargs)
    with pytest.raises(ValueError, match="node_tokens=9"):
        two_node_rows_lower_bound([10, 10], 9)


# ---- padded batches: the attention target holds as without padding -----------------------------------------------

def _fine_grained(seed: int, cp: int) -> List[int]:
    """A batch of short documents (and a few medium ones) whose total is not a multiple of ``cp``: the last ranks
    hold tail padding."""
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 20), rng.randint(1, 200), rng.randint(1, 2000)])
               for _ in range(rng.choice([300, 2000, 8000]))]
    if sum(lengths) % cp == 0:
        lengths.append(rng.randint(1, cp - 1))
    return lengths


@pytest.mark.parametrize("nodes,per_node", [(2, 8), (4, 4), (8, 8)])
@pytest.mark.parametrize("hybrid", [True, False])
def test_padded_batches_meet_the_attention_target(nodes: int, per_node: int, hybrid: bool) -> None:
    """Each member's attention, summed from the plan's segments (``causal_area`` of each), is within
    ``attention_target`` of the mean: a padded last member holds the same attention on fewer tokens. Tokens stay
    equal, the padding is the tail only. ``plan_report --scaling``'s batches (10^3-10^5 documents of 1-20 tokens:
    all but one layout padded) and fine-grained batches of a total not divisible by the CP size."""
    cp = nodes * per_node
    ulysses = per_node if hybrid else 1
    topo = CPTopology.offline(cp, ulysses, per_node)
    rng = random.Random(0)
    scaling = [[rng.randint(1, 20) for _ in range(count)] for count in (10 ** 3, 10 ** 4, 10 ** 5)]
    batches = scaling + [_fine_grained(seed, cp) for seed in range(3)]
    padded = 0
    for k, lengths in enumerate(batches):
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware")
        segments = [list(rank) for rank in plan.rank_segments]
        check_layout(segments, lengths, plan.tokens_per_rank)
        total = sum(lengths)
        counts = [sum(e - s for _, s, e in rank) for rank in segments]
        assert counts == [min(plan.tokens_per_rank, max(0, total - c * plan.tokens_per_rank)) for c in range(cp)]
        padded += total % cp != 0
        area = _member_area(segments, cp // ulysses, ulysses)
        assert _imbalance(area) <= PlacementConfig().attention_target, (k, _imbalance(area))
    assert padded >= 3  # the fine-grained ones at least


@pytest.mark.parametrize("seed", range(20))
def test_attention_targets_are_equal_shares_within_what_each_member_can_hold(seed: int) -> None:
    """``_densest_area`` is the sum of the largest token densities (brute force); ``_attention_targets`` gives every
    member the same share, but a member never more than its tokens can carry (the rest shared by the others)."""
    rng = random.Random(seed)
    # Full members of `cap` tokens and a last one of `last` (as few as 1: its share is out of its reach).
    members, cap = rng.randint(2, 9), rng.randint(3, 40)
    last = rng.choice([1, 2, rng.randint(0, cap)])
    caps = [cap] * (members - 1) + [last]
    lengths: List[int] = []
    while sum(lengths) < sum(caps):
        lengths.append(min(rng.randint(0, rng.choice([3, 30])), sum(caps) - sum(lengths)))
    densities = sorted((p + 1 for n in lengths for p in range(n)), reverse=True)
    for tokens in range(len(densities) + 3):
        assert placement_module._densest_area(np.array(lengths), tokens) == sum(densities[:tokens])
    area = sum(densities)
    targets = placement_module._attention_targets(caps, area, np.array(lengths))
    reach = [sum(densities[:c]) for c in caps]
    assert abs(sum(targets) - area) <= 1e-9 * area
    assert all(t <= r + 1e-9 * area for t, r in zip(targets, reach))
    # The unbounded members get one equal share, no less than any bounded one.
    level = max(targets)
    assert all(t == r or abs(t - level) <= 1e-9 * area for t, r in zip(targets, reach))


# ---- issue 31, traffic: heavy documents searched again, the slack budget spent level by level ---------------------

@pytest.mark.parametrize("lengths", [
    [18, 1, 1, 22, 1, 1, 22, 1, 1, 2, 1, 1, 2, 1, 2, 1],
    [2, 1, 1, 1, 2, 2, 2, 23, 21, 1, 2, 1, 1, 1, 2, 23],
])
def test_a_single_greedy_cut_is_searched_again_with_the_heavy_documents(lengths: List[int]) -> None:
    """Two nodes, three heavy documents among short ones (too many items for every subset at once): the greedy
    steps place the heavy documents one by one and cut the one that fits neither side at its cheapest cut given
    the others; searched again with the heavy documents free (which stay whole where, which is cut), the plan
    meets the attention target and moves exactly the fewest rows any placement within it can
    (``fewest_rows_two_nodes``). The greedy cut alone moved 17 and 20 rows at 1.17 and 1.20 x the mean
    attention (no slack left it within the target)."""
    assert len(lengths) > PlacementConfig().exhaustive
    plan = plan_batch(cu_seqlens_from_lengths(lengths), CPTopology.offline(2, 1, 1), "sequence-aware")
    stats = plan.stats(1, 1, 1, torch.float32)
    assert stats.flops_imbalance <= 1.02
    optimum = analysis_module.fewest_rows_two_nodes(lengths, plan.tokens_per_rank, 1.02)
    assert optimum is not None and sum(stats.recv_bytes_inter_forwarded) // 8 == optimum


@pytest.mark.parametrize("ring,ulysses,per_node", [(4, 8, 1), (16, 1, 4)])
@pytest.mark.parametrize("seed,yardstick", [(2, 1.15), (3, 1.10)])
def test_bimodal_heavy_documents_on_four_nodes_move_within_the_yardstick_of_the_bound(
        seed: int, yardstick: float, ring: int, ulysses: int, per_node: int) -> None:
    """1M-token bimodal batches on 4 nodes, hybrid and a pure ring of 16 (seed 2: documents of 422K, 342K, 110K and
    100K tokens among short ones; seed 3: 486K, 474K and 72K): the rows crossing nodes are within 1.15 x the valid
    lower bound at the attention target (tools/plan_report.py's yardstick), 1.10 x on seed 3; attention within
    1.02. The greedy cuts searched again without the heavy documents moved 1.22 x on seed 2 (and the placement
    before this round 1.16 x on seed 3); the slack shared equally by the two levels between nodes 1.14 x on
    seed 3."""
    lengths = bimodal_doc_lengths(1 << 20, seed=seed)
    topo = CPTopology.offline(ring * ulysses, ulysses, per_node * ulysses)
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware")
    stats = plan.stats(8, 8, 1, torch.float32)  # a row: k and v of 8 heads of 1 fp32
    assert stats.flops_imbalance <= 1.02
    bound = inter_node_rows_lower_bound(lengths, 4, 1.02, plan.tokens_per_rank * per_node * ulysses)
    assert bound > 0 and sum(stats.recv_bytes_inter_forwarded) // 64 <= yardstick * bound


def test_node_slack_spends_the_budget_first_and_leaves_the_floor_below() -> None:
    """The first bisection between nodes takes the whole budget but ``slack`` per level below, so the levels
    below can still place documents whole, and their errors compound to at most the budget."""
    floor = PlacementConfig().slack
    for budget, levels in [(1.02, 1), (1.02, 2), (1.017, 3), (1.0005, 2)]:
        first = placement_module._node_slack(budget, levels, floor)
        assert first >= floor
        if budget >= (1 + floor) ** levels:
            assert (1 + first) * (1 + floor) ** (levels - 1) == pytest.approx(budget)
    assert placement_module._node_slack(1.02, 1, floor) == pytest.approx(0.02)


def test_an_inside_node_bisection_off_its_slack_is_searched_again() -> None:
    """The 13 items two ring members of one node split on a lognormal batch (seed 0, 1M tokens, pure ring of 8 x 8):
    the greedy steps missed the targets by 10.2 % (the placement then planned the batch twice more with less slack
    between nodes); searched again like a bisection between nodes, both sides are within the slack, rooms exact."""
    ranges = [((0, 126), (15804, 26059)), ((0, 964),), ((0, 847),), ((0, 750),), ((0, 613),), ((0, 611),),
              ((0, 590),), ((0, 588),), ((0, 485),), ((0, 477),), ((16094, 21102),), ((0, 628), (18369, 28896)),
              ((1, 300),)]
    docs = [37, 121, 39, 50, 19, 57, 65, 119, 96, 17, 94, 44, 97]
    items = [placement_module._Item(d, r) for d, r in zip(docs, ranges)]
    area = sum(it.area for it in items)
    rooms, targets = (16384, 16384), (area / 2, area / 2)
    slack = placement_module._Bisection(items, rooms, targets, PlacementConfig(), False).slack
    sides = placement_module._bisect_items(items, rooms, targets, False)
    assert [int(side.length.sum()) for side in sides] == list(rooms)
    for side, target in zip(sides, targets):
        assert abs(side.total_area() - target) <= slack
