"""The configurator (``megatron_hsap.configurator``, ``tools/configure.py``, ``--context-parallel-mode auto``):
every configuration it lists is valid and its flags parse, its byte predictions equal the bytes measured in
multi-rank runs, and what it recommends trains on CPU ranks at tiny scale.

``.venv/bin/python -m pytest tests/test_configurator.py -q`` (~1 min).
"""

from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from typing import Dict, List, Tuple

import pytest
import torch

from megatron_hsap.config import ContextParallelConfig
from megatron_hsap.configurator import (HARDWARE, Candidate, attention_step_bytes, distinct, enumerate_candidates,
                                        predict, rank_predictions, training_flags)
from megatron_hsap.instrumentation.memory_model import PRESETS, ModelShape
from megatron_hsap.training.arguments import parse_args
from tests.cli_runs import run_warm
from tests.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ModelShape("tiny", 2, 64, 8, 4, 8, 256, 512, swiglu=False)
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "4",
              "--ffn-hidden-size", "256"]


def _model_flags(model: ModelShape) -> List[str]:
    return ["--num-layers", str(model.layers), "--hidden-size", str(model.hidden), "--num-attention-heads",
            str(model.heads), "--num-query-groups", str(model.kv_heads), "--ffn-hidden-size", str(model.ffn)] + (
        ["--swiglu"] if model.swiglu else [])


@pytest.mark.parametrize("name", ["llama3-8b", "llama3-70b", "qwen2.5-7b"])
@pytest.mark.parametrize("nodes", [1, 4, 16])
def test_every_configuration_is_valid_and_its_flags_parse(name: str, nodes: int) -> None:
    model, world = PRESETS[name], nodes * 8
    candidates = enumerate_candidates(model, nodes, 8)
    assert len(candidates) >= 50
    for c in candidates:
        assert c.tp * c.cp * c.dp == world and c.cp % c.ulysses == 0
        assert c.tp * c.ulysses <= 8, c  # the all-to-all never leaves a node
        assert model.kv_heads % c.tp == 0
        if c.mode == "hsap":
            assert ContextParallelConfig(mode="hsap", head_chunk_size=c.head_chunk).resolve_head_chunk_size(
                model.heads // c.tp, c.ulysses) == c.head_chunk
        assert (c.mode == "none") == (c.cp == 1)
        assert c.mode != "ring" or c.tp == 8  # a Ulysses group fits a node otherwise
    seen = {(c.mode, c.cp) for c in candidates}
    assert {"hsap", "hybrid" if nodes > 1 else "ulysses"} <= {mode for mode, _ in seen}
    # Every configuration's flags are accepted as they are by the training script at this world size.
    seq = 1 << 20
    for flags in {tuple(training_flags(c, 8 // c.tp, model, seq)) for c in candidates}:
        parse_args(list(flags) + _model_flags(model)
                   + ["--seq-length", str(seq), "--max-position-embeddings", str(seq), "--mock-data",
                      "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"], world_size=world)


def _sent_by_kind(sent: Dict[Tuple[str, str], int]) -> Dict[Tuple[str, str], int]:
    out: Dict[Tuple[str, str], int] = defaultdict(int)
    for (op, where), nbytes in sent.items():
        out[("ring" if op.startswith("ring") else "a2a", where)] += nbytes
    return {k: v for k, v in out.items() if v}


def _measured_and_predicted(mode: str, lengths: List[int], heads: int, kv_heads: int, chunk: int,
                            recompute: str) -> Tuple[Dict, Dict]:
    """One layer's attention in a training step on 4 ranks (2 emulated nodes): forward (again, without gradients,
    under recompute) and backward, bytes measured by ``count_comm`` against ``attention_step_bytes``."""
    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.instrumentation import count_comm
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    d, hidden_size = 8, 32
    topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2, cp_config=ContextParallelConfig(
        mode=mode, kernel="torch", head_chunk_size=chunk if mode == "hsap" else None))
    plan = plan_batch(cu_seqlens_from_lengths(lengths), topo, "sequence-aware" if mode == "hsap" else "zigzag")
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    if mode == "hsap":
        x = plan.shard(torch.randn(total, hidden_size, generator=gen, dtype=torch.float64)).unsqueeze(1)
        weight = torch.randn((heads + 2 * kv_heads) * d, hidden_size, generator=gen, dtype=torch.float64)

        def layer(grad: bool) -> torch.Tensor:
            return head_chunked_attention(x.requires_grad_(grad), weight.requires_grad_(grad), None, plan,
                                          num_heads_q=heads, num_heads_kv=kv_heads, head_dim=d,
                                          head_chunk_size=chunk)
    else:
        q, k, v = (plan.shard(torch.randn(total, n, d, generator=gen, dtype=torch.float64))
                   for n in (heads, kv_heads, kv_heads))

        def layer(grad: bool) -> torch.Tensor:
            return context_parallel_attention(q.requires_grad_(grad), k.requires_grad_(grad),
                                              v.requires_grad_(grad), plan)
    layer(False)  # the agreement check's exchange happens once per plan, outside what a step repeats
    with count_comm() as comm:
        if recompute != "none":
            with torch.no_grad():
                layer(False)
        layer(True).sum().backward()
    candidate = Candidate(1, 4, 1, mode, topo.ulysses_size, chunk, recompute, True)
    predicted = attention_step_bytes(plan, candidate, heads, kv_heads, d, torch.float64)[topo.cp_rank]
    return _sent_by_kind(comm.sent), {k: v for k, v in predicted.items() if v}


@pytest.mark.parametrize("mode, heads, kv_heads, chunk, recompute", [
    ("hybrid", 4, 2, 4, "none"), ("hybrid", 4, 2, 4, "full"), ("hsap", 4, 2, 2, "none"), ("hsap", 8, 2, 2, "full")])
def test_predicted_bytes_equal_the_measured_bytes(mode: str, heads: int, kv_heads: int, chunk: int,
                                                  recompute: str) -> None:
    lengths = [300, 17, 1, 0, 190, 45, 3, 120]  # documents inside a rank, across ranks and across both nodes
    results = run_distributed(_measured_and_predicted, 4, mode, lengths, heads, kv_heads, chunk, recompute)
    for rank, (measured, predicted) in enumerate(results):
        assert measured == predicted, f"rank {rank}: measured {measured}, predicted {predicted}"
        assert measured.get(("ring", "inter"), 0) > 0 and measured.get(("a2a", "intra"), 0) > 0


def test_step_time_follows_the_overlap_rules() -> None:
    """Compute grows with the work per GPU; the ring is hidden under attention where it is faster."""
    model = PRESETS["llama3-8b"]
    batches = [[1 << 20]]  # one document: attention dominates
    fast_links = dataclasses.replace(HARDWARE["h100"], inter_gbps=1e6)
    by_cp = {c.cp: c for c in enumerate_candidates(model, 4, 8, ("full",), (True,))
             if c.mode == "hybrid" and c.tp == 1}
    slow = predict(by_cp[32], model, 1 << 20, batches, HARDWARE["h100"], 80, 8)
    fast = predict(by_cp[32], model, 1 << 20, batches, fast_links, 80, 8)
    half = predict(by_cp[16], model, 1 << 20, batches, HARDWARE["h100"], 80, 8)
    assert half.compute_s == pytest.approx(2 * slow.compute_s, rel=0.05)
    assert fast.exposed_comm_s <= slow.exposed_comm_s and fast.compute_s == slow.compute_s
    assert slow.bytes_inter > 0 and slow.fits


def _tiny_predictions():
    batches = [[200, 50, 300, 150, 12, 300]]
    return distinct(rank_predictions(predict(c, TINY, 1024, batches, HARDWARE["h100"], 80, 2)
                                     for c in enumerate_candidates(TINY, 2, 2, ("none", "full"), (True,))))


def _train(flags: List[str]):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    base = ["--nproc", "4", "--seq-length", "1024", "--train-iters", "2", "--lr-warmup-iters", "1",
            "--eval-iters", "0", "--no-progress-bar"]
    return run_warm(os.path.join(ROOT, "pretrain_gpt_hsap.py"), base + TINY_FLAGS + flags, env, ROOT, 300)


def test_the_recommended_configurations_train_on_cpu_ranks() -> None:
    """The two best distinct configurations of a tiny model on 2 emulated nodes of 2 ranks, flags as printed."""
    best = [p for p in _tiny_predictions() if p.fits][:2]
    assert len(best) == 2
    for p in best:
        flags = [f for f in training_flags(p.candidate, 2 // p.candidate.tp, TINY, 1024) if f != "--bf16"]
        result = _train(flags)
        assert result.returncode == 0, (p.candidate, result.stderr[-3000:])
        assert "iteration        2/       2" in result.stdout


def test_auto_mode_starts_a_run_with_the_chosen_configuration() -> None:
    result = _train(["--context-parallel-size", "4", "--ranks-per-node", "2", "--context-parallel-mode", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if "--context-parallel-mode auto:" in x)
    assert "TP 1 CP 4 DP 1" in line and "predicted" in line and "fits" in line
    assert "iteration        2/       2" in result.stdout


def test_auto_mode_refuses_sizes_it_chooses(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(TINY_FLAGS + ["--context-parallel-size", "4", "--context-parallel-mode", "auto",
                                 "--ulysses-size", "2"], world_size=4)
    assert "--context-parallel-mode auto chooses --ulysses-size and --head-chunk-size itself" in \
        capsys.readouterr().err
