"""The oracles other tests lean on, tested themselves.

- ``check_layout``, the coverage check of every placement test: it must reject each kind of bad layout (a token
  missing, a token twice, a segment outside its document, a rank over capacity, ranks out of order).
- The EOD-to-document convention (``document_cu_seqlens`` and the plan's in-document positions) must be
  Megatron-Core's: its own mask and position builder (``gpt_dataset._get_ltor_masks_and_position_ids`` with
  ``reset_position_ids`` and ``reset_attention_mask``) on the same packed samples.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.layouts import check_layout, zigzag_layout
from megatron_hsap.sequence.plan import plan_batch
from megatron_hsap.training.packing import document_cu_seqlens

LENGTHS = [5, 0, 9, 2]  # 16 tokens, a zero-length document included


def test_check_layout_accepts_a_real_layout():
    segments, tokens_per_rank = zigzag_layout(LENGTHS, 2)
    check_layout(segments, LENGTHS, tokens_per_rank)


GOOD = [[(0, 0, 5), (2, 0, 3)], [(2, 3, 9), (3, 0, 2)]]  # 8 tokens per rank


@pytest.mark.parametrize("segments,tokens_per_rank,message", [
    ([[(0, 0, 5), (2, 0, 3)], [(2, 4, 9), (3, 0, 2)]], 8, "cover document 2 exactly once at token 3"),
    ([[(0, 0, 5), (2, 0, 4)], [(2, 3, 9), (3, 0, 2)]], 9, "cover document 2 exactly once"),
    ([[(0, 0, 5), (2, 0, 3)], [(2, 3, 10), (3, 0, 1)]], 8, r"segment \(2, 3, 10\) is outside document 2"),
    (GOOD, 7, "more than tokens_per_rank=7 tokens on CP rank 0"),
    ([[(0, 0, 5), (2, 0, 3)], [(2, 3, 9), (4, 0, 2)]], 8, r"segment \(4, 0, 2\) is outside document 4"),
    ([[(0, 0, 5), (1, 0, 1), (2, 0, 3)], [(2, 3, 9), (3, 0, 2)]], 9, "outside document 1"),
], ids=["token_missing", "token_twice", "past_the_end", "over_capacity", "no_such_document", "empty_document"])
def test_check_layout_rejects_bad_layouts(segments, tokens_per_rank, message):
    check_layout(GOOD, LENGTHS, 8)  # each case is one edit from this valid layout
    with pytest.raises(AssertionError, match=message):
        check_layout(segments, LENGTHS, tokens_per_rank)


def test_check_layout_rejects_ranks_out_of_order():
    from megatron_hsap.sequence.layouts import check_table

    table = torch.tensor([[1, 0, 0, 5], [0, 2, 0, 9], [1, 3, 0, 2]]).numpy()
    with pytest.raises(AssertionError, match="not ordered by CP rank"):
        check_table(table, LENGTHS, 16)


def _samples() -> torch.Tensor:
    """[b, s] token ids, EOD = 0: EOD inside, first, last, twice in a row, and a sample without one."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(1, 50, (5, 24), generator=gen)
    tokens[0, [3, 10, 11, 23]] = 0
    tokens[1, [0, 7]] = 0
    tokens[3, 12] = 0
    tokens[4, torch.randperm(24, generator=gen)[:6]] = 0
    return tokens


@pytest.mark.parametrize("cp", [1, 2])
def test_documents_and_positions_follow_megatron_core(cp):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    eod = 0
    tokens = _samples()
    b, s = tokens.shape
    cu = document_cu_seqlens(tokens, eod, split_at_eod=True)
    doc_of_token = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    causal = torch.ones(s, s).tril().bool()
    plan = plan_batch(cu, CPTopology.offline(cp, 1, cp), "zigzag")
    positions = torch.zeros(b * s, dtype=torch.int64)
    for rank in range(cp):
        index = plan.global_indices_of(rank)
        positions[index[index >= 0]] = plan.position_ids_of(rank)[index >= 0]
    for row in range(b):
        masked, _, megatron_positions = _get_ltor_masks_and_position_ids(
            tokens[row], eod, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
            create_attention_mask=True)
        docs = doc_of_token[row * s:(row + 1) * s]
        ours = (docs[:, None] == docs[None, :]) & causal  # True = may attend
        assert torch.equal(ours, ~masked[0]), row
        assert torch.equal(positions[row * s:(row + 1) * s], megatron_positions), row
