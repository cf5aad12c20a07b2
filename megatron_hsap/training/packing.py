"""One packed micro-batch -> this CP rank's share, laid out by a ``BatchPlan``.

A micro-batch ``[b, s]`` is read as ONE token stream of ``b*s`` tokens (THD). Its
documents end at sample boundaries and, with ``--reset-attention-mask``, after
every EOD token (Megatron's semantics: the EOD belongs to the document it ends).
Every rank derives the same ``cu_seqlens`` from the same tokens, so all ranks
build the same plan without communicating.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict

import torch

from megatron_hsap.megatron.attention import HSAPPackedSeqParams
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.plan import plan_batch

__all__ = ["PackedMicroBatch", "document_cu_seqlens", "pack_micro_batch"]


@dataclass
class PackedMicroBatch:
    """This CP rank's tokens of one micro-batch, in plan order (padding slots: token 0, loss mask 0).

    tokens / labels / position_ids: int64 ``[1, t_local]``; loss_mask: float32 ``[1, t_local]``;
    num_loss_tokens: loss-carrying tokens of the whole micro-batch (all CP ranks), the loss denominator.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: HSAPPackedSeqParams
    num_loss_tokens: int

    def to(self, device: torch.device) -> "PackedMicroBatch":
        """This micro-batch with its tensors (and ``cu_seqlens``) on ``device``; ``self`` when already there.

        Packing and planning run on the host; on CUDA the copies go through pinned memory
        with ``non_blocking=True`` so they overlap with work already queued. The plan itself
        stays host-side; its positions (RoPE's, in every attention layer) go to the device here,
        once per micro-batch (``BatchPlan.position_ids_on``), and its small index tables on first use
        (cached).
        """
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        plan = self.packed_seq_params.plan

        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and t.device.type == "cpu":
                return t.pin_memory().to(device, non_blocking=True)
            return t.to(device)

        old = self.packed_seq_params
        cu_q = move(old.cu_seqlens_q)
        params = replace(old, cu_seqlens_q=cu_q,
                         cu_seqlens_kv=cu_q if old.cu_seqlens_kv is old.cu_seqlens_q else move(old.cu_seqlens_kv))
        return PackedMicroBatch(tokens=move(self.tokens), labels=move(self.labels), loss_mask=move(self.loss_mask),
                                position_ids=plan.position_ids_on(device).unsqueeze(0), packed_seq_params=params,
                                num_loss_tokens=self.num_loss_tokens)


def document_cu_seqlens(tokens: torch.Tensor, eod: int, split_at_eod: bool) -> torch.Tensor:
    """int32 ``[num_docs + 1]`` document boundaries of the flattened stream of ``tokens`` ``[b, s]``."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must have layout [b, s], got shape {tuple(tokens.shape)}")
    b, s = tokens.shape
    ends = set(range(s, b * s + 1, s))
    if split_at_eod:
        ends.update((torch.nonzero(tokens.reshape(-1) == eod).view(-1) + 1).tolist())
    return torch.tensor([0] + sorted(ends), dtype=torch.int32)


def pack_micro_batch(batch: Dict[str, torch.Tensor], eod: int, split_at_eod: bool, topology: CPTopology,
                     layout: str) -> PackedMicroBatch:
    """Plan the micro-batch (``tokens``/``labels``/``loss_mask`` ``[b, s]``, identical on all CP ranks) and shard it."""
    cu_seqlens = document_cu_seqlens(batch["tokens"], eod, split_at_eod)
    plan = plan_batch(cu_seqlens, topology, layout)
    expected = -(-batch["tokens"].numel() // topology.cp_size)
    if plan.tokens_per_rank != expected:  # pipeline stages exchange fixed-size activations
        raise RuntimeError(f"the {layout!r} plan put {plan.tokens_per_rank} token slots on each CP rank, expected "
                           f"{expected}; pipeline parallelism needs a fixed number of tokens per rank")
    loss_mask = batch["loss_mask"].reshape(-1).float()
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    params = HSAPPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max_len, max_seqlen_kv=max_len, plan=plan)
    return PackedMicroBatch(
        tokens=plan.shard(batch["tokens"].reshape(-1)).unsqueeze(0),
        labels=plan.shard(batch["labels"].reshape(-1)).unsqueeze(0),
        loss_mask=plan.shard(loss_mask).unsqueeze(0),
        position_ids=plan.position_ids.unsqueeze(0),
        packed_seq_params=params,
        num_loss_tokens=int(loss_mask.sum()))
