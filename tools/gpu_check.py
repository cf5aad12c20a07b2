#!/usr/bin/env python
"""Staged GPU validation: S0 environment, S1 kernels vs fp64, S2 one rank, S3 several ranks on one GPU,
S4 training runs, S5 speed; each stage in its own subprocess (the dry run: a forked process) with its own
time cap.

    python tools/gpu_check.py [OUT_DIR]              # one GPU, at most 9 minutes; OUT_DIR defaults to $OUT
    python tools/gpu_check.py OUT_DIR --dry-run      # every stage on CPU (gloo, reference kernel, tiny shapes)

Writes OUT_DIR/<stage>.json from each stage and OUT_DIR/gpu_check.json (every stage so far)
after each stage, so a run cut short still returns what it measured, and prints one line per
stage. What each stage checks and measures, the caps and the one-run recipe: docs/gpu.md.

Kernel figures: TFLOP/s from the mask area (forward 4*area*h_q*d, backward 2.5x) of one causal
sequence for the heads one rank holds in plain Ulysses (H/C query heads) and in one UPipe stage
(U/C); the ratio stage/all is the kernel-level cost of head chunking (the UPipe paper's premise
that attention is compute-bound at long context). Memory: the package's own attention at CP = 1
(all-to-alls are identity) on the per-rank tokens of an 8-way job, Llama-3-8B shapes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_hsap.attention.context_parallel import context_parallel_attention  # noqa: E402
from megatron_hsap.attention.upipe import head_chunked_attention  # noqa: E402
from megatron_hsap.config import ContextParallelConfig  # noqa: E402
from megatron_hsap.instrumentation.memory import track_peak_memory  # noqa: E402
from megatron_hsap.kernels import get_kernel  # noqa: E402
from megatron_hsap.kernels.base import AttentionBlocks, AttentionKernel  # noqa: E402
from megatron_hsap.kernels.gpu_common import merge_partial  # noqa: E402
from megatron_hsap.parallel_state import CPTopology, destroy_model_parallel, initialize_model_parallel  # noqa: E402
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths, sample_doc_lengths  # noqa: E402
from megatron_hsap.sequence.plan import BatchPlan, plan_batch  # noqa: E402

GPU_KERNELS = ("flash", "te")
TORCH_KERNEL_DOC_LEN = 512  # section 3 document length when only the torch kernel is there


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run (GPU defaults, or tiny ones for the CPU smoke run)."""

    eq_tokens: int = 8192             # section 1: packed tokens per case (the bf16 baseline is dense)
    eq_heads: Tuple[int, int] = (32, 8)
    eq_head_dims: Tuple[int, ...] = (64, 128)
    head_dim: int = 128
    hidden: int = 4096                # Llama3-8B
    heads: int = 32
    kv_heads: int = 8
    cp: int = 8                       # C: ranks of the modelled job (per-rank shapes)
    stage_heads: int = 8              # U: query heads per UPipe stage
    lengths: Tuple[int, ...] = (32768, 65536, 131072, 262144, 524288, 1048576)
    mem_context: int = 5 * 1024 * 1024  # section 3: total context of the modelled job
    mem_doc_len: int = 32768          # section 3: document length of the packed mask (memory does not depend on it)
    ffn_hidden: int = 14336           # section 3: Llama3-8B MLP
    mlp_chunk: int = 65536            # section 3: tokens per tile of the sequence-tiled MLP
    train_seq: int = 4096
    train_iters: int = 20
    s3_tokens: int = 4096             # S3: packed tokens of the multi-rank checks (dense fp64 reference)


CPU_SIZES = Sizes(eq_tokens=128, eq_heads=(4, 2), eq_head_dims=(16,), head_dim=16, hidden=64, heads=8, kv_heads=4, cp=4, stage_heads=4,
                  lengths=(128, 256), mem_context=1024, mem_doc_len=128, ffn_hidden=128, mlp_chunk=128,
                  train_seq=64, train_iters=4, s3_tokens=96)


# ---------------------------------------------------------------- helpers

def packed_causal_blocks(lengths: List[int]) -> AttentionBlocks:
    """One causal diagonal block per document of a packed batch."""
    blocks, start = [], 0
    for n in lengths:
        blocks.append((start, start + n, start, start + n, True))
        start += n
    return AttentionBlocks.from_list(blocks)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Mean seconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / reps


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return float((a.float() - b.float())[finite].abs().max()) if finite.any() else 0.0


# ---------------------------------------------------------------- section 1: equivalence

def _equivalence_cases(sizes: Sizes) -> Dict[str, Tuple[AttentionBlocks, Optional[AttentionBlocks]]]:
    """name -> (blocks, second call's blocks for a two-call ring step or None)."""
    t = sizes.eq_tokens
    packed = sample_doc_lengths(t, seed=11, max_doc_len=t // 4)
    half = t // 2
    first = [(0, half, 0, half, True)]
    second = [(half, t, half, t, True)]
    rest = sample_doc_lengths(t - 3, seed=12, max_doc_len=(t - 3) // 2)
    with_singles = rest[:1] + [1, 1, 1] + rest[1:]  # length-1 documents between longer ones
    window = (t // 16, 0)
    return {
        "packed-causal": (packed_causal_blocks(packed), None),
        "length-1-documents": (packed_causal_blocks(with_singles), None),
        "window": (AttentionBlocks.from_list([b + (window,) for b in packed_causal_blocks([t])]), None),
        "one-document": (packed_causal_blocks([t]), None),
        # ring step: the second half's rows see the first half's keys in a separate call, merged by LSE
        "ring-two-calls": (AttentionBlocks.from_list(first + second), AttentionBlocks.from_list(
            [(half, t, 0, half, False)])),
        # several blocks per query row in one call: exercises the pass split and merge inside the kernel
        "multi-pass": (AttentionBlocks.from_list(second + [(half, t, 0, half, False), (0, half, 0, half, True)]),
                       None),
    }


def dense_mask(blocks: AttentionBlocks, t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """bool ``[t_q, t_k]``: True where a block lets the query row see the key (bottom-right causal, windows)."""
    mask = torch.zeros(t_q, t_k, dtype=torch.bool, device=device)
    for qs, qe, ks, ke, lo, hi in blocks.bands():
        offset = torch.arange(ks, ke, device=device)[None, :] - torch.arange(qs, qe, device=device)[:, None]
        block = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=device)
        if lo is not None:
            block &= offset >= lo
        if hi is not None:
            block &= offset <= hi
        mask[qs:qe, ks:ke] |= block
    return mask


def dense_lowp_attention(q, k, v, dout, mask: torch.Tensor, scale: float):
    """flash-attn's test baseline: dense attention in the inputs' dtype (bf16 products, softmax cast back).

    q/dout ``[t, h_q, d]``, k/v ``[t_k, h_kv, d]``, mask ``[t, t_k]``. Returns out, lse ``[h_q, t]`` and
    dq, dk, dv, one KV head group at a time to bound memory.
    """
    g = q.shape[1] // k.shape[1]
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    empty_rows = ~mask.any(-1)
    for j in range(k.shape[1]):
        heads = slice(j * g, (j + 1) * g)
        qj, kj, vj = (x.detach().requires_grad_(True) for x in (q[:, heads], k[:, j], v[:, j]))
        scores = torch.einsum("qgd,kd->gqk", qj * scale, kj).masked_fill(~mask, float("-inf"))
        lse[heads] = torch.logsumexp(scores.detach().float(), dim=-1)
        probs = torch.softmax(scores, dim=-1).masked_fill(empty_rows[:, None], 0.0).to(vj.dtype)
        oj = torch.einsum("gqk,kd->qgd", probs, vj)
        oj.backward(dout[:, heads])
        out[:, heads], dq[:, heads], dk[:, j], dv[:, j] = oj.detach(), qj.grad, kj.grad, vj.grad
    return out, lse, [dq, dk, dv]


def _run_calls(kernel: AttentionKernel, q, k, v, dout, calls: List[AttentionBlocks], scale: float):
    """Forward of each call, LSE merge, backward of each call with the merged out/lse; grads summed."""
    out, lse = kernel.forward(q, k, v, calls[0], scale)
    for blocks in calls[1:]:
        out_b, lse_b = kernel.forward(q, k, v, blocks, scale)
        merged, lse = merge_partial(out, lse, out_b, lse_b)
        out, lse = merged.to(q.dtype), lse.float()
    grads = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v)]
    for blocks in calls:
        for acc, g in zip(grads, kernel.backward(dout, q, k, v, out, lse, blocks, scale)):
            acc += g
    return out, lse, grads


def section_equivalence(sizes: Sizes, device: torch.device, kernels: List[str]) -> dict:
    if not kernels:
        return {"rows": [], "all_pass": None, "skipped": "neither flash-attn nor TransformerEngine is installed"}
    torch_kernel = get_kernel("torch")
    h_q, h_kv = sizes.eq_heads
    t = sizes.eq_tokens
    rows = []
    for d, (case, (blocks, extra)) in ((d, c) for d in sizes.eq_head_dims for c in _equivalence_cases(sizes).items()):
        gen = torch.Generator(device=device).manual_seed(0)
        make = lambda h: torch.randn(t, h, d, device=device, dtype=torch.bfloat16, generator=gen)  # noqa: E731
        q, k, v, dout = make(h_q), make(h_kv), make(h_kv), make(h_q)
        scale = d ** -0.5
        calls = [blocks] + ([extra] if extra is not None else [])
        # the dense fp64 reference: the reference kernel on the bf16 values held in fp64
        ref = _run_calls(torch_kernel, q.double(), k.double(), v.double(), dout.double(), calls, scale)
        mask = torch.zeros(t, t, dtype=torch.bool, device=device)
        for c in calls:
            mask |= dense_mask(c, t, t, device)
        pt = dense_lowp_attention(q, k, v, dout, mask, scale)
        del mask
        for name in kernels:
            kernel = get_kernel(name)
            delegated = getattr(kernel, "fallback_calls", 0)
            got = _run_calls(kernel, q, k, v, dout, calls, scale)
            row = {"kernel": name, "case": case, "tokens": t, "heads": f"{h_q}:{h_kv}", "head_dim": d,
                   # TE calls handed to flash/torch because TE's backend query refused the shape
                   "fallback_calls": getattr(kernel, "fallback_calls", 0) - delegated}
            passed = True
            for label, index, factor in (("out", 0, 2), ("lse", 1, 2)):
                err, base = max_err(got[index], ref[index]), max_err(pt[index], ref[index])
                row[f"{label}_err"], row[f"{label}_bf16_baseline_err"] = err, base
                passed &= err <= factor * base + 1e-5
            for label, g, r, p in zip(("dq", "dk", "dv"), got[2], ref[2], pt[2]):
                err, base = max_err(g, r), max_err(p, r)
                row[f"{label}_err"], row[f"{label}_bf16_baseline_err"] = err, base
                passed &= err <= 3 * base + 1e-5
            row["lse_inf_pattern_equal"] = bool(torch.equal(torch.isfinite(got[1]), torch.isfinite(ref[1])))
            row["pass"] = bool(passed and row["lse_inf_pattern_equal"])
            rows.append(row)
    return {"rows": rows, "all_pass": all(r["pass"] for r in rows)}


# ---------------------------------------------------------------- section 2: throughput

def attention_flops(blocks: AttentionBlocks, h_q: int, d: int) -> Tuple[float, float]:
    fwd = 4.0 * blocks.area() * h_q * d
    return fwd, 2.5 * fwd


def check_head_layout(sizes: Sizes) -> None:
    """The modelled job's head split must be exact (no KV replication in this script)."""
    C, U = sizes.cp, sizes.stage_heads
    if sizes.heads % C or sizes.kv_heads % C or U % C or sizes.heads % U or U > sizes.heads:
        raise ValueError(f"heads={sizes.heads}, kv_heads={sizes.kv_heads}, stage_heads={U} must all be multiples "
                         f"of cp={C}, and stage_heads must divide heads")


def rank_heads(sizes: Sizes) -> Dict[str, Tuple[int, int]]:
    """(query heads, KV heads) one rank attends with after the all-to-all: plain Ulysses vs one UPipe stage.

    A stage's U query heads take one head per KV group (the UPipe paper's GQA schedule), so it needs
    min(U, H_kv) KV heads.
    """
    C, U = sizes.cp, sizes.stage_heads
    return {"ulysses_all_heads": (sizes.heads // C, sizes.kv_heads // C),
            "upipe_stage": (U // C, min(U, sizes.kv_heads) // C)}


def section_throughput(sizes: Sizes, device: torch.device, kernels: List[str], budget_s: float) -> dict:
    check_head_layout(sizes)
    C, U = sizes.cp, sizes.stage_heads
    configs = rank_heads(sizes)
    rows, started = [], time.perf_counter()
    for name in kernels:
        kernel = get_kernel(name)
        rate = None  # last measured fwd+bwd FLOP/s of this kernel: predicts the next configuration's time
        for length in sizes.lengths:
            blocks = packed_causal_blocks([length])
            for label, (h_q, h_kv) in configs.items():
                fwd_flops, bwd_flops = attention_flops(blocks, h_q, sizes.head_dim)
                reps = 1 if fwd_flops > 2e14 else 3
                predicted = 0.0 if rate is None else (reps + 2) * (fwd_flops + bwd_flops) / rate  # + warm-ups
                if time.perf_counter() - started + predicted > budget_s:
                    rows.append({"kernel": name, "length": length, "config": label,
                                 "skipped": f"time budget (would take ~{predicted:.0f} s)"})
                    continue
                gen = torch.Generator(device=device).manual_seed(1)
                make = lambda h: torch.randn(length, h, sizes.head_dim, device=device,  # noqa: E731
                                             dtype=torch.bfloat16, generator=gen)
                q, k, v, dout = make(h_q), make(h_kv), make(h_kv), make(h_q)
                scale = sizes.head_dim ** -0.5
                delegated = getattr(kernel, "fallback_calls", 0)
                out, lse = kernel.forward(q, k, v, blocks, scale)
                t_fwd = timed(lambda: kernel.forward(q, k, v, blocks, scale), device, reps)
                t_bwd = timed(lambda: kernel.backward(dout, q, k, v, out, lse, blocks, scale), device, reps)
                rows.append({"kernel": name, "length": length, "config": label, "h_q": h_q, "h_kv": h_kv,
                             "fallback_calls": getattr(kernel, "fallback_calls", 0) - delegated,
                             "fwd_ms": 1e3 * t_fwd, "bwd_ms": 1e3 * t_bwd,
                             "fwd_tflops": fwd_flops / t_fwd / 1e12, "bwd_tflops": bwd_flops / t_bwd / 1e12,
                             "fwd_bwd_tflops": (fwd_flops + bwd_flops) / (t_fwd + t_bwd) / 1e12})
                rate = (fwd_flops + bwd_flops) / (t_fwd + t_bwd)
                q = k = v = dout = out = lse = None  # free before the next configuration
    ratios = []
    for r in rows:
        if r["config"] == "upipe_stage" and "skipped" not in r:
            base = next((b for b in rows if b["kernel"] == r["kernel"] and b["length"] == r["length"]
                         and b["config"] == "ulysses_all_heads" and "skipped" not in b), None)
            if base is not None:
                ratios.append({"kernel": r["kernel"], "length": r["length"],
                               "stage_over_all_fwd_bwd": r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]})
    return {"cp": C, "stage_heads": U, "rows": rows, "ratios": ratios}


# ---------------------------------------------------------------- section 3: memory (the package at CP = 1)

@contextmanager
def one_rank_cp_group(device: torch.device, kernel_name: str) -> Iterator[CPTopology]:
    """A one-process job (CP = 1) so the package's own attention code runs: NCCL on CUDA, gloo on CPU.

    One GPU cannot host a CP > 1 job: NCCL refuses two ranks of one communicator on the same device,
    and gloo has no all-to-all for CUDA tensors; multi-rank paths are covered by the CPU test suite.
    """
    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if device.type == "cuda":  # NCCL binds the process to the current device
            torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield initialize_model_parallel(context_parallel_size=1,
                                        cp_config=ContextParallelConfig(mode="ulysses", kernel=kernel_name))
    finally:
        destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def _attention_block(kind: str, x: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor, plan: BatchPlan,
                     sizes: Sizes) -> torch.Tensor:
    """One attention block through the package: x ``[n, hidden]`` -> ``[n, hidden]``.

    ``ulysses``: QKV projection kept by autograd, then ``context_parallel_attention`` (the package's
    plain path); ``upipe``: ``head_chunked_attention`` with ``stage_heads`` query heads per stage
    (projects a stage's heads only and rebuilds them in the backward). wqkv is Megatron's
    ``linear_qkv`` weight ``[(G + 2) * H_kv * d, hidden]`` (per KV group: G query heads, key, value).
    """
    n, d, h, h_kv = x.shape[0], sizes.head_dim, sizes.heads, sizes.kv_heads
    if kind == "upipe":
        out = head_chunked_attention(x.unsqueeze(1), wqkv, None, plan, num_heads_q=h, num_heads_kv=h_kv,
                                     head_dim=d, rope_base=None, head_chunk_size=sizes.stage_heads)
        return out.reshape(n, h * d) @ wo.t()
    group = h // h_kv
    qkv = (x @ wqkv.t()).view(n, h_kv, group + 2, d)
    q = qkv[:, :, :group].reshape(n, h, d)
    k, v = qkv[:, :, group].contiguous(), qkv[:, :, group + 1].contiguous()
    return context_parallel_attention(q, k, v, plan).reshape(n, h * d) @ wo.t()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight


def _swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def _layer(kind: str, x: torch.Tensor, params: Dict[str, torch.Tensor], plan: BatchPlan,
           sizes: Sizes) -> torch.Tensor:
    """One Llama-style layer on one rank: x ``[n, hidden]`` -> ``[n, hidden]``; the MLP is sequence-tiled
    (chunks of ``sizes.mlp_chunk`` tokens, each recomputed), as in the UPipe paper's long-context runs."""
    h = x + _attention_block(kind, _rms_norm(x, params["norm1"]), params["wqkv"], params["wo"], plan, sizes)
    normed = _rms_norm(h, params["norm2"])
    mlp = [checkpoint(_swiglu, normed[i:i + sizes.mlp_chunk], params["w_gate"], params["w_up"], params["w_down"],
                      use_reentrant=False) for i in range(0, normed.shape[0], sizes.mlp_chunk)]
    return h + torch.cat(mlp)


def _layer_params(sizes: Sizes, device: torch.device, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    d, hidden = sizes.head_dim, sizes.hidden
    shapes = {"wqkv": ((sizes.heads + 2 * sizes.kv_heads) * d, hidden), "wo": (hidden, sizes.heads * d),
              "w_gate": (sizes.ffn_hidden, hidden), "w_up": (sizes.ffn_hidden, hidden),
              "w_down": (hidden, sizes.ffn_hidden)}
    params = {name: (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) * shape[1] ** -0.5)
              .requires_grad_(True) for name, shape in shapes.items()}
    for name in ("norm1", "norm2"):
        params[name] = torch.ones(hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    return params


def _peak_of(run: Callable[[], None], device: torch.device) -> Tuple[int, float]:
    """Peak bytes allocated by ``run`` above what was live before it (allocator counters on CUDA, the
    dispatcher-level tracker on CPU), and its seconds."""
    synchronize(device)
    start = time.perf_counter()
    with track_peak_memory(device) as tracker:
        run()
        synchronize(device)
    return tracker.peak_bytes, time.perf_counter() - start


def section_memory(sizes: Sizes, device: torch.device, kernel_name: str, budget_s: float) -> dict:
    """Peak memory of the package's attention (plain Ulysses vs UPipe stages) on n = context / C tokens.

    At CP = 1 the package's all-to-alls are identity, so one process with n tokens and all H heads holds
    the same Q/K/V elements as one rank of a C-way job after its all-to-all (n * H = S * H / C); the
    all-to-all buffers of a real C-way job (about one stage's Q/K/V more) are not in these peaks.
    """
    check_head_layout(sizes)
    C, d = sizes.cp, sizes.head_dim
    gen = torch.Generator(device=device).manual_seed(2)
    params = _layer_params(sizes, device, gen)
    # the torch kernel's run time grows with its tile count: short documents keep it to seconds
    doc_len = sizes.mem_doc_len if kernel_name != "torch" else min(sizes.mem_doc_len, TORCH_KERNEL_DOC_LEN)
    results, started = [], time.perf_counter()
    with one_rank_cp_group(device, kernel_name) as topology:
        for context in (sizes.mem_context // 2 ** i for i in range(5)):  # halve until it fits
            n = context // C
            lengths = [min(doc_len, n - s) for s in range(0, n, doc_len)]
            plan = plan_batch(cu_seqlens_from_lengths(lengths), topology, "contiguous")
            n = plan.tokens_per_rank
            rows = []
            try:
                for scope in ("attention_block", "layer_recompute"):
                    for kind in ("ulysses", "upipe"):
                        if time.perf_counter() - started > budget_s:
                            rows.append({"scope": scope, "kind": kind, "context": context, "skipped": "time budget"})
                            continue
                        x = torch.randn(n, sizes.hidden, device=device, dtype=torch.bfloat16, generator=gen)
                        x.requires_grad_(True)
                        grad_y = torch.randn(n, sizes.hidden, device=device, dtype=torch.bfloat16, generator=gen)

                        def run() -> None:
                            if scope == "attention_block":
                                y = _attention_block(kind, x, params["wqkv"], params["wo"], plan, sizes)
                            else:  # full activation recomputation: only the layer input is kept
                                y = checkpoint(_layer, kind, x, params, plan, sizes, use_reentrant=False)
                            y.backward(grad_y)

                        peak, seconds = _peak_of(run, device)
                        heads = sizes.stage_heads if kind == "upipe" else sizes.heads
                        rows.append({"scope": scope, "kind": kind, "context": context, "tokens_per_rank": n, "cp": C,
                                     "stage_heads": heads, "peak_bytes": peak,
                                     "peak_gib": peak / 2 ** 30, "fwd_bwd_s": seconds,
                                     # the UPipe paper's count: bf16 Q/K/V + their all-to-all outputs, MHA
                                     "formula_bytes_mha": 12 * n * heads * d})
                        x = grad_y = None  # free before the next configuration
                        for p in params.values():
                            p.grad = None
            except torch.cuda.OutOfMemoryError as err:
                results.append({"context": context, "oom": str(err).splitlines()[0]})
                for p in params.values():
                    p.grad = None
                torch.cuda.empty_cache()
                continue
            results.extend(rows)
            break
    cuts = {}
    for scope in ("attention_block", "layer_recompute"):
        peaks = {r["kind"]: r["peak_bytes"] for r in results if r.get("scope") == scope and "peak_bytes" in r}
        if peaks.get("ulysses") and peaks.get("upipe") is not None:
            cuts[scope] = 1 - peaks["upipe"] / peaks["ulysses"]
    return {"kernel": kernel_name,
            "attention": "megatron_hsap context_parallel_attention (ulysses) / head_chunked_attention (upipe), CP = 1",
            "mask": f"packed causal documents of {doc_len} tokens (memory does not depend on the mask)",
            "rows": results, "upipe_peak_cut": cuts}


# ---------------------------------------------------------------- section 4: training run

def section_training(sizes: Sizes, device: torch.device, out_dir: str, timeout_s: float, cp: int = 1) -> dict:
    """``pretrain_gpt_hsap.py`` at CP = ``cp`` on this one device (several ranks share it, see ``nccl_env``)."""
    log_json = os.path.join(out_dir, f"train_log_cp{cp}.jsonl")
    if os.path.exists(log_json):
        os.remove(log_json)
    script = [os.path.join(REPO, "pretrain_gpt_hsap.py")]
    if cp > 1 and device.type == "cuda" and not multi_rank_gpu_nccl():  # each rank its own NCCL host id
        script = [os.path.abspath(__file__), "--with-rank-hostid"] + script
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp)] + script + [
           "--context-parallel-size", str(cp), "--num-layers", "2",
           "--hidden-size", str(max(64, sizes.hidden // 8)), "--num-attention-heads", str(sizes.heads),
           "--num-query-groups", str(sizes.kv_heads), "--seq-length", str(sizes.train_seq),
           "--train-iters", str(sizes.train_iters), "--lr-warmup-iters", "1", "--mock-data",
           "--log-interval", "1", "--log-json", log_json, "--no-progress-bar", "--log-throughput",
           "--eval-interval", str(max(1, sizes.train_iters // 2)), "--eval-iters", "2"]
    if device.type == "cuda":
        cmd += ["--bf16", "--attention-kernel", "auto", "--distributed-backend", "nccl"]
    else:
        cmd += ["--attention-kernel", "torch", "--distributed-backend", "gloo"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **nccl_env(None))
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, output = "timeout", (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else str(err.stdout)
    losses, evaluations, tflops = [], [], []
    if os.path.exists(log_json):
        with open(log_json) as f:
            for line in f:
                record = json.loads(line)
                if "evaluation" in record:
                    evaluations.append((record["evaluation"], record["iteration"], record["lm_loss"]))
                else:
                    losses.append(record["loss"])
                    tflops.append(record["tflops_per_gpu"])
    return {"cp": cp, "command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.perf_counter() - start,
            "losses": losses, "evaluations": evaluations, "tflops_per_gpu": tflops, "output_tail": output[-3000:],
            "trains": (rc == 0 and len(losses) >= 2 and losses[-1] < losses[0] and len(evaluations) >= 3
                       and all(math.isfinite(e[2]) for e in evaluations))}


# ---------------------------------------------------------------- several ranks on one GPU (NCCL)

MULTI_RANK_GPU_NCCL = (2, 30, 0)  # NCCL from which NCCL_MULTI_RANK_GPU_ENABLE=1 lets ranks share a GPU


def nccl_version() -> Optional[Tuple[int, ...]]:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # a CPU build: no NCCL
        return None
    return tuple(version) if isinstance(version, tuple) else (version // 10000, version // 100 % 100, version % 100)


def multi_rank_gpu_nccl() -> bool:
    version = nccl_version()
    return version is not None and version >= MULTI_RANK_GPU_NCCL


def nccl_env(rank: Optional[int]) -> Dict[str, str]:
    """Environment that lets several NCCL ranks share one GPU: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` on NCCL >= 2.30;
    before that each rank claims its own host (``NCCL_HOSTID``, given per rank: ``rank``) over loopback, so
    NCCL's duplicate-GPU check does not trigger. Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    if multi_rank_gpu_nccl():
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    env = {"NCCL_SOCKET_IFNAME": "lo"}
    if rank is not None:
        env["NCCL_HOSTID"] = f"gpu-check-rank-{rank}"
    return env


def _run_with_rank_hostid(argv: List[str]) -> None:
    """``--with-rank-hostid SCRIPT ARGS``: run SCRIPT under torchrun with this rank's NCCL host id (NCCL < 2.30)."""
    import runpy

    os.environ.update(nccl_env(int(os.environ.get("LOCAL_RANK", 0))))
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------- stages

STAGES = ("S0", "S1", "S2", "S3", "S4", "S5")
STAGE_NAMES = {"S0": "environment", "S1": "kernels vs fp64", "S2": "one rank (CP 1) and UPipe memory",
               "S3": "several ranks on one device", "S4": "training runs", "S5": "speed"}
#: seconds each stage may take on the GPU (its subprocess is killed after that); they sum to 9 minutes
STAGE_CAPS_S = {"S0": 30, "S1": 90, "S2": 90, "S3": 150, "S4": 120, "S5": 60}
DRY_RUN_CAP_S = 240  # per stage on CPU: generous, the suite's machine may be shared


def stage_cap_s(stage: str, device: torch.device) -> float:
    """Seconds ``stage`` may take: its GPU cap, or the dry run's on CPU."""
    return STAGE_CAPS_S[stage] if device.type == "cuda" else DRY_RUN_CAP_S


def _kernels_here(device: torch.device) -> List[str]:
    """The fused kernels S1 checks: torch_flash and whichever of TE / flash-attn load; the reference kernel
    stands in for them on the CPU dry run."""
    if device.type != "cuda":
        return ["torch"]
    return [name for name in ("torch_flash",) + GPU_KERNELS if _kernel_ok(name)]


def _kernel_ok(name: str) -> bool:
    try:
        get_kernel(name)
    except (ImportError, RuntimeError) as err:
        print(f"[gpu_check] kernel {name!r} unavailable: {err}", flush=True)
        return False
    return True


def stage_s0(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    """Versions (torch, CUDA, cuDNN, NCCL, compute capability) and what kernel='auto' picks for typical shapes."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl_version(),
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "capability": torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            "multi_rank_gpu_nccl": multi_rank_gpu_nccl(), **_versions()}
    auto = get_kernel("auto")
    blocks = packed_causal_blocks([64])
    picks = {}
    for dtype, d in ((torch.bfloat16, 128), (torch.bfloat16, 64), (torch.bfloat16, 256), (torch.float32, 128)):
        q = torch.zeros(64, 8, d, dtype=dtype, device=device)
        k = torch.zeros(64, 2, d, dtype=dtype, device=device)
        chosen = auto.kernel_for(q, k, k, blocks) if hasattr(auto, "kernel_for") else auto
        picks[f"{str(dtype).replace('torch.', '')} d{d}"] = chosen.name
    return {"pass": True, "versions": info, "auto_picks": picks, "summary": f"auto picks {picks}"}


def stage_s1(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    kernels = _kernels_here(device)
    result = section_equivalence(sizes, device, kernels)
    result["pass"] = bool(result["all_pass"])
    result["summary"] = f"{len(result['rows'])} kernel x case rows, kernels {kernels}"
    return result


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def stage_s2(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    """context_parallel_attention and head_chunked_attention at CP 1 against fp64, then UPipe's peak memory."""
    from megatron_hsap.reference import sdpa_reference

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-9
    h, h_kv, d = sizes.heads, sizes.kv_heads, sizes.head_dim
    lengths = sample_doc_lengths(sizes.eq_tokens, seed=5, max_doc_len=sizes.eq_tokens // 2)
    errors = {}
    with one_rank_cp_group(device, "auto") as topology:
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topology, "zigzag")
        gen = torch.Generator(device=device).manual_seed(3)
        q, k, v = (torch.randn(plan.tokens_per_rank, heads, d, device=device, dtype=torch.float64, generator=gen)
                   for heads in (h, h_kv, h_kv))
        local = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = context_parallel_attention(*local, plan)
        dout = torch.randn(out.shape, device=device, dtype=torch.float64, generator=gen)
        out.backward(dout.to(dtype))
        ref_in = [x.detach().clone().requires_grad_() for x in local]
        ref = sdpa_reference(*(plan.unshard(x).double() for x in ref_in), plan.doc_lengths)
        ref_local = plan.shard(ref)
        errors["context_parallel_out"] = _max_rel_err(out, ref_local)
        # UPipe's fused projection + attention against the unchunked projection + attention, same weights
        # weights at their usual scale (std hidden^-1/2): unit-size q and k, so the softmax is not one-hot and
        # bf16 rounding does not pick other keys; the fp64 reference runs on the same bf16-rounded values
        x = torch.randn(plan.tokens_per_rank, sizes.hidden, device=device, dtype=torch.float64, generator=gen)
        wqkv = torch.randn((h + 2 * h_kv) * d, sizes.hidden, device=device, dtype=torch.float64,
                           generator=gen) * sizes.hidden ** -0.5
        wo = torch.eye(h * d, sizes.hidden, device=device, dtype=torch.float64)
        x, wqkv, wo = (t.to(dtype) for t in (x, wqkv, wo))
        plain = _attention_block("ulysses", x, wqkv, wo.t(), plan, sizes)
        chunked = _attention_block("upipe", x, wqkv, wo.t(), plan, sizes)
        exact = _attention_block("ulysses", x.double(), wqkv.double(), wo.t().double(), plan, sizes)
        errors["ulysses_block_out"] = _max_rel_err(plain, exact)
        errors["upipe_block_out"] = _max_rel_err(chunked, exact)
    memory = section_memory(sizes, device, "auto", budget_s=stage_cap_s("S2", device) / 2)
    ratio = {scope: 1 - cut for scope, cut in memory["upipe_peak_cut"].items()}
    correct = all(e <= tol for e in errors.values())
    return {"pass": correct, "errors": errors, "tolerance": tol, "memory": memory, "upipe_over_unchunked": ratio,
            "summary": f"max rel err {max(errors.values()):.2e} (tol {tol:g}); UPipe peak / unchunked {ratio}"}


S3_CONFIGS = [  # name, ContextParallelConfig kwargs, heads (q, kv), windowed, head chunk (UPipe)
    ("ring", dict(mode="ring"), (8, 4), False, None),
    ("ulysses", dict(mode="ulysses"), (8, 4), False, None),
    ("hybrid-2x2", dict(mode="hsap", ulysses_size=2), (8, 4), False, None),
    ("hybrid-2x2-kv-forwarding", dict(mode="hsap", ulysses_size=2, kv_forwarding=True), (8, 4), False, None),
    ("upipe", dict(mode="ulysses"), (8, 4), False, 4),
    ("window", dict(mode="hsap", ulysses_size=2), (8, 4), True, None),
    ("uneven-heads", dict(mode="ulysses"), (6, 3), False, None),
]


def _dense_reference(q, k, v, doc_lengths, window) -> torch.Tensor:
    """fp64 attention of the global packed batch, causal per document, with an optional (left, 0) window."""
    t, g = q.shape[0], q.shape[1] // k.shape[1]
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths), device=q.device),
                                  torch.tensor(doc_lengths, device=q.device))
    pos = torch.arange(t, device=q.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        mask &= pos[:, None] - pos[None, :] <= window[0]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk.transpose(0, 1),
                                                           vv.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


S3_CONFIG_CAP_S = 60  # per configuration on the GPU (the dry run: DRY_RUN_CAP_S)


def _s3_worker(rank: int, world: int, port: int, device_type: str, tokens: int, head_dim: int, results,
               config_cap_s: float) -> None:
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.instrumentation import count_comm

    os.environ.update(nccl_env(rank))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)  # LOCAL_RANK % device_count on a one-GPU machine
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    rows = []
    lengths = sample_doc_lengths(tokens, seed=7, max_doc_len=tokens // 2)
    for name, cp_kwargs, (h, h_kv), windowed, chunk in S3_CONFIGS:
        # A configuration that hangs (a collective that never matches) is recorded and ends this rank; the
        # stage then reports the configurations done instead of running into its own cap.
        watchdog = threading.Timer(config_cap_s, _s3_overran, args=(rank, rows, name, config_cap_s, results))
        watchdog.daemon = True
        watchdog.start()
        # 1/64 of the batch (64 keys at 4K tokens), shorter than its documents, so the ring sends fewer rows
        window = (max(4, tokens // 64), 0) if windowed else None
        start = time.perf_counter()
        hybrid = cp_kwargs["mode"] == "hsap"  # two "nodes" of two ranks; the others on one "node"
        topology = initialize_model_parallel(context_parallel_size=world, ranks_per_node=2 if hybrid else world,
                                             cp_config=ContextParallelConfig(kernel="auto", **cp_kwargs))
        plan = plan_batch(cu_seqlens_from_lengths(lengths), topology, "zigzag")
        gen = torch.Generator(device=device).manual_seed(11)
        q, k, v = (torch.randn(plan.total_tokens, heads, head_dim, device=device, dtype=torch.float64,
                               generator=gen) for heads in (h, h_kv, h_kv))
        local = [plan.shard(x).to(dtype).requires_grad_() for x in (q, k, v)]
        with count_comm() as measured:
            if chunk is None:
                out = context_parallel_attention(*local, plan, window_size=window)
            else:  # UPipe's attention core: the projection is the identity on [q | k | v] of each KV group
                out = _upipe_identity_projection(head_chunked_attention, local, plan, h, h_kv, head_dim, chunk)
        out.backward(torch.ones_like(out))
        ref_in = [x.detach().requires_grad_() for x in (q, k, v)]
        ref = _dense_reference(*ref_in, plan.doc_lengths, window)
        ref.backward(torch.ones_like(ref))
        errors = [_max_rel_err(plan.unshard(out.detach()), ref)]
        if chunk is None:
            errors += [_max_rel_err(plan.unshard(x.grad), r.grad) for x, r in zip(local, ref_in)]
        stats = plan.stats(h, h_kv, head_dim, dtype, causal=True, window_size=window)
        mine = (measured.send_bytes_intra, measured.send_bytes_inter, measured.recv_bytes_intra,
                measured.recv_bytes_inter)
        predicted = tuple(stats[f][topology.cp_rank] for f in ("send_bytes_intra", "send_bytes_inter",
                                                                "recv_bytes_intra", "recv_bytes_inter"))
        if cp_kwargs.get("kv_forwarding"):  # a forwarded row is counted once per node: compare the CP-group total
            inter = torch.tensor([measured.recv_bytes_inter], dtype=torch.int64, device=device)
            dist.all_reduce(inter, group=topology.cp_group)
            bytes_ok = int(inter) == sum(stats.recv_bytes_inter_forwarded)
        else:
            bytes_ok = mine == predicted
        rows.append({"config": name, "max_rel_err": max(errors), "bytes": mine, "predicted_bytes": predicted,
                     "bytes_match_plan": bytes_ok, "seconds": time.perf_counter() - start})
        watchdog.cancel()
        results[rank] = rows
        destroy_model_parallel()
    dist.destroy_process_group()


def _s3_overran(rank: int, rows: List[dict], name: str, cap_s: float, results) -> None:
    results[rank] = rows + [{"config": name, "max_rel_err": math.nan, "bytes_match_plan": False,
                             "killed": f"still running after its {cap_s:g} s cap"}]
    os._exit(3)


def _upipe_identity_projection(head_chunked_attention, local, plan, h, h_kv, d, chunk) -> torch.Tensor:
    """head_chunked_attention with a weight that copies ``hidden = [q | k | v]`` (grouped per KV head as Megatron's
    linear_qkv) into its Q/K/V heads: the attention result equals context_parallel_attention's on q, k, v."""
    q, k, v = local
    g = h // h_kv
    hidden = torch.cat([torch.cat([q[:, j * g:(j + 1) * g], k[:, j:j + 1], v[:, j:j + 1]], dim=1)
                        for j in range(h_kv)], dim=1).reshape(q.shape[0], 1, -1)
    eye = torch.eye(hidden.shape[-1], dtype=q.dtype, device=q.device)
    return head_chunked_attention(hidden, eye, None, plan, num_heads_q=h, num_heads_kv=h_kv, head_dim=d,
                                  rope_base=None, head_chunk_size=chunk).reshape(q.shape[0], h, d)


def stage_s3(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    import torch.multiprocessing as mp

    world = 4
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    # CUDA needs fresh interpreters; on the CPU dry run forked ones start without re-importing everything
    config_cap_s = S3_CONFIG_CAP_S if device.type == "cuda" else DRY_RUN_CAP_S
    try:
        mp.start_processes(_s3_worker, args=(world, port, device.type, sizes.s3_tokens, sizes.head_dim, results,
                                             config_cap_s),
                           nprocs=world, start_method="spawn" if device.type == "cuda" else "fork")
    except mp.ProcessExitedException:  # a rank stopped by its configuration's cap (recorded in its rows)
        pass
    rows = [dict(r, rank=rank) for rank in sorted(results.keys()) for r in results[rank]]
    tol = 3e-2 if device.type == "cuda" else 1e-9
    for r in rows:
        r["pass"] = r["max_rel_err"] <= tol and r["bytes_match_plan"]
    worst = max((r["max_rel_err"] for r in rows), default=math.nan)
    complete = len(rows) == world * len(S3_CONFIGS)
    return {"pass": complete and all(r["pass"] for r in rows), "rows": rows, "tolerance": tol,
            "nccl_env": nccl_env(0), "summary": f"{len(S3_CONFIGS)} configs x {world} ranks, max rel err {worst:.2e}"}


def stage_s4(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    def train(cp: int) -> dict:
        return section_training(sizes, device, out_dir, timeout_s=stage_cap_s("S4", device) / 2 - 5, cp=cp)

    if device.type == "cuda":  # one after the other on the one GPU
        runs = [train(cp) for cp in (1, 2)]
    else:  # the CPU dry run: both at once (the CP 1 run's one rank leaves the other cores idle)
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(train, (1, 2)))
    return {"pass": all(r["trains"] for r in runs), "runs": runs,
            "summary": "; ".join(f"CP {r['cp']}: rc={r['returncode']} loss {r['losses'][:1]} -> {r['losses'][-1:]}"
                                 for r in runs)}


def stage_s5(sizes: Sizes, device: torch.device, out_dir: str) -> dict:
    kernels = ["torch_flash"] if device.type == "cuda" and _kernel_ok("torch_flash") else ["torch"]
    result = section_throughput(sizes, device, kernels, budget_s=stage_cap_s("S5", device) - 10)
    worst = min((r["stage_over_all_fwd_bwd"] for r in result["ratios"]), default=math.nan)
    result["pass"] = bool(result["ratios"])
    result["summary"] = f"kernels {kernels}, lowest UPipe-stage / all-heads TFLOP/s ratio {worst:.3f}"
    return result


STAGE_FUNCTIONS = {"S0": stage_s0, "S1": stage_s1, "S2": stage_s2, "S3": stage_s3, "S4": stage_s4, "S5": stage_s5}


def _versions() -> dict:
    out = {}
    for module in ("flash_attn", "transformer_engine", "megatron.core"):
        try:
            out[module] = importlib.import_module(module).__version__
        except Exception as err:  # report, never fail, on a missing or broken install
            out[module] = f"unavailable ({type(err).__name__})"
    return out


def run_stage(stage: str, out_dir: str, dry_run: bool) -> int:
    """One stage in this process: its JSON goes to ``OUT/<stage>.json`` (a traceback on failure)."""
    device = torch.device("cpu" if dry_run else "cuda")
    sizes = CPU_SIZES if dry_run else Sizes()
    start = time.perf_counter()
    try:
        result = STAGE_FUNCTIONS[stage](sizes, device, out_dir)
    except Exception:  # recorded; the orchestrator runs the next stage
        result = {"pass": False, "error": traceback.format_exc()}
    result["seconds"] = time.perf_counter() - start
    with open(os.path.join(out_dir, f"{stage}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return 0 if result["pass"] else 1


#: What the dry run's stage processes would each import afresh (S0's versions, S2/S3's parallel state): imported
#: once by the orchestrator before it forks them.
DRY_RUN_PRELOAD = ("megatron.core.parallel_state",)


def _forked_stage(argv: List[str], cap: float) -> str:
    """The dry run's stage process: ``main(argv)`` (``--stage S``) in a child forked from this process, which has
    torch, Megatron-Core and the package imported, instead of a new interpreter importing them again. Returns the
    tail of its output; raises ``subprocess.TimeoutExpired`` (the child and its process group killed) after ``cap``
    seconds."""
    import multiprocessing

    with tempfile.TemporaryFile("w+") as log:
        proc = multiprocessing.get_context("fork").Process(target=_stage_child, args=(argv, log.fileno()))
        proc.start()
        proc.join(cap)
        if proc.exitcode is None:  # the stage and every process it started (S3's ranks, S4's torchrun)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.join()
            raise subprocess.TimeoutExpired(argv, cap)
        log.seek(0)
        return log.read()[-2000:]


def _stage_child(argv: List[str], log_fd: int) -> None:
    """In the forked stage process: its own process group, stdout and stderr to ``log_fd``, then the stage as its
    subprocess runs it."""
    os.setpgid(0, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    sys.exit(main(argv))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "gpu_check_out"),
                        help="directory for the JSON results (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage on CPU (gloo, the reference kernel, tiny shapes)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of " + ",".join(STAGES))
    parser.add_argument("--total-s", type=float, default=None,
                        help="time for all stages together (default: 9 minutes on the GPU; the dry run: the stages' caps)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one stage, in a subprocess
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    if args.stage:
        return run_stage(args.stage, args.out_dir, args.dry_run)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here; use --dry-run to run every stage on CPU")
    stages = [s.strip() for s in args.stages.split(",")]
    if not set(stages) <= set(STAGES):
        parser.error(f"--stages={args.stages!r}: allowed values are {', '.join(STAGES)}")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dry_run": args.dry_run, "stages": {}}
    total_s = args.total_s or (DRY_RUN_CAP_S * len(stages) if args.dry_run else sum(STAGE_CAPS_S.values()))
    deadline = time.perf_counter() + total_s
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.dry_run:  # CPU only: the stages are forked from here (CUDA needs each stage in a new interpreter)
        with warnings.catch_warnings():  # a stage subprocess's import notices went to its captured output
            warnings.simplefilter("ignore")
            for module in DRY_RUN_PRELOAD:
                importlib.import_module(module)
    for stage in stages:
        cap = min(DRY_RUN_CAP_S if args.dry_run else STAGE_CAPS_S[stage], deadline - time.perf_counter())
        path = os.path.join(args.out_dir, f"{stage}.json")
        if os.path.exists(path):
            os.remove(path)
        start = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), args.out_dir, "--stage", stage] + \
            (["--dry-run"] if args.dry_run else [])
        try:
            if args.dry_run:
                tail = _forked_stage(cmd[2:], max(cap, 1))
            else:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(cap, 1))
                tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            tail = f"killed after its {cap:.0f} s cap"
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
        else:
            result = {"pass": False, "error": tail}
        result["wall_s"] = time.perf_counter() - start
        report["stages"][stage] = result
        with open(os.path.join(args.out_dir, "gpu_check.json"), "w") as f:  # rewritten after every stage
            json.dump(report, f, indent=1, default=str)
        verdict = "PASS" if result.get("pass") else "FAIL"
        detail = result.get("summary") or (result.get("error") or "").strip().splitlines()[-1:]
        print(f"[gpu_check] {stage} {STAGE_NAMES[stage]}: {verdict} in {result['wall_s']:.1f} s: {detail}",
              flush=True)
    return 0 if all(r.get("pass") for r in report["stages"].values()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--with-rank-hostid":
        _run_with_rank_hostid(sys.argv[2:])
    else:
        sys.exit(main())
