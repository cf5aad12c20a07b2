"""Ulysses all-to-all bytes of one attention layer's forward for uneven head counts: the exact KV split vs replication.

For each (H, H_kv, P) it prints, summed over the P ranks of one Ulysses group (t tokens per rank,
head_dim d, bf16), the bytes of the forward all-to-alls (q, k, v in, the output back):

- ``split``: this package (``megatron_hsap.head_split``): each rank receives its floor/ceil(H/P) query heads
  and exactly the KV heads they use; taken from ``BatchPlan.stats`` (the figure the tests check against
  measured bytes);
- ``all_kv``: every rank receives every KV head (full KV replication over the group);
- ``kv_per_q``: KV expanded to one copy per query head (GQA turned into MHA before the all-to-all).

    PYTHONPATH=. .venv/bin/python tools/head_split_bytes.py
    PYTHONPATH=. .venv/bin/python tools/head_split_bytes.py --shapes 28,4,8 64,8,8 --tokens-per-rank 8192
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hsap.head_split import split_heads  # noqa: E402
from megatron_hsap.parallel_state import CPTopology  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths  # noqa: E402
from megatron_hsap.sequence.plan import plan_batch  # noqa: E402

SHAPES = ["28,4,8", "40,8,8", "12,3,4", "20,5,4", "24,6,4", "12,2,3", "7,7,4", "9,3,2"]


def group_bytes(h: int, h_kv: int, p: int, t: int, d: int, elem: int) -> Tuple[int, int, int]:
    """(split, all_kv, kv_per_q): forward all-to-all bytes summed over one Ulysses group."""
    plan = plan_batch(cu_seqlens_from_lengths([t * p]), CPTopology.offline(p, p, p), "contiguous")
    stats = plan.stats(h, h_kv, d, torch.bfloat16)
    split = sum(stats.send_bytes_intra) + sum(stats.send_bytes_inter)
    counts = split_heads(h, h_kv, p).query_counts
    slice_bytes = t * d * elem  # one head of one rank's tokens, to one peer

    def total(kv_of_rank: List[int]) -> int:
        # rank r receives (q + 2 kv) heads from each of its P - 1 peers and sends its output heads to each
        return sum((p - 1) * slice_bytes * (2 * counts[r] + 2 * kv_of_rank[r]) for r in range(p))

    return split, total([h_kv] * p), total(list(counts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="H,H_kv,P triples")
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    t, d, elem = args.tokens_per_rank, args.head_dim, 2
    print(f"# forward Ulysses all-to-all bytes per layer, summed over one group; t={t} tokens per rank, d={d}, bf16")
    print(f"{'H,H_kv,P':>10} {'q heads/rank':>14} {'KV heads/rank':>15} {'split MiB':>10} {'all_kv MiB':>11} "
          f"{'kv_per_q MiB':>13} {'split/all_kv':>13} {'split/kv_per_q':>15}")
    for shape in args.shapes:
        h, h_kv, p = (int(x) for x in shape.split(","))
        heads = split_heads(h, h_kv, p)
        split, all_kv, per_q = group_bytes(h, h_kv, p, t, d, elem)
        mib = 2 ** 20
        print(f"{shape:>10} {'/'.join(map(str, sorted(set(heads.query_counts)))):>14} "
              f"{','.join(map(str, heads.kv_counts)):>15} {split / mib:>10.1f} {all_kv / mib:>11.1f} "
              f"{per_q / mib:>13.1f} {split / all_kv:>13.3f} {split / per_q:>15.3f}")


if __name__ == "__main__":
    main()
