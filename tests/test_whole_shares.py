"""A node of short, whole documents shared among its ring members by counts per length (``whole_shares``).

Fast (no processes): ``.venv/bin/python -m pytest tests/test_whole_shares.py -q``.
"""

from __future__ import annotations

import random
from typing import List, Optional, Sequence

import numpy as np
import pytest

from megatron_hsap.sequence import placement as placement_module
from megatron_hsap.sequence.placement_config import PlacementConfig
from megatron_hsap.sequence.whole_shares import share_whole


def _tolerances(targets: Sequence[float]) -> List[float]:
    return [placement_module._pairs_slack(PlacementConfig().slack, (t,)) for t in targets]


def _areas(lengths: np.ndarray) -> np.ndarray:
    return lengths * (lengths + 1) // 2


def _caps(total: int, bins: int, kind: str) -> List[int]:
    """Equal caps (``total`` a multiple of ``bins``), a padded last bin, or a padded bin followed by empty ones (the
    tail of a placement's last node)."""
    if kind == "equal":
        return [total // bins] * bins
    full = bins - 1 if kind == "padded" else max(1, bins - 3)
    cap = -(-total // full) if kind == "empty" else -(-total // bins)
    return [min(cap, max(0, total - b * cap)) for b in range(bins)]


@pytest.mark.parametrize("longest", [1, 3, 20, 64])
def test_every_bin_gets_its_tokens_exactly_and_its_area_within_the_tolerance(longest: int) -> None:
    """Thousands of documents of 1..``longest`` tokens into 2-8 bins, equal or padded: every bin holds exactly its cap
    (empty bins nothing) and an area within the slack of its target (``placement._attention_targets``: a padded bin's
    share on fewer tokens), every document in exactly one bin."""
    rng = random.Random(longest)
    for case in range(9):
        kind = ("equal", "padded", "empty")[case % 3]
        bins = rng.choice([2, 3, 4, 8]) if kind != "empty" else rng.choice([4, 8])
        lengths = np.array([rng.randint(1, longest) for _ in range(rng.choice([2000, 10000]))], dtype=np.int64)
        if kind == "equal":
            lengths = np.concatenate([lengths, np.ones(-int(lengths.sum()) % bins, dtype=np.int64)])
        caps = _caps(int(lengths.sum()), bins, kind)
        targets = placement_module._attention_targets(caps, int(_areas(lengths).sum()), lengths)
        tolerances = _tolerances(targets)
        owner = share_whole(lengths, caps, targets, tolerances)
        assert owner is not None, (longest, case, caps)
        assert owner.shape == lengths.shape and 0 <= owner.min() and owner.max() < bins
        for b, (cap, target, tolerance) in enumerate(zip(caps, targets, tolerances)):
            mine = lengths[owner == b]
            assert int(mine.sum()) == cap, (longest, case, b)
            area = int(_areas(mine).sum())
            assert abs(area - target) <= tolerance, (longest, case, b, area, target)


def test_declines_what_whole_documents_cannot_meet() -> None:
    """None (the caller bisects), not a bin off its cap or target: caps no whole documents add up to, lengths that
    do not add up to the caps, areas no exchange balances (three 1-token documents or one of 3 tokens in each of
    two bins of 3 tokens: 3 or 6 pairs, never 4.5), and more distinct lengths than the exchanges weigh."""
    assert share_whole(np.array([3, 3, 3, 3]), [5, 7], [12.0, 12.0], [1.0, 1.0]) is None
    assert share_whole(np.array([1, 2]), [2, 2], [2.0, 2.0], [1.0, 1.0]) is None
    assert share_whole(np.array([1, 1, 1, 3]), [3, 3], [4.5, 4.5], [0.1, 0.1]) is None
    assert share_whole(np.array([1, 1, 1, 3]), [3, 3], [6.0, 3.0], [0.1, 0.1]).tolist() == [1, 1, 1, 0]  # (reachable)
    many = np.repeat(np.arange(1, 10), 4)  # 9 distinct lengths
    total, area = int(many.sum()), float(_areas(many).sum())
    assert share_whole(many, [total // 2, total - total // 2], [area / 2] * 2, [area] * 2, 8) is None
    assert share_whole(many, [total // 2, total - total // 2], [area / 2] * 2, [area] * 2, 9) is not None


def test_targets_out_of_reach_of_whole_documents_are_declined_before_any_exchange() -> None:
    """A bin of half the tokens with an equal share of the area needs denser documents than a node of 1-8 tokens
    has (at most 4.5 pairs a token, the mean 3.3): ``_reachable`` says so from the counts alone (the fractional
    bounds: the shortest / longest documents filling the cap), and ``share_whole`` declines; a sparser share for
    it is within reach, and equal bins are."""
    from megatron_hsap.sequence import whole_shares

    lengths = np.array([1 + k % 8 for k in range(3000)], dtype=np.int64)
    total, area = int(lengths.sum()), float(_areas(lengths).sum())
    values, available = np.unique(lengths, return_counts=True)
    caps = np.array([total - total // 3, total // 3], dtype=np.int64)  # the second bin: half the first's tokens

    def reachable(targets: Sequence[float]) -> bool:
        return whole_shares._reachable(caps, np.array(targets), np.array(_tolerances(targets)), values, available,
                                       _areas(values))

    assert not reachable([area / 2, area / 2])
    assert share_whole(lengths, caps.tolist(), [area / 2, area / 2], _tolerances([area / 2, area / 2])) is None
    assert reachable([area * 2 / 3, area / 3]) and reachable([area * 0.6, area * 0.4])
    assert not reachable([area * 0.2, area * 0.8])  # (the first bin's least: its tokens of the shortest documents)
    halves = [total // 2, total - total // 2]
    assert whole_shares._reachable(np.array(halves), np.array([area / 2] * 2), np.array(_tolerances([area / 2] * 2)),
                                   values, available, _areas(values))


def test_a_node_holding_a_piece_cut_above_is_left_to_the_bisections() -> None:
    """``_shared_whole`` reads an item's area from its length, true of a document's head only: a node holding a
    later piece of a document cut between nodes (tokens 1-2: 5 pairs, not 3, within what the exchanges could hide)
    is declined; the same node with that document's head is shared."""
    config = PlacementConfig()
    for first, shared in ((((1, 3),), False), (((0, 2),), True)):
        items = [placement_module._Item(0, first)] + [placement_module._Item.whole(d, 1 + d % 7) for d in range(1, 400)]
        total = sum(it.length for it in items)
        caps = [total // 2, total - total // 2]
        area = sum(it.area for it in items)
        out = placement_module._shared_whole(placement_module._Items.of(items), caps, [area / 2, area / 2], config)
        assert (out is not None) == shared, first


def _plan(lengths: List[int], ring: int, ulysses: int, per_node: int,
          config: Optional[PlacementConfig] = None) -> List[float]:
    """Each ring member's attention area over the mean, from the plan's segments; every document on one member."""
    total = sum(lengths)
    tokens_per_rank = -(-total // (ring * ulysses))
    table = placement_module.sequence_aware_table(lengths, ring_size=ring, ulysses_size=ulysses,
                                                  ring_members_per_node=per_node, tokens_per_rank=tokens_per_rank,
                                                  placement=config)
    member = table[:, 0] // ulysses
    pairs = np.unique(np.stack([table[:, 1], member]), axis=1)
    assert len(np.unique(pairs[0])) == len(pairs[0]) == sum(1 for n in lengths if n), "a document split"
    area = np.zeros(ring)
    np.add.at(area, member, (table[:, 3] - table[:, 2]) * (table[:, 2] + table[:, 3] + 1) / 2)
    return (area / area.mean()).tolist()


@pytest.mark.parametrize("seed, count, longest, ring, ulysses, per_node", [
    (0, 20000, 20, 16, 1, 8),  # pure ring of 2 x 8
    (1, 12000, 64, 16, 2, 4),  # Ulysses pairs, 4 members a node, a padded last member
    (2, 30000, 8, 32, 1, 8),  # pure ring of 4 x 8
])
def test_nodes_of_short_documents_are_shared_by_counts_at_least_as_balanced_as_bisected(
        seed: int, count: int, longest: int, ring: int, ulysses: int, per_node: int, monkeypatch) -> None:
    """Batches of many short documents: no bisection inside a node (every node shared by counts), every document
    whole, every member within the attention target -- and the worst member no further over the mean than where
    the nodes are bisected as before (``whole_lengths=0``: ``share_whole`` declining every node)."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, longest) for _ in range(count)]
    inside: List[int] = []
    bisect = placement_module._bisect_items

    def spy(items, rooms, targets, between_nodes, *args, **kwargs):
        if not between_nodes:
            inside.append(len(items))
        return bisect(items, rooms, targets, between_nodes, *args, **kwargs)

    monkeypatch.setattr(placement_module, "_bisect_items", spy)
    shared = _plan(lengths, ring, ulysses, per_node)
    assert inside == []
    assert max(shared) <= PlacementConfig().attention_target
    bisected = _plan(lengths, ring, ulysses, per_node, PlacementConfig(whole_lengths=0))
    assert inside, "the bisections inside nodes did not run"
    assert max(shared) <= max(bisected), (max(shared), max(bisected))
