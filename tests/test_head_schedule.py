"""The head split and UPipe head schedule (pure bookkeeping): every valid (H, H_kv, P, U) up to H = 32 (and 40), checked
exhaustively, uneven head counts included."""

from __future__ import annotations

import itertools
from typing import Iterator, Tuple

import pytest

from megatron_hsap.attention.head_schedule import attention_activation_bytes, build_head_schedule
from megatron_hsap.head_split import split_heads


def _valid_shapes(max_heads: int = 32) -> Iterator[Tuple[int, int, int, int]]:
    for p in (1, 2, 3, 4, 8):
        for h in list(range(1, max_heads + 1)) + [40]:
            for h_kv in (k for k in range(1, h + 1) if h % k == 0):
                for u in sorted(set(range(p, h, p)) | {h}):
                    yield h, h_kv, p, u


SHAPES = list(_valid_shapes())
SCHEDULES = {shape: build_head_schedule(*shape) for shape in SHAPES}


def test_shape_sweep_is_not_empty():
    assert len(SHAPES) > 3000
    for required in ((16, 16, 4, 4), (16, 4, 4, 4), (32, 8, 4, 4), (16, 2, 4, 4), (16, 1, 4, 4), (12, 4, 2, 2),
                     (12, 4, 2, 4), (28, 4, 8, 8), (40, 8, 8, 8), (12, 3, 4, 4), (20, 5, 4, 4), (24, 6, 4, 4),
                     (12, 2, 3, 3), (7, 7, 4, 4), (9, 3, 2, 2), (2, 1, 4, 2), (28, 4, 8, 28)):
        assert required in SHAPES


def test_split_is_contiguous_balanced_and_sends_only_used_kv():
    """Every rank attends floor or ceil of H/P contiguous query heads in rank order (so the head order comes
    back exactly) and holds exactly the KV heads they use; a KV head held by two ranks is one whose query
    heads straddle them, and no balanced contiguous split holds fewer KV heads."""
    for h, h_kv, p, _ in {s[:3] + (0,) for s in SHAPES}:
        split = split_heads(h, h_kv, p)
        g = h // h_kv
        assert split.bounds[0] == 0 and split.bounds[-1] == h
        assert sorted(set(split.query_counts)) in ([h // p], [h // p, -(-h // p)])
        for r in range(p):
            assert list(split.kv_range(r)) == sorted({q // g for q in split.query_range(r)})
        # brute force over which ranks get the ceil: the chosen split holds the fewest KV heads
        if p <= 4:
            base, extra = divmod(h, p)
            best = min(sum(len({q // g for q in range(sum(sizes[:r]), sum(sizes[:r + 1]))}) for r in range(p))
                       for ceil in itertools.combinations(range(p), extra)
                       for sizes in [[base + (r in ceil) for r in range(p)]])
            assert split.kv_heads_held == best, (h, h_kv, p)


def test_every_query_head_once_and_its_kv_present():
    """Each query head runs exactly once, on the rank of its split range; when it runs, its KV head is held by that
    rank, which received it exactly once (in its first stage) and returns its gradient once (in its last)."""
    for h, h_kv, p, u in SHAPES:
        s = SCHEDULES[h, h_kv, p, u]
        split = split_heads(h, h_kv, p)
        m = -(-u // p)
        assert len(s.stages) == -(-max(split.query_counts) // m)
        seen = [[] for _ in range(p)]
        held = [set() for _ in range(p)]
        received, finished = [[] for _ in range(p)], [[] for _ in range(p)]
        for stage in s.stages:
            for r in range(p):
                assert len(stage.query_heads[r]) <= m
                held[r] |= set(stage.new_kv[r])
                received[r] += stage.new_kv[r]
                for q in stage.query_heads[r]:
                    assert s.query_kv(q) in held[r], (h, h_kv, p, u, q)
                    assert s.query_kv(q) == q // (h // h_kv)  # the KV head Megatron pairs q with
                    seen[r].append(q)
                held[r] -= set(stage.done_kv[r])
                finished[r] += stage.done_kv[r]
        for r in range(p):
            assert seen[r] == list(split.query_range(r)), (h, h_kv, p, u)
            assert received[r] == finished[r] == list(split.kv_range(r))  # each KV head sent once per rank
            assert not held[r]
        assert s.kv_heads_sent == split.kv_heads_held


def test_runs_follow_the_kernel_gqa_convention():
    """Each run (one attention call) is a query slice whose KV heads each serve the same number of adjacent
    query heads: the kernel's query i -> KV i // (queries / KV heads) gives each query head its own KV head."""
    for h, h_kv, p, u in SHAPES:
        s = SCHEDULES[h, h_kv, p, u]
        for stage in s.stages:
            for r in range(p):
                kv, queries, covered = stage.attn_kv[r], stage.query_heads[r], []
                for q0, q1, k0, k1 in stage.runs[r]:
                    assert (q1 - q0) % (k1 - k0) == 0
                    per = (q1 - q0) // (k1 - k0)
                    covered += [kv[k0 + i // per] for i in range(q1 - q0)]
                assert covered == [s.query_kv(q) for q in queries]
                assert list(kv) == sorted(set(covered))


def test_gqa_schedule_of_the_reference_when_heads_divide():
    """The UPipe paper's schedule at U = P with P | H and G | H/P: stage s has rank r attend its s-th query head; stage 0
    sends one KV head per rank and the next G - 1 stages reuse it (KV crosses once per group)."""
    checked = 0
    for h, h_kv, p, u in SHAPES:
        g = h // h_kv
        if u != p or h % p or (h // p) % g:
            continue
        s = SCHEDULES[h, h_kv, p, u]
        for i, stage in enumerate(s.stages):
            for r in range(p):
                assert stage.query_heads[r] == (r * h // p + i,)
                assert stage.new_kv[r] == ((stage.query_heads[r][0] // g,) if i % g == 0 else ())
        checked += 1
    assert checked > 50


def test_weight_units_follow_megatron_fused_qkv_layout():
    """Units index Megatron's linear_qkv rows viewed as [H_kv, G + 2, d]: G query heads, then key, then value."""
    for h, h_kv, p, u in SHAPES:
        s = SCHEDULES[h, h_kv, p, u]
        g = h // h_kv
        labels = [[grp * (g + 2) + i for i in range(g + 2)] for grp in range(h_kv)]
        query_label = [labels[grp][i] for grp in range(h_kv) for i in range(g)]
        assert [s.query_unit(q) for q in range(h)] == query_label
        for j in range(h_kv):
            assert s.key_unit(j) == labels[j][g]
            assert s.value_unit(j) == labels[j][g + 1]
        for stage in s.stages:
            assert len(s.send_units(stage)) == sum(len(q) + 2 * len(n) for q, n in zip(stage.query_heads,
                                                                                       stage.new_kv))
            assert len(s.grad_units(stage)) == sum(len(q) + 2 * len(c) for q, c in zip(stage.query_heads,
                                                                                       stage.done_kv))


def test_paper_defect_case_maps_every_head_back_once():
    """64 query heads, 16 KV heads, P = 8 (the paper's code yields duplicate indices here): a permutation."""
    s = build_head_schedule(64, 16, 8, 8)
    order = [q for stage in s.stages for heads in stage.query_heads for q in heads]
    assert sorted(order) == list(range(64)) and len(set(order)) == 64
    assert s.kv_heads_sent == 16 and s.kv_heads_sent_every_stage == 64


def test_kv_head_shared_by_ranks():
    """H_kv < P: a KV head goes to every rank whose query heads use it, once each."""
    s = build_head_schedule(16, 2, 4, 4)
    assert s.stages[0].query_heads == ((0,), (4,), (8,), (12,))
    assert s.stages[0].new_kv == ((0,), (0,), (1,), (1,))
    assert s.kv_heads_sent == 4


@pytest.mark.parametrize("args,pattern", [
    ((16, 4, 4, 6), "head_chunk_size=6 must be a multiple of ulysses_size=4 below the query heads per TP rank "
                    "(16), or all of them; allowed values: [4, 8, 12, 16]"),
    ((16, 4, 4, 20), "allowed values: [4, 8, 12, 16]"),
    ((16, 3, 4, 4), "num_heads_q=16 must be a multiple of num_heads_kv=3; allowed num_heads_kv: [1, 2, 4, 8, 16]"),
    ((4, 8, 4, 4), "num_heads_kv=8 must not exceed num_heads_q=4"),
    ((0, 1, 4, 4), "num_heads_q=0 must be a positive int"),
    ((16, 0, 4, 4), "num_heads_kv=0 must be a positive int"),
    ((16, 4, 0, 4), "ulysses_size=0 must be a positive int"),
    ((16, 4, 4, 0), "head_chunk_size=0 must be a positive int"),
])
def test_errors_name_the_argument(args, pattern):
    with pytest.raises(ValueError) as info:
        build_head_schedule(*args)
    assert pattern in str(info.value)


def test_activation_bytes_match_reference_accounting():
    """MHA, U = H, bf16: the UPipe paper's 12 * (S/C) * H * d; U = C cuts it by H / C (87.5 % at H = 64, C = 8)."""
    t, h, d = 1000, 64, 128
    assert attention_activation_bytes(t, h, h, d, 8, h, 2) == 12 * t * h * d
    assert attention_activation_bytes(t, h, h, d, 8, 8, 2) == 12 * t * 8 * d
    # GQA 64:8, P = 8, U = 8: one KV head per rank per stage (8 across the group)
    assert attention_activation_bytes(t, 64, 8, d, 8, 8, 2) == 2 * t * (8 + 16) * d * 2
