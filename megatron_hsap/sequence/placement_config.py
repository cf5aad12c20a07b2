"""The sequence-aware placement's targets and tuning constants, as one value (``plan_batch(..., placement=)``).

A ``PlacementConfig`` is frozen and hashable: it is part of the plan-cache key (``plan.plan_key``), so plans
made with different knobs never share an entry. docs/sequence_aware.md explains each field and quotes the
measurements (``tools/plan_report.py``) behind the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Tuple

__all__ = ["BALANCES", "PlacementConfig"]

#: ``PlacementConfig.balance``: spend the attention target's slack on inter-node traffic, or balance tightly.
BALANCES = ("traffic", "tight")


@dataclass(frozen=True)
class PlacementConfig:
    """Targets and knobs of the sequence-aware placement (the other layouts ignore it).

    balance: ``"traffic"`` (default) lets the bisections between nodes miss their attention targets by as much as
    ``attention_target`` allows, so that fewer documents are cut between nodes (the first bisection takes all of
    it but ``slack`` per level below; the levels below spend what their side has left); ``"tight"`` balances every
    bisection within ``slack`` first (traffic second). In either mode a placement whose worst ring member is
    above ``attention_target`` times its share is planned again with the slack halved, down to ``"tight"``.
    attention_target: the largest attention of a ring member over its share (1.02: 2 % over; the shares are
    equal, a padded member's within what its tokens can carry).
    token_target: the largest token count of a CP rank over the mean; the placement gives every rank exactly
    ``tokens_per_rank`` tokens (tail padding only on the last ranks), so it holds at 1.0 (plan_report checks it).

    The knobs (docs/sequence_aware.md, "Recursive bisection", names the step of each):
    heavy: items above this fraction of the smaller side's target are placed one by one, the rest dealt as a window
    (whose area error is at most about one such item). short / short_tokens: between nodes, a heavy item of at most
    this fraction of the smaller side's tokens, or of at most this many tokens, is never cut (the light phase fills
    rooms exactly by choosing and exchanging items; such a cut would buy nearly no balance); inside a node, the
    pass sharing the node's items among its members never cuts an item of at most this fraction of a member's
    tokens (or this many tokens): a node of such items only is shared whole, by counts of documents per length
    (``whole_shares``), and bisected where that misses a member's target. whole_lengths: only a node of at most this
    many distinct lengths is shared by counts (each exchange round weighs every two lengths; many lengths means
    few documents of each; 0: off). tiny: the shortest
    items holding this fraction of a bisection's tokens are shared in proportion to the rooms. exchange: items
    considered (shortest first) when exchanging a few to close a token gap. slack: a side may miss its target by
    this fraction in ``"tight"`` mode and inside nodes (the rest of the hierarchy adds its own error), and at least
    this much in ``"traffic"`` mode between nodes.
    rounds_between_nodes / rounds_inside_node: scans of the piece size when cutting (coarse, then refined around
    the best): between nodes every row saved is inter-node traffic; inside a node one coarse scan costs a few more
    intra-node rows at a fraction of the planning time. exhaustive: between nodes, bisections of at most this many
    items try every subset (fewer gave back most of the rows it saves); visits: cuts of least lower bound whose
    exact rows they compute. reopened: after the greedy steps between nodes cut two documents or more (or one,
    leaving a side off its target by more than the slack), the documents they cut, the heaviest whole items and
    the shortest ones, this many in all, searched again over every subset (10 moved no fewer rows); heaviest: of
    those, the cut documents and the heaviest whole items (by area), this many in all (the search then also
    chooses which heavy documents stay whole on which side and which one is cut; 5 gave back what 6 saves on
    the bimodal pure ring of 4 x 8). lookahead / alternatives: a bisection between 3 or 4 nodes that cut a
    document is planned again with the piece each heavy cut gives the side without the document's last token
    held to each fraction of ``lookahead`` times the longest such piece (where that piece holds at least
    ``lookahead_share`` of its side's tokens and the level below on its side moves at least as many rows as the
    cut), and its search again yields the ``alternatives`` cheapest splits of distinct kinds; the one moving the
    fewest rows together with the bisections between nodes below it is kept (each candidate costs about three
    bisections between nodes; ``()`` and 0: off). lookahead_nodes: both run only in placements over at most this
    many nodes (at 8 nodes they moved as many rows on nearly every batch and cost planning time).
    head_cuts / head_cut_items / head_cut_share / head_cut_splits: step 6 first weighs splits with a second cut:
    of step 5's free items, each of the ``head_cut_items`` longest after the longest (of at least ``head_cut_share``
    of the smaller side's tokens) gives its head of each fraction of ``head_cuts`` times its length to the side
    holding the longest item's last token and its rest to the other, the other free items searched as in step 5;
    of those where that side still holds it, the ``head_cut_splits`` moving the fewest rows here are weighed with
    the levels below, beside the shorter pieces of ``lookahead`` (``()``: off). Step 6
    keeps only candidates whose nodes below hold no more over their share than the budget or the first split's.
    docs/sequence_aware.md quotes the tools/plan_report.py runs behind these choices.
    """

    balance: str = "traffic"
    attention_target: float = 1.02
    token_target: float = 1.05
    heavy: float = 0.001
    short: float = 0.02
    short_tokens: int = 64
    whole_lengths: int = 64
    tiny: float = 0.02
    exchange: int = 48
    slack: float = 0.001
    rounds_between_nodes: int = 3
    rounds_inside_node: int = 1
    exhaustive: int = 12
    visits: int = 32
    reopened: int = 8
    heaviest: int = 6
    lookahead: Tuple[float, ...] = (0.75,)
    lookahead_share: float = 0.1
    alternatives: int = 0
    lookahead_nodes: int = 4
    head_cuts: Tuple[float, ...] = (0.25,)
    head_cut_items: int = 2
    head_cut_splits: int = 2
    head_cut_share: float = 0.2

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"balance={self.balance!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, BALANCES))}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{f.name}={value!r} must be an int >= 0")
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise ValueError(f"{f.name}={value!r} must be a finite number >= 0")
        for name in ("lookahead", "head_cuts"):
            value = getattr(self, name)
            if (not isinstance(value, tuple)
                    or not all(isinstance(f, (int, float)) and not isinstance(f, bool) and 0 < f < 1 for f in value)):
                raise ValueError(f"{name}={value!r} must be a tuple of fractions in (0, 1)")
        for name in ("attention_target", "token_target"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1.0 (a ratio to the mean)")
        if self.slack >= self.attention_target - 1.0:
            raise ValueError(f"slack={self.slack!r} must be below attention_target - 1 = "
                             f"{self.attention_target - 1.0:.6g} (the tight bisections' error must fit the target)")
        for name in ("rounds_between_nodes", "rounds_inside_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
