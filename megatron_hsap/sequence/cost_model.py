"""One cost model for placing packed documents: attention mask area plus a per-token linear cost.

The planning report (``tools/plan_report.py``) quotes it; the placement (``placement.py``) balances the attention
term alone (equal shares, a padded member included: docs/sequence_aware.md, "Cost model"). Units are forward FLOPs of one
transformer layer, counted like ``BatchPlan.stats`` (forward FLOPs 4 x mask area x heads x head_dim):

- attention: ``4 * area * num_heads_q * head_dim``, where ``area`` is the number of
  (query, key) pairs the mask allows (QK^T and PV, 2 FLOPs per multiply-add each);
- everything else that scales with the token count (Q/K/V/O projections and the MLP):
  ``2 * weights`` FLOPs per token.

Because every CP rank holds the same number of tokens, the linear term is the same on
every full rank (a rank with tail padding does a little less); it tells how much the attention imbalance weighs
in a layer's total work. The defaults describe Llama-3-8B (32 query heads, 8 KV heads,
head_dim 128, hidden 4096, SwiGLU MLP of width 14336): there a token's linear work
equals the attention of one query against ~26.6K keys.
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def causal_area(start: int, end: int) -> int:
    """(query, key) pairs of queries ``[start, end)`` of one document attending causally from its first token.

    Query at in-document position p sees keys 0..p, i.e. p + 1 pairs.
    """
    if end <= start:
        return 0
    return (end - start) * (start + end + 1) // 2


def block_area(q_start: int, q_end: int, k_start: int, k_end: int, causal: bool = True) -> int:
    """(query, key) pairs of one block of one document: queries ``[q_start, q_end)``, keys ``[k_start, k_end)``.

    Positions are in-document positions; ``causal`` keeps only key <= query (the document's
    own causal mask, not the bottom-right block alignment of the kernels).
    """
    if q_end <= q_start or k_end <= k_start:
        return 0
    if not causal:
        return (q_end - q_start) * (k_end - k_start)
    # Query p sees keys [k_start, min(p + 1, k_end)): none below k_start, a ramp up to k_end, then all of them.
    ramp_lo, ramp_hi = max(q_start, k_start), min(q_end, k_end)
    area = 0
    if ramp_hi > ramp_lo:
        area += (ramp_hi - ramp_lo) * (ramp_lo + ramp_hi + 1 - 2 * k_start) // 2
    flat_lo = max(q_start, k_end)
    if q_end > flat_lo:
        area += (q_end - flat_lo) * (k_end - k_start)
    return area


@dataclass(frozen=True)
class CostModel:
    """Forward FLOPs of one layer as a function of the tokens and mask area a rank holds.

    num_heads_q / num_heads_kv / head_dim: attention geometry of the whole layer (before
    TP); hidden_size and ffn_hidden_size: the projections and the gated (SwiGLU) MLP.
    """

    num_heads_q: int = 32
    num_heads_kv: int = 8
    head_dim: int = 128
    hidden_size: int = 4096
    ffn_hidden_size: int = 14336

    def __post_init__(self) -> None:
        for name in ("num_heads_q", "num_heads_kv", "head_dim", "hidden_size", "ffn_hidden_size"):
            _check_positive(name, getattr(self, name))

    @property
    def pair_flops(self) -> int:
        """Forward FLOPs of one allowed (query, key) pair over all heads: 4 * num_heads_q * head_dim."""
        return 4 * self.num_heads_q * self.head_dim

    @property
    def token_flops(self) -> int:
        """Forward FLOPs per token outside attention: QKV and output projections plus the gated MLP."""
        q_out, kv_out = self.num_heads_q * self.head_dim, self.num_heads_kv * self.head_dim
        weights = self.hidden_size * (2 * q_out + 2 * kv_out) + 3 * self.hidden_size * self.ffn_hidden_size
        return 2 * weights

    @property
    def linear_weight(self) -> float:
        """A token's linear cost in units of attention pairs (what the placement adds per token)."""
        return self.token_flops / self.pair_flops

    def attention_flops(self, area: int) -> int:
        """Forward attention FLOPs of ``area`` (query, key) pairs."""
        return self.pair_flops * area

    def segment_cost(self, start: int, end: int) -> float:
        """Cost, in attention pairs, of holding tokens ``[start, end)`` of a document (causal attention + linear)."""
        return causal_area(start, end) + self.linear_weight * max(0, end - start)

    def flops(self, area: int, tokens: int) -> int:
        """Forward FLOPs of a rank (or member) holding ``tokens`` tokens whose queries cover ``area`` pairs."""
        return self.pair_flops * area + self.token_flops * tokens
