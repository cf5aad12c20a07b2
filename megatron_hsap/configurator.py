"""Which parallel configuration to run a long-context job with, predicted before any GPU-hour is spent.

For a model, a cluster (nodes x GPUs per node, memory per GPU) and a sequence length, ``enumerate_candidates``
lists the valid configurations (TP, CP, DP, context-parallel mode, Ulysses x ring, head-chunk size U,
recompute or layer-checkpoint offload, distributed optimizer) and ``predict`` gives each:

- peak memory per GPU: ``instrumentation.memory_model`` (its components are validated against measured peaks);
- bytes per layer and GPU inside and across nodes: from real plans (``plan_batch``) of the length mix, forward
  and backward, exactly what the attention code sends (``attention_step_bytes``; tests compare it with the bytes
  measured in multi-rank runs);
- a step time: compute from FLOPs at a stated fraction of the GPU's peak, communication from bytes and link
  bandwidths, with the overlap the code really has: a ring exchange runs under the previous distance's kernel
  (exposed only where it takes longer than the layer's attention), the Ulysses all-to-alls, tensor-parallel
  collectives and the gradient reduction are not overlapped.

``rank_predictions`` orders them (fitting configurations first, fastest first); ``training_flags`` turns one into
``pretrain_gpt_hsap.py`` flags. ``tools/configure.py`` prints the table; ``--context-parallel-mode auto`` uses
``choose_mode`` at start-up. docs/configure.md states the assumptions and checks the memory side against the
UPipe paper's reported maximum contexts.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.instrumentation.memory_model import (GiB, ModelShape, Parallelism, Training, estimate,
                                                        max_context, parameter_count)
from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
from megatron_hsap.sequence.plan import BatchPlan, plan_batch

__all__ = ["Hardware", "HARDWARE", "Candidate", "Prediction", "enumerate_candidates", "predict",
           "rank_predictions", "distinct", "training_flags", "sequence_chunks", "attention_step_bytes", "choose_mode", "longest_sequence",
           "MODES_MEMORY_METHOD"]

#: --context-parallel-mode -> the memory model's method (hsap runs head chunks: UPipe's stages).
MODES_MEMORY_METHOD = {"none": "ulysses", "ring": "ring", "ulysses": "ulysses", "hybrid": "hybrid", "hsap": "upipe"}
#: Forward FLOPs x this = forward + backward (backward of a matmul: 2 x its forward; attention: 2.5 x).
_LINEAR_FWD_BWD, _ATTENTION_FWD_BWD = 3.0, 3.5


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. ``tflops``: bf16 dense peak; ``efficiency``: the fraction of it matmuls and attention
    kernels reach; ``intra_gbps`` / ``inter_gbps``: GB/s one GPU sends inside its node / to another node;
    ``host_gbps``: GB/s between the GPU and host memory (layer-checkpoint offload)."""

    name: str
    tflops: float
    intra_gbps: float
    inter_gbps: float
    efficiency: float = 0.5
    host_gbps: float = 50.0


#: Public figures: bf16 dense peak (NVIDIA's datasheets: H100 SXM 989 TFLOP/s, H200 the same chip), NVLink 4
#: 900 GB/s per GPU both ways (450 one way), one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s), PCIe 5.0 x16
#: (64 GB/s one way; 50 reached) to host memory.
HARDWARE: Dict[str, Hardware] = {
    "h100": Hardware("H100 SXM", 989.0, 450.0, 50.0),
    "h200": Hardware("H200 SXM", 989.0, 450.0, 50.0),
}


@dataclass(frozen=True)
class Candidate:
    """One configuration of a job of ``tp x cp x dp`` GPUs (pipeline parallelism 1)."""

    tp: int
    cp: int
    dp: int
    mode: str
    ulysses: int
    head_chunk: int
    recompute: str
    distributed_optimizer: bool

    @property
    def ring(self) -> int:
        return self.cp // self.ulysses

    def describe(self) -> str:
        split = {"none": "no CP", "ring": f"ring {self.cp}", "ulysses": f"Ulysses {self.cp}"}.get(
            self.mode, f"Ulysses {self.ulysses} x ring {self.ring}")
        return f"TP {self.tp} CP {self.cp} DP {self.dp} {self.mode} ({split}), U {self.head_chunk}"


@dataclass
class Prediction:
    candidate: Candidate
    peak_bytes: int
    fits: bool
    bytes_intra: float  # per layer and GPU, one training step (forward, backward, recomputed forward)
    bytes_inter: float
    compute_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    flops_per_gpu: float


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(model: ModelShape, nodes: int, gpus_per_node: int,
                         recompute: Sequence[str] = ("full", "offload", "none"),
                         distributed_optimizer: Sequence[bool] = (True, False)) -> List[Candidate]:
    """Every valid configuration: TP inside a node dividing the KV heads; CP x DP over the rest; per mode the
    Ulysses size inside a node (the largest that fits it, as ``ContextParallelConfig`` defaults) and, for hsap,
    head chunks of the Ulysses size up to all heads. A pure ring is listed only where no Ulysses group fits a node
    (TP = GPUs per node): elsewhere hybrid moves fewer bytes across nodes and holds less memory (its attention
    block is smaller: the memory model's ``ring`` vs ``hybrid``)."""
    world = nodes * gpus_per_node
    out: List[Candidate] = []
    for tp in _divisors(gpus_per_node):
        if model.kv_heads % tp or model.heads % tp:
            continue
        heads = model.heads // tp
        per_node = gpus_per_node // tp  # CP ranks of one node (CP ranks are TP ranks apart)
        for dp in _divisors(world // tp):
            cp = world // (tp * dp)
            for mode in ("none", "ring", "ulysses", "hybrid", "hsap"):
                if (mode == "none") != (cp == 1):
                    continue  # CP 1 is data and tensor parallelism only
                if mode == "ring" and per_node > 1:
                    continue  # a Ulysses group fits a node: hybrid sends fewer bytes across nodes, holds less
                if mode in ("none", "ring"):
                    sizes = [(1, heads)]
                elif mode == "ulysses":
                    if cp > per_node:
                        continue  # Ulysses over several nodes would send the all-to-all across them
                    sizes = [(cp, heads)]
                else:
                    ulysses = math.gcd(cp, per_node)
                    if mode == "hybrid" and (ulysses == cp or ulysses == 1):
                        continue  # one of the pure modes
                    chunks = [heads] if mode == "hybrid" else sorted(
                        {c for c in (ulysses, 2 * ulysses, 4 * ulysses, heads) if _valid_chunk(c, heads, ulysses)})
                    sizes = [(ulysses, c) for c in chunks]
                for ulysses, chunk in sizes:
                    for rc in recompute:
                        for zero in distributed_optimizer:
                            out.append(Candidate(tp, cp, dp, mode, ulysses, chunk, rc, zero))
    return out


def _valid_chunk(chunk: int, heads: int, ulysses: int) -> bool:
    try:
        ContextParallelConfig(mode="hsap", head_chunk_size=chunk).resolve_head_chunk_size(heads, ulysses)
    except ValueError:
        return False
    return chunk <= heads


def _topology(c: Candidate, gpus_per_node: int) -> CPTopology:
    layout_config = ContextParallelConfig(mode="ring" if c.mode == "none" else c.mode,
                                          head_chunk_size=c.head_chunk if c.mode == "hsap" else None)
    topo = CPTopology.offline(c.cp, c.ulysses, gpus_per_node // c.tp)
    return dataclasses.replace(topo, config=layout_config)


#: Keys of ``attention_step_bytes``: (collective, where).
_KINDS = (("a2a", "intra"), ("a2a", "inter"), ("ring", "intra"), ("ring", "inter"))


def attention_step_bytes(plan: BatchPlan, candidate: Candidate, heads_q: int, heads_kv: int, head_dim: int,
                         dtype: torch.dtype = torch.bfloat16) -> List[Dict[Tuple[str, str], int]]:
    """Bytes each CP rank sends for one layer's attention in a training step, by (``'a2a'`` | ``'ring'``,
    ``'intra'`` | ``'inter'``): forward and backward, plus the forward again under full recompute (or offload).
    ``heads_q`` / ``heads_kv``: this TP rank's heads."""
    forwards = 2 if candidate.recompute in ("full", "offload") else 1
    return [_combine(fwd, bwd, forwards) for fwd, bwd in _forward_backward_bytes(plan, candidate, heads_q, heads_kv,
                                                                                 head_dim, dtype)]


def _combine(fwd: Dict[Tuple[str, str], int], bwd: Dict[Tuple[str, str], int], forwards: int
             ) -> Dict[Tuple[str, str], int]:
    return {key: forwards * fwd.get(key, 0) + bwd.get(key, 0) for key in set(fwd) | set(bwd)}


def _forward_backward_bytes(plan: BatchPlan, candidate: Candidate, heads_q: int, heads_kv: int, head_dim: int,
                            dtype: torch.dtype) -> List[Tuple[Dict[Tuple[str, str], int], Dict[Tuple[str, str], int]]]:
    """Per CP rank, (forward, backward) bytes of one layer's attention by (collective, where).

    hsap (head chunks): ``upipe.predicted_stage_comm`` of every rank. The other modes: ``BatchPlan.stats``'
    forward (the all-to-all of q, k, v and the output; the ring's K/V) and what ``context_parallel_attention``'s
    backward sends: the all-to-alls once more (dout in, dq/dk/dv back), the ring's K/V again and the dK/dV of the
    rows this rank received."""
    topo = plan.topology
    out = []
    if candidate.mode == "hsap":
        from megatron_hsap.attention.head_schedule import build_head_schedule
        from megatron_hsap.attention.upipe import predicted_stage_comm

        schedule = build_head_schedule(heads_q, heads_kv, topo.ulysses_size, candidate.head_chunk)
        for rank in range(topo.cp_size):
            mine = BatchPlan(plan._data, dataclasses.replace(topo, cp_rank=rank))
            fwd_sent: Dict[Tuple[str, str], int] = defaultdict(int)
            bwd_sent: Dict[Tuple[str, str], int] = defaultdict(int)
            for fwd, bwd in predicted_stage_comm(schedule, mine, head_dim, dtype):
                for sent, table in ((fwd_sent, fwd), (bwd_sent, bwd)):
                    for (op, where), nbytes in table.items():
                        sent[("ring" if op.startswith("ring") else "a2a", where)] += nbytes
            out.append((dict(fwd_sent), dict(bwd_sent)))
        return out
    if topo.ulysses_spans_nodes():
        raise ValueError("attention_step_bytes: a Ulysses group across nodes is not modelled (the configurator keeps "
                         "every all-to-all inside a node)")
    stats = plan.stats(heads_q, heads_kv, head_dim, dtype)
    for c in range(topo.cp_size):
        sent, received = stats.ring_send_bytes[c], stats.ring_recv_bytes[c]
        a2a = stats.send_bytes_intra[c] + stats.send_bytes_inter[c] - sent
        fwd = {("a2a", "intra"): a2a, ("ring", "inter"): stats.send_bytes_inter[c],
               ("ring", "intra"): sent - stats.send_bytes_inter[c]}
        # Backward: K/V re-sent as in the forward; dK/dV of the rows received go back to where they came from.
        bwd = {("a2a", "intra"): a2a, ("ring", "inter"): stats.send_bytes_inter[c] + stats.recv_bytes_inter[c],
               ("ring", "intra"): sent - stats.send_bytes_inter[c] + received - stats.recv_bytes_inter[c]}
        out.append((fwd, bwd))
    return out


@dataclass(frozen=True)
class _LayerProfile:
    """What one layer of a (TP, CP, mode, sizes) configuration does on its busiest rank, averaged over batches:
    forward attention FLOPs and, per rank, forward / backward bytes by (collective, where)."""

    attention_fwd_flops: float
    ranks: Tuple[Tuple[Dict[Tuple[str, str], float], Dict[Tuple[str, str], float]], ...]


_PROFILES: Dict[tuple, _LayerProfile] = {}


def _layer_profile(c: Candidate, model: ModelShape, batches: Sequence[Sequence[int]], gpus_per_node: int
                   ) -> _LayerProfile:
    key = (c.tp, c.cp, c.mode, c.ulysses, c.head_chunk, model, tuple(map(tuple, batches)), gpus_per_node)
    if key not in _PROFILES:
        topo = _topology(c, gpus_per_node)
        layout = "sequence-aware" if c.mode == "hsap" else "zigzag"
        heads_q, heads_kv = model.heads // c.tp, max(1, model.kv_heads // c.tp)
        flops, ranks = 0.0, [({}, {}) for _ in range(c.cp)]
        for lengths in batches:
            plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, layout)
            flops += max(plan.stats(heads_q, heads_kv, model.head_dim).attn_flops) / len(batches)
            for (fwd, bwd), (f_sum, b_sum) in zip(_forward_backward_bytes(plan, c, heads_q, heads_kv,
                                                                         model.head_dim, torch.bfloat16), ranks):
                for table, total in ((fwd, f_sum), (bwd, b_sum)):
                    for k, v in table.items():
                        total[k] = total.get(k, 0.0) + v / len(batches)
        _PROFILES[key] = _LayerProfile(flops, tuple(ranks))
    return _PROFILES[key]


def sequence_chunks(model: ModelShape, c: Candidate, seq_length: int) -> Tuple[int, int]:
    """(MLP, loss) sequence chunks of every configuration: the training script's hsap defaults, passed as flags to
    the other modes too (an unchunked loss at long context holds tokens x vocabulary fp32 logits)."""
    t = -(-seq_length // c.cp)
    return max(1, -(-t // model.hidden)), max(1, -(-t // 2048))


def _training(model: ModelShape, c: Candidate, seq_length: int, grad_bytes: int = 4) -> Training:
    mlp_chunks, loss_chunks = sequence_chunks(model, c, seq_length)
    return Training(dtype_bytes=2, distributed_optimizer=c.distributed_optimizer, recompute=c.recompute,
                    grad_bytes=grad_bytes, mlp_chunks=mlp_chunks, loss_chunks=loss_chunks)


def _parallelism(c: Candidate) -> Parallelism:
    return Parallelism(tp=c.tp, cp=c.cp, dp=c.dp, ulysses=c.ulysses, head_chunk=c.head_chunk)


def predict(candidate: Candidate, model: ModelShape, seq_length: int, batches: Sequence[Sequence[int]],
            hardware: Hardware, device_gib: float, gpus_per_node: int) -> Prediction:
    """One configuration's memory, bytes and step time for a micro-batch of ``seq_length`` tokens per DP rank
    (``batches``: document lengths of sample batches of the mix, each summing to ``seq_length``)."""
    c = candidate
    peak = estimate(model, seq_length, _parallelism(c), _training(model, c, seq_length),
                    MODES_MEMORY_METHOD[c.mode]).peak
    t = -(-seq_length // c.cp)
    forwards = 2 if c.recompute in ("full", "offload") else 1
    rate = hardware.tflops * 1e12 * hardware.efficiency
    bandwidth = {"intra": hardware.intra_gbps * 1e9, "inter": hardware.inter_gbps * 1e9}
    profile = _layer_profile(c, model, batches, gpus_per_node)
    per_rank = [_combine(fwd, bwd, forwards) for fwd, bwd in profile.ranks]
    attention = profile.attention_fwd_flops * (_ATTENTION_FWD_BWD + forwards - 1)
    linear_weights = (model.hidden * (model.heads + 2 * model.kv_heads) * model.head_dim
                      + model.heads * model.head_dim * model.hidden
                      + model.hidden * model.ffn * (3 if model.swiglu else 2)) / c.tp
    linear = 2 * linear_weights * t * (_LINEAR_FWD_BWD + forwards - 1)
    # The slowest rank sets the pace: its all-to-all time, and its ring time of which the kernel hides part.
    a2a_s = max(sum(b.get(("a2a", w), 0) / bw for w, bw in bandwidth.items()) for b in per_rank)
    ring_s = max(sum(b.get(("ring", w), 0) / bw for w, bw in bandwidth.items()) for b in per_rank)
    tp_s = 0.0
    if c.tp > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters per forward, as many in the backward
        tp_s = (2 + 2 * forwards) * 2 * t * model.hidden * 2 * (c.tp - 1) / c.tp / bandwidth["intra"]
    layer_exposed = a2a_s + max(0.0, ring_s - attention / rate) + tp_s
    head_flops = 2 * model.vocab * model.hidden * t / c.tp * _LINEAR_FWD_BWD
    compute = (model.layers * (attention + linear) + head_flops) / rate
    group = c.cp * c.dp  # gradients are reduced over the data-parallel x CP ranks
    reduce_bw = bandwidth["inter" if group * c.tp > gpus_per_node else "intra"]
    grad_s = 2 * parameter_count(model, c.tp) * 4 * (group - 1) / group / reduce_bw
    # Offload copies each layer's input to the host in the forward and back in the backward, synchronously.
    offload_s = 2 * t * model.hidden * 2 / (hardware.host_gbps * 1e9) if c.recompute == "offload" else 0.0
    exposed = model.layers * (layer_exposed + offload_s) + grad_s
    step = compute + exposed
    intra = max(b.get(("a2a", "intra"), 0) + b.get(("ring", "intra"), 0) for b in per_rank)
    inter = max(b.get(("a2a", "inter"), 0) + b.get(("ring", "inter"), 0) for b in per_rank)
    return Prediction(c, peak, peak <= device_gib * GiB, intra, inter, compute, exposed, step,
                      seq_length * c.dp / step, model.layers * (attention + linear) + head_flops)


def distinct(ranked: Sequence[Prediction]) -> List[Prediction]:
    """The first of every group that differs only in the head-chunk size (ranked: the fastest, then the least
    memory): a table row per real choice."""
    seen, out = set(), []
    for p in ranked:
        key = dataclasses.replace(p.candidate, head_chunk=0)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def rank_predictions(predictions: Iterable[Prediction]) -> List[Prediction]:
    """Fitting configurations first, by tokens per second (fastest first; ties: less memory), then the rest by
    peak memory."""
    return sorted(predictions, key=lambda p: (not p.fits, -round(p.tokens_per_s, 6) if p.fits else 0,
                                              p.peak_bytes))


def training_flags(c: Candidate, ranks_per_node: int, model: ModelShape, seq_length: int) -> List[str]:
    """``pretrain_gpt_hsap.py`` flags of a configuration (parallelism, CP mode and sizes, memory) for samples of
    ``seq_length`` tokens."""
    flags = ["--tensor-model-parallel-size", str(c.tp), "--context-parallel-size", str(c.cp)]
    if c.mode != "none":
        flags += ["--context-parallel-mode", c.mode, "--ranks-per-node", str(ranks_per_node)]
    if c.tp > 1:
        flags.append("--sequence-parallel")
    if c.mode in ("hybrid", "hsap"):
        flags += ["--ulysses-size", str(c.ulysses)]
    if c.mode == "hsap":
        flags += ["--head-chunk-size", str(c.head_chunk)]
    else:
        mlp_chunks, loss_chunks = sequence_chunks(model, c, seq_length)
        flags += ["--mlp-sequence-chunks", str(mlp_chunks), "--loss-sequence-chunks", str(loss_chunks)]
    if c.recompute in ("full", "offload"):
        flags += ["--recompute-granularity", "full"]
    if c.recompute == "offload":
        flags.append("--offload-checkpointed-activations")
    if c.distributed_optimizer:
        flags.append("--use-distributed-optimizer")
    return flags + ["--bf16"]


def longest_sequence(c: Candidate, model: ModelShape, device_gib: float) -> int:
    """The longest sequence (a multiple of 64Ki tokens) this configuration's predicted peak fits."""
    train = _training(model, c, 1 << 20)
    guess = max_context(model, int(device_gib * GiB), _parallelism(c), train, MODES_MEMORY_METHOD[c.mode])
    return max_context(model, int(device_gib * GiB), _parallelism(c), _training(model, c, guess.tokens),
                       MODES_MEMORY_METHOD[c.mode]).tokens


def choose_mode(model: ModelShape, tp: int, cp: int, dp: int, gpus_per_node: int, seq_length: int,
                batches: Sequence[Sequence[int]], hardware: Hardware, device_gib: float, recompute: str,
                distributed_optimizer: bool) -> Tuple[Prediction, List[Prediction]]:
    """``--context-parallel-mode auto``: the fastest fitting mode and sizes for a job whose TP, CP and DP are
    given (the least memory when none fits), and every prediction it compared."""
    options = [c for c in enumerate_candidates(model, (tp * cp * dp) // gpus_per_node or 1, gpus_per_node,
                                               (recompute,), (distributed_optimizer,))
               if (c.tp, c.cp, c.dp) == (tp, cp, dp)]
    if not options:
        raise ValueError(f"--context-parallel-mode auto found no valid mode for TP {tp} x CP {cp} on "
                         f"{gpus_per_node} ranks per node")
    predictions = rank_predictions(predict(c, model, seq_length, batches, hardware, device_gib, gpus_per_node)
                                   for c in options)
    return predictions[0], predictions
