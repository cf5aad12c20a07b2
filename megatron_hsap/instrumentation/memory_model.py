"""Per-rank peak memory of long-context training, by component, and the longest context that fits.

Every term is a count of the tensors the code in this repository (and Megatron-Core) keeps, in bytes:

- weights: this rank's parameters (``dtype``); grads: Megatron's fp32 ``main_grad`` buffer;
  optimizer state: Adam's fp32 master copy (low-precision weights only), exp_avg and exp_avg_sq,
  divided over the data-parallel x CP ranks with the distributed optimizer (ZeRO-1);
- saved activations: what each layer keeps between its forward and its backward (full recompute:
  its input; none: Megatron's saved tensors, an estimate);
- the transients of one layer's backward (they do not overlap, so the largest counts): the attention
  block (projection, all-to-alls, ring, kernel; ``attention_block_bytes``), the MLP (per sequence tile)
  and the output layer + loss (per sequence chunk);
- communication buffers: the all-to-all send/receive and ring receive buffers of the attention block
  (reported separately, part of the attention block's peak).

``attention_block_bytes`` for method ``upipe`` follows ``head_chunked_attention``'s stage buffers (see
``upipe._Stages``) at its backward peak, inside the attention kernel. ``kernel='torch'`` adds the CPU torch
kernel's fp32 copies and score tiles (what the CPU validation measures); ``'flash'`` keeps only the ring's
fp32 accumulators (flash kernels hold no full-size workspace). tests/test_memory_model.py checks every
component against ``track_peak_memory`` on small configurations (within 5 %).

Ring: one distance's received K/V rows, the gradients going back and those coming back are alive at once.
With head chunks, when a KV head is attended by several stages, the rows received for it are kept from its first
stage to its last and their gradients summed in fp32 (``shared_kv.SharedRemoteKeyValues``: a KV head crosses the ring
once per layer), which adds the remote rows' fp32 sums and the rows of the other distances;
``Parallelism.remote_kv_rows`` is the rows a rank receives over the ring per layer (the plan's, e.g.
``sum(r.num_rows for r in plan.member_schedule().recv_steps)``; None: the worst case, every other member's tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

__all__ = ["ModelShape", "Parallelism", "Training", "PRESETS", "METHODS", "MemoryEstimate", "estimate",
           "max_context", "attention_block_bytes", "parameter_count"]

GiB = 2 ** 30
METHODS = ("ulysses", "ring", "hybrid", "upipe")


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: per-model sizes (heads are totals, before TP)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    swiglu: bool = True
    qkv_bias: bool = False
    tied_embeddings: bool = False


PRESETS: Dict[str, ModelShape] = {
    "llama3-8b": ModelShape("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    "llama3-70b": ModelShape("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True),
    "qwen2.5-14b": ModelShape("qwen2.5-14b", 48, 5120, 40, 8, 128, 13824, 152064, qkv_bias=True),
}


@dataclass(frozen=True)
class Parallelism:
    """tp/pp/cp/dp sizes; ``ulysses``: all-to-all degree inside CP (None: per method); ``head_chunk``: UPipe's U
    (None: the Ulysses size); ``remote_kv_rows``: K/V rows one rank receives over the ring per layer (None: the
    worst case, (ring size - 1) x the member's tokens)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ulysses: Optional[int] = None
    head_chunk: Optional[int] = None
    remote_kv_rows: Optional[int] = None


@dataclass(frozen=True)
class Training:
    """dtype_bytes: parameter/activation element size; optimizer 'adam' or 'sgd'; distributed_optimizer: ZeRO-1
    over dp x cp; recompute 'full', 'offload' (full, with the layer-input checkpoints in host memory as
    DeepSpeed ALST does: ``--offload-checkpointed-activations``, ``HostOffload``) or 'none'; grad_bytes: main_grad
    element size (4: Megatron's grad_reduce_in_fp32, 2: bf16 gradient buffers);
    mlp_chunks / loss_chunks: sequence tiles (1 = unchunked);
    kernel: 'flash' (GPU) or 'torch' (the CPU kernel, whose score tiles are at most ``kernel_tile`` =
    (query tokens, keys): its TILE_Q x TILE_K, or less when the plan's attention blocks are smaller)."""

    dtype_bytes: int = 2
    optimizer: str = "adam"
    distributed_optimizer: bool = True
    recompute: str = "full"
    grad_bytes: int = 4
    mlp_chunks: int = 1
    loss_chunks: int = 1
    kernel: str = "flash"
    kernel_tile: Tuple[int, int] = (256, 512)


@dataclass
class MemoryEstimate:
    """Per-rank bytes by component and the peak they add up to."""

    tokens: int
    tokens_per_rank: int
    components: Dict[str, int] = field(default_factory=dict)

    @property
    def peak(self) -> int:
        c = self.components
        static = c["weights"] + c["grads"] + c["optimizer state"] + c["saved activations"]
        return static + max(c["attention block"] + c["communication"], c["mlp transient"], c["loss transient"])

    @property
    def limiting(self) -> str:
        c = self.components
        phases = {"attention block": c["attention block"] + c["communication"], "mlp transient": c["mlp transient"],
                  "loss transient": c["loss transient"]}
        return max(phases, key=phases.get)


def _check(name: str, value: object, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")


def parameter_count(model: ModelShape, tp: int = 1, pp: int = 1) -> int:
    """Parameters on the pipeline stage holding the embedding (and, with pp = 1, the output layer) for one TP rank."""
    h, d = model.hidden, model.head_dim
    qkv = (model.heads + 2 * model.kv_heads) * d
    attention = h * qkv + (qkv if model.qkv_bias else 0) + model.heads * d * h
    mlp = h * model.ffn * (2 if model.swiglu else 1) + model.ffn * h
    per_layer = (attention + mlp) // tp + 2 * h  # two norms, replicated
    layers = -(-model.layers // pp)
    embedding = model.vocab * h // tp
    output = 0 if (model.tied_embeddings and pp == 1) else model.vocab * h // tp
    return layers * per_layer + embedding + (output + h if pp == 1 else 0)


def _method_sizes(model: ModelShape, par: Parallelism, method: str):
    """(ulysses size P, ring size R, head chunk U) of a method on ``par.cp`` ranks (per TP rank heads)."""
    heads = model.heads // par.tp
    if method == "ring":
        return 1, par.cp, heads
    p = par.ulysses or (par.cp if method in ("ulysses", "upipe") else math.gcd(par.cp, heads))
    u = heads if method != "upipe" else (par.head_chunk or p)
    return p, par.cp // p, u


def attention_block_bytes(model: ModelShape, par: Parallelism, train: Training, method: str,
                          tokens_per_rank: int) -> Dict[str, int]:
    """Peak of one attention block's forward + backward above its input (``{'compute', 'communication'}``).

    ``upipe``: ``head_chunked_attention`` at U (stage buffers of ``upipe._Stages``). ``ulysses``/``ring``/
    ``hybrid``: Megatron-style, the full-head QKV, its all-to-all and the attention of all heads at once
    (the same op at U = H, which keeps no more than the Megatron-style block).
    """
    _check("method", method, METHODS)
    e, f = train.dtype_bytes, 4
    t, d, hidden = tokens_per_rank, model.head_dim, model.hidden
    h, h_kv = model.heads // par.tp, max(1, model.kv_heads // par.tp)
    p, ring, u = _method_sizes(model, par, method)
    big_t = p * t
    k_eff = max(h_kv, p)
    m = u // p
    stages = h // u
    g_eff = h // k_eff
    # KV heads one rank uses per stage, first used / last used per stage, and kept at once.
    attn = max(1, -(-m // g_eff)) if m % g_eff == 0 or g_eff % m == 0 else m
    new = max(1, m // g_eff) if m >= g_eff else 1
    slots = max(attn, new)
    w = m + 2 * new
    wide = max(w, 2 * m)
    buffers = (2 * p * w * d * hidden * e            # rows + dw (the stage's weight rows and their gradient)
               + p * t * wide * d * e                # send (the projection GEMM writes here)
               + slots * 2 * big_t * d * (e + f)      # kv (dtype) + dkv (fp32)
               + big_t * 2 * m * d * e)              # pair (output + its gradient after the all-to-all)
    recv = p * t * wide * d * e
    attn_kv = 2 * big_t * attn * d * e if attn > 1 else 0
    kept = (t * h * d * e                            # the block output, saved for the backward
            + stages * m * big_t * f                 # per-stage lse
            + t * hidden * e                         # dx
            + 2 * t * d * e)                         # RoPE cos/sin
    ring_acc = 0  # out and dout arrive in contiguous buffers: no copy for a stage's one GQA run
    if ring > 1:  # several kernel calls per stage: the output and dq/dk/dv accumulate in fp32
        ring_acc += big_t * m * d * f + big_t * 2 * attn * d * f
    ring_recv = 0
    if ring > 1:
        remote = (ring - 1) * big_t if par.remote_kv_rows is None else par.remote_kv_rows
        row = 2 * attn * d  # k and v of the KV heads one attention call takes
        # At the backward kernel call of distance d: one distance's rows, and from d = 2 on the return of
        # distance d - 1 in flight (the gradients sent and the buffer they come back in); a ring of two
        # members has one distance, whose return is allocated after its kernel call.
        ring_recv = (1 if ring == 2 else 3) * min(remote, big_t) * row * e
        if method == "upipe" and stages > 1 and m < g_eff:  # KV heads shared by stages: rows kept, grads summed
            ring_recv += remote * row * f + (remote - min(remote, big_t)) * row * e
    kernel = 0
    if train.kernel == "torch":
        g = m // attn
        tq, tk = train.kernel_tile[0] * g, train.kernel_tile[1]
        kernel = (3 * big_t * m * d * f + 4 * big_t * attn * d * f + 2 * big_t * m * f + 3 * attn * tq * tk * f)
    return {"compute": buffers + attn_kv + kept + ring_acc + kernel, "communication": recv + ring_recv}


def _mlp_bytes(model: ModelShape, par: Parallelism, train: Training, t: int) -> int:
    """Tiled MLP forward + backward peak: the block output and input gradient, one tile's recomputed
    intermediates and their gradients."""
    e = train.dtype_bytes
    c = -(-t // train.mlp_chunks)
    ffn = model.ffn // par.tp
    fc1 = ffn * (2 if model.swiglu else 1)
    tile = c * (2 * fc1 + 3 * ffn) * e + c * model.hidden * e
    return 2 * t * model.hidden * e + tile


def _loss_bytes(model: ModelShape, par: Parallelism, train: Training, t: int) -> int:
    """Chunked output layer + cross-entropy at its backward peak: one chunk's fp32 probabilities and their
    gradient in dtype, its input gradient rows, the output weight's gradient, the input gradient and the
    per-token fp32 log-sum-exp."""
    e = train.dtype_bytes
    c = -(-t // train.loss_chunks)
    v = model.vocab // par.tp
    return c * v * (e + 4) + c * model.hidden * e + v * model.hidden * e + t * model.hidden * e + t * 4


def estimate(model: ModelShape, tokens: int, par: Parallelism, train: Training, method: str = "upipe"
             ) -> MemoryEstimate:
    """Predicted per-rank peak for one packed sequence of ``tokens`` tokens (one micro-batch)."""
    _check("method", method, METHODS)
    _check("recompute", train.recompute, ("full", "offload", "none"))
    _check("optimizer", train.optimizer, ("adam", "sgd"))
    _check("kernel", train.kernel, ("flash", "torch"))
    e = train.dtype_bytes
    t = -(-tokens // par.cp)
    params = parameter_count(model, par.tp, par.pp)
    shards = par.dp * par.cp if train.distributed_optimizer else 1
    opt_per_param = (8 + (4 if e < 4 else 0)) if train.optimizer == "adam" else (4 if e < 4 else 0)
    layers = -(-model.layers // par.pp)
    if train.recompute == "full":
        saved = layers * t * model.hidden * e
    elif train.recompute == "offload":  # HostOffload copies synchronously: one layer's input on the device
        saved = t * model.hidden * e
    else:  # Megatron's saved tensors per layer (estimate): norms, QKV, attention output, MLP intermediates
        h = model.heads // par.tp
        qkv = (h + 2 * max(1, model.kv_heads // par.tp)) * model.head_dim
        ffn = model.ffn // par.tp
        saved = layers * t * e * (4 * model.hidden + 2 * qkv + 2 * h * model.head_dim + 3 * ffn)
    attn = attention_block_bytes(model, par, train, method, t)
    est = MemoryEstimate(tokens, t)
    est.components = {"weights": params * e, "grads": params * train.grad_bytes,
                      "optimizer state": params * opt_per_param // shards,
                      "saved activations": saved, "attention block": attn["compute"],
                      "communication": attn["communication"], "mlp transient": _mlp_bytes(model, par, train, t),
                      "loss transient": _loss_bytes(model, par, train, t)}
    return est


def max_context(model: ModelShape, device_bytes: int, par: Parallelism, train: Training, method: str = "upipe",
                step: int = 2 ** 16, reserve_bytes: int = 0) -> MemoryEstimate:
    """The longest sequence (a multiple of ``step`` tokens) whose predicted peak fits ``device_bytes`` minus
    ``reserve_bytes`` (framework/allocator overhead), with its breakdown."""
    budget = device_bytes - reserve_bytes
    lo, hi = 0, step
    while estimate(model, hi, par, train, method).peak <= budget:
        lo, hi = hi, hi * 2
        if hi > 2 ** 40:
            break
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if estimate(model, mid, par, train, method).peak <= budget:
            lo = mid
        else:
            hi = mid
    return estimate(model, max(lo, step), par, train, method)
