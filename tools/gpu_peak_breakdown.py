"""What is live at the peak of one attention block's forward + backward on a GPU, by allocating line.

``tools/gpu_check.py`` S2 reports the peaks of the plain (Ulysses) and head-chunked (UPipe) attention
block; this names the tensors behind them. It records the CUDA caching allocator's trace
(``torch.cuda.memory._record_memory_history``) while the block of S2 runs (same shapes: Llama-3-8B
attention, bf16, ``--tokens`` per rank, CP 1), replays the trace to the moment of the peak and groups
the allocations live then by the innermost lines of this package (or gpu_check) that made them. Sizes
are printed in units of one ``[tokens, hidden]`` bf16 tensor, so they do not depend on ``--tokens``.
Needs CUDA (docs/gpu.md quotes a run).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import gpu_check  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths  # noqa: E402
from megatron_hsap.sequence.plan import plan_batch  # noqa: E402


def _site(frames: List[dict]) -> str:
    """The innermost three frames in this package or gpu_check ("file:line:function < ..."); "(no Python
    frame)" for allocations made inside the autograd engine (e.g. the gradient of the block's output)."""
    ours = [f for f in frames if "megatron_hsap" in f["filename"] or "gpu_check" in f["filename"]]
    if not ours:
        return "(no Python frame)"
    return " < ".join(f'{os.path.basename(f["filename"])}:{f["line"]}:{f["name"]}' for f in ours[:3])


def live_at_peak(trace: List[dict]) -> Tuple[int, Dict[str, int]]:
    """Replays one device's allocator trace: (peak bytes, bytes live at the peak per allocating site).
    Blocks allocated before the recording began are not in the trace and not counted."""
    live: Dict[int, Tuple[int, str]] = {}
    current = peak = 0
    at_peak: Dict[int, Tuple[int, str]] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _site(event.get("frames", [])))
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    sites: Dict[str, int] = collections.Counter()
    for size, site in at_peak.values():
        sites[site] += size
    return peak, dict(sites)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072, help="tokens per rank (default 131072)")
    parser.add_argument("--top", type=int, default=12, help="sites printed per path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_peak_breakdown.py needs CUDA (it reads the CUDA caching allocator's trace)")
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = gpu_check.Sizes()
    unit = args.tokens * sizes.hidden * 2
    gen = torch.Generator(device=device).manual_seed(2)
    params = gpu_check._layer_params(sizes, device, gen)
    with gpu_check.one_rank_cp_group(device, "auto") as topology:
        lengths = [min(sizes.mem_doc_len, args.tokens - s) for s in range(0, args.tokens, sizes.mem_doc_len)]
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topology, "contiguous")
        for kind in ("ulysses", "upipe"):
            x = torch.randn(args.tokens, sizes.hidden, device=device, dtype=torch.bfloat16, generator=gen)
            grad_y = torch.randn_like(x)
            x.requires_grad_(True)
            torch.cuda.synchronize(device)
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
            y = gpu_check._attention_block(kind, x, params["wqkv"], params["wo"], plan, sizes)
            y.backward(grad_y)
            torch.cuda.synchronize(device)
            trace = torch.cuda.memory._snapshot()["device_traces"][device.index]
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, sites = live_at_peak(trace)
            print(f"{kind}: peak {peak / unit:.3f} x [tokens, hidden] bf16 ({peak / 2 ** 30:.2f} GiB at "
                  f"{args.tokens} tokens)")
            for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"  {size / unit:7.3f}  {site}")
            del x, grad_y, y
            for p in params.values():
                p.grad = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
