"""Compiled schedules, checked offline: every member's blocks cover exactly the document mask.

No processes: for an offline topology, each member's local and received blocks are
mapped back to global token indices (through the sender's row ranges) and compared
with the dense document mask of ``tests/reference.py``. Also checks that
``BatchPlan.stats`` predicts exactly what the schedule moves.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
from megatron_hsap.sequence.plan import plan_batch
from tests.reference import blocks_mask, document_mask, hard_cases

LAYOUTS = ("zigzag", "contiguous", "sequence-aware")


def _member_rows(plan, member: int) -> torch.Tensor:
    """Global index of every row of a member buffer (-1 on padding)."""
    topo = plan.topology
    return torch.cat([plan.global_indices_of(c) for c in topo.ring_member_ranks(member)])


def _check_plan(lengths, topo: CPTopology, layout: str, causal: bool, window_size=None) -> None:
    cu = cu_seqlens_from_lengths(lengths)
    plan = plan_batch(cu, topo, layout)
    total = sum(lengths)
    reference = document_mask(cu, total, causal, window_size=window_size)
    rows_needed = {}
    for member in range(topo.ring_size):
        schedule = plan.member_schedule(causal, member, window_size)
        q_rows = _member_rows(plan, member)
        covered = torch.zeros(len(q_rows), total, dtype=torch.int64)
        local = blocks_mask(schedule.local_blocks, len(q_rows), len(q_rows))
        valid = q_rows >= 0
        covered[:, q_rows[valid]] += local[:, valid].long()
        for recv in schedule.recv_steps:
            src_schedule = plan.member_schedule(causal, recv.src_member, window_size)
            send = next(s for s in src_schedule.send_steps if s.dst_member == member)
            assert send.distance == recv.distance and send.rows.num_rows == recv.num_rows
            src_rows = _member_rows(plan, recv.src_member)
            sent_rows = send.rows.gather_into(src_rows, torch.empty(send.rows.num_rows, dtype=src_rows.dtype))
            assert bool((sent_rows >= 0).all()), "padding rows must never be sent"
            mask = blocks_mask(recv.blocks, len(q_rows), recv.num_rows)
            covered[:, sent_rows] += mask.long()
            rows_needed[(recv.src_member, member)] = recv.num_rows
        assert covered.numel() == 0 or int(covered.max()) <= 1, "a key is attended twice by one query"
        expected = torch.zeros_like(covered)
        expected[valid] = reference[q_rows[valid]].long()
        assert torch.equal(covered, expected), f"member {member}: blocks do not match the document mask"
    # stats: all-to-all bytes (q, k, v in, output back) plus exactly the rows the schedule receives
    h_q, h_kv, d, elem, u = 24, 12, 8, 4, topo.ulysses_size
    stats = plan.stats(h_q, h_kv, d, torch.float32, causal=causal, window_size=window_size)
    a2a = (u - 1) * plan.tokens_per_rank * d * elem * (2 * h_q + 2 * h_kv) // u
    row_bytes = 2 * (h_kv // u) * d * elem
    for c in range(topo.cp_size):
        member = c // u
        ring_rows = sum(n for (src, dst), n in rows_needed.items() if dst == member)
        assert stats.recv_bytes_intra[c] + stats.recv_bytes_inter[c] == a2a + ring_rows * row_bytes
    # stats: FLOPs follow the mask area of each member's queries (checked for windows, where it is new)
    for c in range(topo.cp_size if window_size is not None else 0):
        area = plan.member_schedule(causal, c // topo.ulysses_size, window_size).area
        assert stats.attn_flops[c] == 4 * area * (h_q // topo.ulysses_size) * d


@pytest.mark.parametrize("cp,ulysses,ranks_per_node", [(2, 1, 2), (4, 1, 2), (4, 2, 4), (6, 3, 3), (8, 4, 4),
                                                       (8, 1, 4), (8, 2, 2)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_cover_document_mask_on_hard_cases(cp, ulysses, ranks_per_node, layout):
    topo = CPTopology.offline(cp, ulysses, ranks_per_node)
    for name, lengths in hard_cases(cp).items():
        for causal in (True, False):
            _check_plan(lengths, topo, layout, causal)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=12),
       shape=st.sampled_from([(2, 1, 1), (4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 4, 4), (8, 1, 8), (6, 2, 2)]),
       layout=st.sampled_from(LAYOUTS), causal=st.booleans())
def test_blocks_cover_document_mask_property(lengths, shape, layout, causal):
    cp, ulysses, ranks_per_node = shape
    if sum(lengths) == 0:
        lengths = lengths + [1]
    _check_plan(lengths, CPTopology.offline(cp, ulysses, ranks_per_node), layout, causal)


@pytest.mark.parametrize("layout", ["contiguous", "sequence-aware"])
def test_short_documents_move_nothing_in_a_ring(layout):
    """Documents that each fit on one rank: no exchange is scheduled at all (sequence-aware places them whole)."""
    topo = CPTopology.offline(4, 1, 2)
    lengths = [8] * 32
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, layout)
    for member in range(4):
        schedule = plan.member_schedule(True, member)
        assert schedule.recv_steps == () and schedule.send_steps == ()
    stats = plan.stats(8, 8, 64, torch.bfloat16)
    assert sum(stats.send_bytes_intra) + sum(stats.send_bytes_inter) == 0


def test_zigzag_sends_only_needed_halves():
    """One document in zigzag over 4 ranks: a lower rank never needs a higher rank's second chunk."""
    topo = CPTopology.offline(4, 1, 4)
    plan = plan_batch(cu_seqlens_from_lengths([64]), topo, "zigzag")
    chunk = 8
    for member in range(4):
        for recv in plan.member_schedule(True, member).recv_steps:
            assert recv.num_rows == (chunk if recv.src_member < member else 2 * chunk)


def test_plans_are_cached_by_length_signature():
    topo = CPTopology.offline(4, 2, 4)
    a = plan_batch(cu_seqlens_from_lengths([5, 9, 2]), topo, "zigzag")
    b = plan_batch(torch.tensor([0, 5, 14, 16], dtype=torch.int64), topo, "zigzag")
    assert a._data is b._data
    assert plan_batch(cu_seqlens_from_lengths([5, 9, 3]), topo, "zigzag")._data is not a._data


def test_zigzag_is_pad_free_with_round_robin_remainders():
    topo = CPTopology.offline(2, 1, 2)
    plan = plan_batch(cu_seqlens_from_lengths([5, 0, 3]), topo, "zigzag")
    # 2R = 4 chunks per document; remainder tokens go round-robin to chunks 0, 1, 3, 2 (first chunks of members
    # 0, 1, then their second chunks), continuing across documents. doc 0 (5 = 4 * 1 + 1): chunk 0 gets the
    # extra token -> [0,2) [2,3) [3,4) [4,5); doc 2 (3 = 0 + 3): chunks 1, 3, 2 -> [] [0,1) [1,2) [2,3).
    # Member 0 keeps chunks 0 and 3, member 1 chunks 1 and 2 (adjacent, one segment).
    assert plan.tokens_per_rank == 4
    assert plan.rank_segments == (((0, 0, 2), (0, 4, 5), (2, 2, 3)), ((0, 2, 4), (2, 0, 2)))
    assert plan.position_ids_of(0).tolist() == [0, 1, 4, 2]
    assert plan.global_indices_of(0).tolist() == [0, 1, 4, 7]
    assert plan.global_indices_of(1).tolist() == [2, 3, 5, 6]
    stats = plan.stats(2, 2, 4, torch.float32)
    assert stats.padding_tokens == [0, 0] and stats.tokens == [4, 4]


# Sliding windows (flash-attn's (left, right)): smaller than a shard (48 tokens in the hard cases), about
# one shard, larger than any document; causal ones and a two-sided one for full attention.
WINDOWS = [((0, 0), True), ((5, -1), True), ((47, 0), True), ((200, -1), True), ((3, 7), False), ((60, -1), False)]


@pytest.mark.parametrize("cp,ulysses,ranks_per_node", [(4, 1, 2), (6, 3, 3)])
@pytest.mark.parametrize("layout", ["zigzag", "sequence-aware"])
def test_windowed_blocks_cover_the_windowed_document_mask(cp, ulysses, ranks_per_node, layout):
    """Every member's blocks cover exactly the document mask intersected with the window, the ring moves
    only key rows inside some query's window, and ``stats`` predicts both (checked in ``_check_plan``)."""
    topo = CPTopology.offline(cp, ulysses, ranks_per_node)
    cases = hard_cases(cp)
    for name in ("single_document", "one_long_many_short", "crosses_all_boundaries"):
        for window, causal in WINDOWS:
            _check_plan(cases[name], topo, layout, causal, window)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 70), min_size=1, max_size=10),
       shape=st.sampled_from([(2, 1, 1), (4, 2, 2), (4, 1, 2), (8, 2, 4)]), layout=st.sampled_from(LAYOUTS),
       causal=st.booleans(), left=st.integers(-1, 80), right=st.integers(-1, 80))
def test_windowed_blocks_property(lengths, shape, layout, causal, left, right):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    window = (left, 0 if causal else right)
    _check_plan(lengths, CPTopology.offline(*shape), layout, causal, window)


def test_window_shrinks_ring_traffic_and_schedules_are_cached_per_window():
    """One document over a ring of 4: a window of 1/8 of the sequence sends each member only the rows
    its queries reach; the schedule of each (causal, window) is built once."""
    topo = CPTopology.offline(4, 1, 2)
    plan = plan_batch(cu_seqlens_from_lengths([1024]), topo, "zigzag")
    full, windowed = (plan.stats(8, 8, 64, causal=True, window_size=w) for w in (None, (128, 0)))
    # a ring without Ulysses: every byte sent is key/value rows
    assert sum(full.ring_send_bytes) == sum(full.send_bytes_intra) + sum(full.send_bytes_inter)
    # zigzag chunks of 128 tokens: each query chunk needs at most the chunk before it from a peer
    assert sum(windowed.ring_send_bytes) < sum(full.ring_send_bytes) / 2
    assert plan.member_schedule(True, 0, (128, 0)) is plan.member_schedule(True, 0, (128, -1))
    assert plan.member_schedule(True, 0, (-1, 0)) is plan.member_schedule(True, 0)
    assert plan.member_schedule(True, 0, (128, 0)) is not plan.member_schedule(True, 0)


@pytest.mark.parametrize("window,causal", [((3, 2), True), ((-2, 0), True), ((1.5, 0), True), ((True, 0), True),
                                           ((1, 2, 3), False), ("64", False), (64, False)])
def test_bad_windows_name_the_argument(window, causal):
    plan = plan_batch(cu_seqlens_from_lengths([64]), CPTopology.offline(2, 1, 2), "zigzag")
    with pytest.raises(ValueError, match=r"window_size=.*allowed values"):
        plan.member_schedule(causal, 0, window)


def _check_forwarding_plan(lengths, topo: CPTopology, layout: str, causal: bool, window_size=None) -> None:
    """Node-level K/V forwarding: every member's blocks (local, direct from other members, relayed by a member
    of its node) cover exactly the document mask; both sides of every message agree on its rows and on
    whether the gradients come back deferred; only relays of the same node; inter-node rows = ``stats``'
    forwarded count (a row once per receiving node)."""
    cu = cu_seqlens_from_lengths(lengths)
    plan = plan_batch(cu, topo, layout)
    total = sum(lengths)
    reference = document_mask(cu, total, causal, window_size=window_size)
    nodes = topo.node_of_ring_member
    schedules = [plan.member_schedule(causal, m, window_size, kv_forwarding=True) for m in range(topo.ring_size)]
    inter_rows = 0
    for member, schedule in enumerate(schedules):
        q_rows = _member_rows(plan, member)
        valid = q_rows >= 0
        covered = torch.zeros(len(q_rows), total, dtype=torch.int64)
        covered.index_add_(1, q_rows[valid], blocks_mask(schedule.local_blocks, len(q_rows), len(q_rows))[:, valid].long())
        arrived = {}  # distance -> global index of every row received directly
        for recv in schedule.recv_steps:
            send = next(s for s in schedules[recv.src_member].send_steps if s.dst_member == member)
            assert (send.distance, send.rows.num_rows, send.deferred) == (recv.distance, recv.num_rows, recv.deferred)
            src_rows = _member_rows(plan, recv.src_member)
            arrived[recv.distance] = send.rows.gather_into(src_rows, torch.empty(recv.num_rows, dtype=torch.int64))
            covered.index_add_(1, arrived[recv.distance], blocks_mask(recv.blocks, len(q_rows), recv.num_rows).long())
            inter_rows += recv.num_rows if nodes[recv.src_member] != nodes[member] else 0
        for recv in schedule.relay_recvs:
            assert nodes[recv.src_member] == nodes[member]
            relay = schedules[recv.src_member]
            send = next(s for s in relay.relay_sends if s.dst_member == member)
            assert (send.distance, send.num_rows) == (recv.distance, recv.num_rows)
            relay_arrived = {r.distance: r for r in relay.recv_steps}
            rows = []
            for distance, part in send.parts:
                sender = schedules[relay_arrived[distance].src_member]
                direct = next(s for s in sender.send_steps if s.dst_member == recv.src_member)
                src_rows = _member_rows(plan, relay_arrived[distance].src_member)
                got = direct.rows.gather_into(src_rows, torch.empty(direct.rows.num_rows, dtype=torch.int64))
                rows.append(part.gather_into(got, torch.empty(part.num_rows, dtype=torch.int64)))
            covered.index_add_(1, torch.cat(rows), blocks_mask(recv.blocks, len(q_rows), recv.num_rows).long())
        assert covered.numel() == 0 or int(covered.max()) <= 1, "a key is attended twice by one query"
        expected = torch.zeros_like(covered)
        expected[valid] = reference[q_rows[valid]].long()
        assert torch.equal(covered, expected), f"member {member}: blocks do not match the document mask"
    stats = plan.stats(8, 4, 8, torch.float32, causal=causal, window_size=window_size)
    assert inter_rows * 2 * 4 * 8 * 4 == sum(stats.recv_bytes_inter_forwarded)


# (CP, Ulysses, ranks per node, hard cases): 2 nodes x 2 members; Ulysses pairs, 2 x 2; 3 nodes x 4 members.
FORWARDING_SHAPES = [(4, 1, 2, None), (8, 2, 4, ("crosses_several_boundaries", "long_tail_sampled", "only_short")),
                     (12, 1, 4, ("crosses_all_boundaries", "length_one_and_zero"))]


@pytest.mark.parametrize("cp,ulysses,ranks_per_node,names", FORWARDING_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forwarding_blocks_cover_document_mask_on_hard_cases(cp, ulysses, ranks_per_node, names, layout):
    topo = CPTopology.offline(cp, ulysses, ranks_per_node)
    assert topo.ring_members_share_nodes()
    cases = hard_cases(cp)
    for name in names or cases:
        for causal in (True, False):
            _check_forwarding_plan(cases[name], topo, layout, causal)
    for window, causal in WINDOWS[::2]:
        _check_forwarding_plan(cases["one_long_many_short"], topo, layout, causal, window)


def test_forwarding_moves_each_remote_row_across_nodes_once():
    """One document over a ring of 8 on 2 nodes (zigzag): without forwarding every member of a node receives
    the other node's rows it needs separately; with it they cross once, 4 x fewer inter-node rows."""
    topo = CPTopology.offline(8, 1, 4)
    plan = plan_batch(cu_seqlens_from_lengths([4096]), topo, "zigzag")
    stats = plan.stats(8, 8, 64, torch.bfloat16)
    assert sum(stats.recv_bytes_inter) == 4 * sum(stats.recv_bytes_inter_forwarded)
    schedule = plan.member_schedule(True, 0, kv_forwarding=True)
    assert schedule.forwarding and plan.member_schedule(True, 0, kv_forwarding=True) is schedule  # cached
    assert not plan.member_schedule(True, 0).forwarding
    hybrid = plan_batch(cu_seqlens_from_lengths([4096]), CPTopology.offline(8, 4, 4), "zigzag")
    assert hybrid.member_schedule(True, 0, kv_forwarding=True) is hybrid.member_schedule(True, 0)  # one member per node
