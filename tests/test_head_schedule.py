"""The UPipe head schedule (pure bookkeeping): every valid (H, H_kv, P, U) up to H = 64, checked exhaustively."""

from __future__ import annotations

from typing import Iterator, Tuple

import pytest

from megatron_hsap.attention.head_schedule import attention_activation_bytes, build_head_schedule


def _valid_shapes(max_heads: int = 64) -> Iterator[Tuple[int, int, int, int]]:
    for p in (1, 2, 3, 4, 8):
        for h in range(p, max_heads + 1, p):
            for h_kv in (k for k in range(1, h + 1) if h % k == 0 and (k % p == 0 or p % k == 0)):
                for u in (c for c in range(p, h + 1, p) if h % c == 0):
                    yield h, h_kv, p, u


SHAPES = list(_valid_shapes())


def test_shape_sweep_is_not_empty():
    assert len(SHAPES) > 1000
    for required in ((16, 16, 4, 4), (16, 4, 4, 4), (32, 8, 4, 4), (16, 2, 4, 4), (16, 1, 4, 4), (64, 16, 8, 8),
                     (12, 4, 2, 2), (64, 8, 8, 8), (12, 4, 2, 4)):
        assert required in SHAPES


def test_every_query_head_once_and_its_kv_present():
    """Each query head runs exactly once; when it runs, its KV head is held by the rank that attends it."""
    for h, h_kv, p, u in SHAPES:
        s = build_head_schedule(h, h_kv, p, u)
        assert len(s.stages) == h // u
        seen = []
        held = [set() for _ in range(p)]
        received, finished = [], []
        for stage in s.stages:
            for r in range(p):
                assert len(stage.query_heads[r]) == u // p
                held[r] |= set(stage.new_kv[r])
                received += stage.new_kv[r]
                for q in stage.query_heads[r]:
                    assert s.query_kv(q) in held[r], (h, h_kv, p, u, q)
                    assert s.kv_head(s.query_kv(q)) == q // (h // h_kv)  # the KV head Megatron pairs q with
                    seen.append(q)
                held[r] -= set(stage.done_kv[r])
                finished += stage.done_kv[r]
                # every rank sends/receives the same number of heads: the all-to-all stays uniform
                assert len(stage.new_kv[r]) == len(stage.new_kv[0])
                assert len(stage.done_kv[r]) == len(stage.done_kv[0])
        assert sorted(seen) == list(range(h)), (h, h_kv, p, u)
        assert sorted(received) == sorted(finished) == list(range(max(h_kv, p)))  # each KV head sent once
        assert all(not x for x in held)


def test_attention_kv_matches_the_kernel_gqa_convention():
    """attn_kv expanded the kernel's way (query i uses KV i // (m / h_kv')) gives each query head its own KV head."""
    for h, h_kv, p, u in SHAPES:
        s = build_head_schedule(h, h_kv, p, u)
        for stage in s.stages:
            for r in range(p):
                kv, queries = stage.attn_kv[r], stage.query_heads[r]
                assert len(queries) % len(kv) == 0
                per = len(queries) // len(kv)
                assert [kv[i // per] for i in range(len(queries))] == [s.query_kv(q) for q in queries]


def test_reference_geometry_for_u_equal_p():
    """REFERENCE.md 1.1: with U = P, kv_head = (s // g) * P + r and query_head = kv_head * g + s % g."""
    for h, h_kv, p, u in SHAPES:
        if u != p:
            continue
        s = build_head_schedule(h, h_kv, p, u)
        g = h // max(h_kv, p)
        for i, stage in enumerate(s.stages):
            for r in range(p):
                kv = (i // g) * p + r
                assert stage.query_heads[r] == (kv * g + i % g,)
                assert stage.attn_kv[r] == (kv,)


def test_weight_units_follow_megatron_fused_qkv_layout():
    """Units index Megatron's linear_qkv rows viewed as [H_kv, G + 2, d]: G query heads, then key, then value."""
    for h, h_kv, p, u in SHAPES:
        s = build_head_schedule(h, h_kv, p, u)
        g = h // h_kv
        labels = [[grp * (g + 2) + i for i in range(g + 2)] for grp in range(h_kv)]
        query_label = [labels[grp][i] for grp in range(h_kv) for i in range(g)]
        assert [s.query_unit(q) for q in range(h)] == query_label
        for j in range(max(h_kv, p)):
            assert s.key_unit(j) == labels[s.kv_head(j)][g]
            assert s.value_unit(j) == labels[s.kv_head(j)][g + 1]
        for stage in s.stages:
            m, n, c = u // p, len(stage.new_kv[0]), len(stage.done_kv[0])
            assert len(s.send_units(stage)) == p * (m + 2 * n)
            assert len(s.grad_units(stage)) == p * (m + 2 * c)


def test_paper_defect_case_maps_every_head_back_once():
    """64 query heads, 16 KV heads, P = 8 (the paper's code yields duplicate indices here): a permutation."""
    s = build_head_schedule(64, 16, 8, 8)
    order = [q for stage in s.stages for heads in stage.query_heads for q in heads]
    assert sorted(order) == list(range(64)) and len(set(order)) == 64
    assert s.kv_heads_sent == 2 and s.kv_heads_sent_every_stage == 8


def test_replicated_kv_heads():
    """H_kv < P: each KV head is replicated P / H_kv times; replicas of KV head k sit on adjacent ranks."""
    s = build_head_schedule(16, 2, 4, 4)
    assert s.kv_replicas == 2 and s.effective_kv_heads == 4
    assert [s.kv_head(j) for j in range(4)] == [0, 0, 1, 1]
    assert s.stages[0].query_heads == ((0,), (4,), (8,), (12,))


@pytest.mark.parametrize("args,pattern", [
    ((16, 4, 4, 6), "head_chunk_size=6 must be a multiple of ulysses_size=4; allowed values: [4, 8, 16]"),
    ((16, 4, 4, 12), "head_chunk_size=12 must divide num_heads_q=16"),
    ((16, 3, 4, 4), "num_heads_kv=3 must divide num_heads_q=16"),
    ((18, 6, 4, 4), "num_heads_q=18 (per TP rank) must be divisible by ulysses_size=4"),
    ((24, 6, 4, 4), "num_heads_kv=6 (per TP rank) must be a multiple of ulysses_size=4 or divide it"),
    ((16, 4, 0, 4), "ulysses_size=0 must be a positive int"),
])
def test_errors_name_the_argument(args, pattern):
    with pytest.raises(ValueError) as info:
        build_head_schedule(*args)
    assert pattern in str(info.value)


def test_activation_bytes_match_reference_accounting():
    """MHA, U = H, bf16: REFERENCE.md 1.1's 12 * (S/C) * H * d; U = C cuts it by H / C (87.5 % at H = 64, C = 8)."""
    t, h, d = 1000, 64, 128
    assert attention_activation_bytes(t, h, h, d, 8, h, 2) == 12 * t * h * d
    assert attention_activation_bytes(t, h, h, d, 8, 8, 2) == 12 * t * 8 * d
    # GQA 64:8, P = 8, U = 8: one KV head per rank per stage (8 across the group)
    assert attention_activation_bytes(t, 64, 8, d, 8, 8, 2) == 2 * t * (8 + 16) * d * 2
