#!/usr/bin/env python
"""Prepared GPU validation: kernel equivalence, per-stage throughput, per-rank memory, a short training run.

    python tools/gpu_check.py OUT_DIR                  # on one GPU (budgeted to end within 8 minutes)
    python tools/gpu_check.py OUT_DIR --device cpu     # smoke run of sections 1-3 with tiny sizes

Writes OUT_DIR/gpu_check.json (every figure) and OUT_DIR/gpu_check.md (tables),
rewritten after each section so a run cut short still leaves what it measured.
Each section is guarded: a failure is recorded with its traceback and the next
section runs. What each figure means is documented in docs/gpu.md.

1. equivalence: the 'flash' / 'te' kernels against the 'torch' kernel in fp32 on
   packed batches (document lengths from sample_doc_lengths), forward and
   backward in bf16; a case passes when its error against fp32 is at most 2x
   (out, lse) / 3x (dq, dk, dv) the error of plain dense attention computed in
   bf16, the criterion (and baseline) of flash-attn's own tests.
2. throughput: TFLOP/s from the mask area (forward 4*area*h_q*d, backward 2.5x)
   of one causal sequence of L tokens for the heads one rank holds in plain
   Ulysses (H/C query heads) and in one UPipe stage (U/C query heads), Llama3-8B
   head shape; the ratio stage/all is the cost of head chunking (REFERENCE.md 1.1).
3. memory: the package's own attention (context_parallel_attention for plain
   Ulysses, head_chunked_attention for UPipe stages) in a one-process job (CP = 1,
   all-to-alls are identity) on the per-rank length of a 5M-token context on 8
   ranks, halved until it fits: the same Q/K/V elements per rank as the 8-way job,
   without its all-to-all buffers. Peak memory of one Llama3-8B attention block
   (QKV projection, attention, output projection) forward+backward, and of a full
   layer (norms, attention block, sequence-tiled SwiGLU MLP) under full
   activation recomputation.
4. training: the real training step, launched as users launch it (torchrun, one rank,
   LOCAL_RANK -> torch.cuda.set_device, NCCL): pretrain_gpt_hsap.py at CP=1, bf16, mock
   data, with validation every few iterations, the final validation/test evaluations
   (forward-only schedule) and --log-throughput. It exercises the device path: packed
   micro-batches and cu_seqlens moved to the GPU, loss/byte-counter reductions on CUDA
   tensors over NCCL, Megatron's fusions on. Passes when it exits 0, the loss falls
   and every evaluation loss is finite.

One GPU cannot run CP > 1 (NCCL refuses two ranks of one communicator on one
device; gloo has no all-to-all for CUDA tensors): the collectives are checked by
the multi-process CPU tests, not here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
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


CPU_SIZES = Sizes(eq_tokens=256, eq_heads=(4, 2), head_dim=16, hidden=64, heads=8, kv_heads=4, cp=4, stage_heads=4,
                  lengths=(128, 256), mem_context=1024, mem_doc_len=128, ffn_hidden=128, mlp_chunk=128,
                  train_seq=64, train_iters=4)


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
    return {
        "packed-causal": (packed_causal_blocks(packed), None),
        "one-document": (packed_causal_blocks([t]), None),
        # ring step: the second half's rows see the first half's keys in a separate call, merged by LSE
        "ring-two-calls": (AttentionBlocks.from_list(first + second), AttentionBlocks.from_list(
            [(half, t, 0, half, False)])),
        # several blocks per query row in one call: exercises the pass split and merge inside the kernel
        "multi-pass": (AttentionBlocks.from_list(second + [(half, t, 0, half, False), (0, half, 0, half, True)]),
                       None),
    }


def dense_mask(blocks: AttentionBlocks, t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """bool ``[t_q, t_k]``: True where a block lets the query row see the key (bottom-right causal)."""
    mask = torch.zeros(t_q, t_k, dtype=torch.bool, device=device)
    for qs, qe, ks, ke, causal in blocks:
        block = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=device)
        mask[qs:qe, ks:ke] |= torch.tril(block, diagonal=(ke - ks) - (qe - qs)) if causal else block
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
    d, t = sizes.head_dim, sizes.eq_tokens
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda h: torch.randn(t, h, d, device=device, dtype=torch.bfloat16, generator=gen)  # noqa: E731
    q, k, v, dout = make(h_q), make(h_kv), make(h_kv), make(h_q)
    scale = d ** -0.5
    rows = []
    for case, (blocks, extra) in _equivalence_cases(sizes).items():
        calls = [blocks] + ([extra] if extra is not None else [])
        ref = _run_calls(torch_kernel, q.float(), k.float(), v.float(), dout.float(), calls, scale)
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

    A stage's U query heads take one head per KV group (REFERENCE.md 1.1), so it needs min(U, H_kv) KV heads.
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
                                     # REFERENCE.md 1.1: bf16 Q/K/V + their all-to-all outputs, MHA count
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

def section_training(sizes: Sizes, device: torch.device, out_dir: str, timeout_s: float) -> dict:
    log_json = os.path.join(out_dir, "train_log.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           os.path.join(REPO, "pretrain_gpt_hsap.py"), "--context-parallel-size", "1", "--num-layers", "2",
           "--hidden-size", str(max(64, sizes.hidden // 8)), "--num-attention-heads", str(sizes.heads),
           "--num-query-groups", str(sizes.kv_heads), "--seq-length", str(sizes.train_seq),
           "--train-iters", str(sizes.train_iters), "--lr-warmup-iters", "1", "--mock-data",
           "--log-interval", "1", "--log-json", log_json, "--no-progress-bar", "--log-throughput",
           "--eval-interval", str(max(1, sizes.train_iters // 2)), "--eval-iters", "2"]
    if device.type == "cuda":
        cmd += ["--bf16", "--attention-kernel", "auto", "--distributed-backend", "nccl"]
    else:
        cmd += ["--attention-kernel", "torch", "--distributed-backend", "gloo"]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
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
    return {"command": " ".join(cmd[1:]), "returncode": rc, "seconds": time.perf_counter() - start,
            "losses": losses, "evaluations": evaluations, "tflops_per_gpu": tflops, "output_tail": output[-3000:],
            "trains": (rc == 0 and len(losses) >= 2 and losses[-1] < losses[0] and len(evaluations) >= 3
                       and all(math.isfinite(e[2]) for e in evaluations))}


# ---------------------------------------------------------------- report

def _table(rows: List[dict], columns: List[str]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}"
        return "" if x is None else str(x)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out_dir: str, results: dict) -> None:
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    md = [f"# gpu_check {results['meta']['date']}", "", "```", json.dumps(results["meta"], indent=1), "```", ""]
    sections = results["sections"]
    if "equivalence" in sections and "rows" in sections["equivalence"]:
        md += ["## 1. Kernel equivalence (bf16 vs torch fp32)", "",
               _table(sections["equivalence"]["rows"], ["kernel", "case", "heads", "out_err", "out_bf16_baseline_err",
                                                         "lse_err", "dq_err", "dq_bf16_baseline_err", "dk_err",
                                                         "dk_bf16_baseline_err", "dv_err", "dv_bf16_baseline_err",
                                                         "fallback_calls", "pass"]), ""]
    if "throughput" in sections and "rows" in sections["throughput"]:
        md += ["## 2. Attention throughput per rank (causal, TFLOP/s from mask area)", "",
               _table(sections["throughput"]["rows"], ["kernel", "length", "config", "h_q", "h_kv", "fwd_tflops",
                                                       "bwd_tflops", "fwd_bwd_tflops", "fallback_calls",
                                                       "skipped"]), "",
               _table(sections["throughput"]["ratios"], ["kernel", "length", "stage_over_all_fwd_bwd"]), ""]
    if "memory" in sections and "rows" in sections["memory"]:
        md += ["## 3. Peak memory of one rank (attention block; layer with recomputation), fwd+bwd", "",
               _table(sections["memory"]["rows"], ["scope", "kind", "context", "tokens_per_rank", "stage_heads",
                                                   "peak_gib",
                                                   "formula_bytes_mha", "fwd_bwd_s", "oom", "skipped"]), "",
               f"UPipe peak cut: {sections['memory'].get('upipe_peak_cut')}", ""]
    if "training" in sections and "returncode" in sections["training"]:
        t = sections["training"]
        md += ["## 4. Training run", "", f"`{t['command']}`", "",
               f"returncode {t['returncode']}, {t['seconds']:.0f} s, losses {t['losses']}", "",
               f"evaluations (split, iteration, lm loss): {t['evaluations']}", "",
               f"TFLOP/s/GPU (Megatron-LM's formula): {t['tflops_per_gpu']}", ""]
    for name, s in sections.items():
        if "error" in s:
            md += [f"## {name}: FAILED", "", "```", s["error"], "```", ""]
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(md))


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for module in ("flash_attn", "transformer_engine"):
        try:
            out[module] = __import__(module).__version__
        except Exception as err:  # report, never fail, on a missing or broken install
            out[module] = f"unavailable ({type(err).__name__})"
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="directory for gpu_check.json / gpu_check.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: smoke run with tiny sizes and the torch kernel only")
    parser.add_argument("--sections", default="1,2,3,4", help="comma-separated subset of 1,2,3,4")
    parser.add_argument("--throughput-budget-s", type=float, default=120.0,
                        help="section 2 skips remaining lengths after this many seconds")
    parser.add_argument("--memory-budget-s", type=float, default=100.0,
                        help="section 3 skips its remaining measurements after this many seconds")
    parser.add_argument("--train-timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; use --device cpu for the smoke run")
    sections = {s.strip() for s in args.sections.split(",")}
    if not sections <= {"1", "2", "3", "4"}:
        parser.error(f"--sections={args.sections!r}: allowed values are 1, 2, 3, 4")
    os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device(args.device)
    sizes = Sizes() if device.type == "cuda" else CPU_SIZES
    if device.type == "cuda":
        kernels = [name for name in GPU_KERNELS if _kernel_ok(name)]
    else:
        kernels = ["torch"]  # the smoke run checks the script's paths, not a GPU library
    # without flash-attn/TE, sections 2-3 still measure the torch kernel on the GPU (labelled as such)
    bench_kernels = kernels or ["torch"]
    results = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        "equivalence_kernels": kernels, "benchmark_kernels": bench_kernels,
                        "sizes": asdict(sizes), **_versions()},
               "sections": {}}
    plan = [("1", "equivalence", lambda: section_equivalence(sizes, device, kernels)),
            ("2", "throughput", lambda: section_throughput(sizes, device, bench_kernels, args.throughput_budget_s)),
            ("3", "memory", lambda: section_memory(sizes, device, bench_kernels[0], args.memory_budget_s)),
            ("4", "training", lambda: section_training(sizes, device, args.out_dir, args.train_timeout_s))]
    for key, name, run in plan:
        if key not in sections:
            continue
        start = time.perf_counter()
        print(f"[gpu_check] section {key} ({name}) ...", flush=True)
        try:
            results["sections"][name] = run()
        except Exception:  # one failing section must not stop the others
            results["sections"][name] = {"error": traceback.format_exc()}
        results["sections"][name]["seconds"] = time.perf_counter() - start
        write_report(args.out_dir, results)
        print(f"[gpu_check] section {key} done in {results['sections'][name]['seconds']:.1f} s", flush=True)
    print(_summary(results), flush=True)
    return 0 if all("error" not in s for s in results["sections"].values()) else 1


def _kernel_ok(name: str) -> bool:
    try:
        get_kernel(name)
    except (ImportError, RuntimeError) as err:
        print(f"[gpu_check] kernel {name!r} unavailable: {err}", flush=True)
        return False
    return True


def _summary(results: dict) -> str:
    lines = ["[gpu_check] summary:"]
    s = results["sections"]
    for name, section in s.items():
        if "error" in section:
            lines.append(f"  {name}: FAILED ({section['error'].strip().splitlines()[-1]})")
        elif name == "equivalence":
            verdict = {True: "all pass", False: "SOME FAIL", None: section.get("skipped")}[section["all_pass"]]
            lines.append(f"  equivalence: {verdict} ({len(section['rows'])} kernel x case rows)")
        elif name == "throughput":
            worst = min((r["stage_over_all_fwd_bwd"] for r in section["ratios"]), default=math.nan)
            lines.append(f"  throughput: {len(section['rows'])} rows, lowest stage/all ratio {worst:.3f}")
        elif name == "memory":
            peaks = [(r.get("scope"), r.get("kind"), r.get("context"), r.get("peak_gib")) for r in section["rows"]]
            lines.append(f"  memory: {peaks}, UPipe cut {section['upipe_peak_cut']}")
        elif name == "training":
            lines.append(f"  training: rc={section['returncode']} losses={section['losses'][:2]}..."
                         f"{section['losses'][-1:]} evaluations={len(section['evaluations'])} "
                         f"trains={section['trains']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
