"""A reference for demos and tools: per-document PyTorch SDPA in fp64, sharing no code with the CP path.

(The test suite has its own, fully dense reference in tests/reference.py.)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_lengths: Sequence[int],
                   causal: bool = True) -> torch.Tensor:
    """Attention of a global packed batch, one SDPA call per document, in fp64.

    q ``[T, h_q, d]``, k/v ``[T, h_kv, d]`` (all ranks' tokens in global order; KV heads
    repeated for GQA). Returns ``[T, h_q, d]`` float64.
    """
    g = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    start = 0
    for n in doc_lengths:
        if n:
            qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
            ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
            out[start:start + n] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1)
        start += n
    return out
