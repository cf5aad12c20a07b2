"""The embedded corpus (documents cut from the stdlib, deterministic, many per demo micro-batch) and the plan
summary (the run's plans vs zigzag's on the same samples), checked against a token-level recount from the
plans' segments."""

from __future__ import annotations

import hashlib
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence.plan import plan_batch
from megatron_hsap.training.corpus import (WHOLE_FILE_EVERY, ensure_stdlib_corpus, source_documents,
                                           stdlib_documents, stdlib_source_files)
from megatron_hsap.training.plan_summary import PlanSummary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SOURCE = b'''"""Module doc."""
import os

X = 1


@decorator
def first(a):
    return a


class Thing(Base):
    """Class doc."""
    size = 3

    def method(self):
        return 1

    @property
    def prop(self):
        return 2
    tail = 4

# comment before the last statements
Y = first(X)
'''


def test_source_documents_cut_functions_methods_class_rest_and_statement_runs():
    docs = source_documents(SOURCE)
    assert docs == [
        b'"""Module doc."""\nimport os\n\nX = 1\n\n\n',
        b"@decorator\ndef first(a):\n    return a\n",  # the blank lines after it: no document
        b"    def method(self):\n        return 1\n",
        b"    @property\n    def prop(self):\n        return 2\n",
        b'class Thing(Base):\n    """Class doc."""\n    size = 3\n\n\n    tail = 4\n',
        b"\n# comment before the last statements\nY = first(X)\n",
    ]
    assert source_documents(b"def broken(:\n") == [b"def broken(:\n"]


def _digest(documents) -> str:
    sha = hashlib.sha256()
    for doc in documents:
        sha.update(len(doc).to_bytes(8, "little") + doc)
    return sha.hexdigest()


def test_corpus_documents_are_the_same_in_a_fresh_process_and_mix_short_and_long():
    paths = stdlib_source_files()
    docs = list(stdlib_documents(paths))
    code = ("from megatron_hsap.training.corpus import stdlib_documents, stdlib_source_files\n"
            "from tests.test_plan_summary import _digest\n"
            "print(_digest(stdlib_documents(stdlib_source_files())))")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=ROOT)
    fresh = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert fresh.stdout.strip() == _digest(docs)
    lengths = [len(d) for d in docs]
    whole_files = -(-len(paths) // WHOLE_FILE_EVERY)
    assert len(docs) > 10 * len(paths)  # cut into many more documents than files
    assert statistics.median(lengths) < 512 and sum(n > 8192 for n in lengths) >= whole_files // 2


@pytest.fixture(scope="module")
def demo_micro_batches(tmp_path_factory):
    """cu_seqlens of the demo's 150 training micro-batches (its flags, its corpus, Megatron's GPTDataset)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.data import dataset_config, micro_batch_at, split_sizes
    from megatron_hsap.training.packing import document_cu_seqlens
    from megatron_hsap.training.tokenizer import build_tokenizer

    cache = str(tmp_path_factory.mktemp("corpus"))
    args = parse_args(["--demo", "--data-cache-path", cache], world_size=8)
    tokenizer = build_tokenizer(args.tokenizer_type)
    prefix = ensure_stdlib_corpus(cache, tokenizer.eod, tokenizer.vocab_size)
    assert os.path.basename(prefix).startswith("stdlib_v2_")
    args.data_parallel_size = 1
    config = dataset_config(args, tokenizer, [prefix])
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, split_sizes(args), lambda: True, config).build()
    cus = [document_cu_seqlens(micro_batch_at(train, args, 0, i, tokenizer.vocab_size)["tokens"], tokenizer.eod,
                               True) for i in range(args.train_iters * args.num_microbatches)]
    return args, cus


def test_demo_micro_batches_hold_many_documents_and_sequence_aware_halves_inter_node_bytes(demo_micro_batches):
    args, cus = demo_micro_batches
    assert args.micro_batch_size * args.seq_length == 2048 and len(cus) == 150
    docs = [len(cu) - 1 for cu in cus]
    assert statistics.median(docs) >= 4
    topology = CPTopology.offline(8, 4, 4)  # the demo's hsap shape: Ulysses 4 inside a node x ring 2 across 2 nodes
    summary = PlanSummary("sequence-aware", 8, 8, 8, torch.float32)
    for cu in cus:
        summary.add(plan_batch(cu, topology, "sequence-aware"), cu)
    assert summary.run.planned.bytes_inter <= 0.5 * summary.run.zigzag.bytes_inter


def _recount(plan, num_heads_q, num_heads_kv, head_dim, elem):
    """Token by token from ``plan.rank_segments`` (independent of ``BatchPlan.stats``): causal attention inside
    documents, heads split evenly over Ulysses, each ring member needs every key row of its documents that
    lies on another member at or before one of its own queries; Ulysses moves q, k, v in and the output back
    for every slot of a rank."""
    topo = plan.topology
    u, cp = topo.ulysses_size, topo.cp_size
    members = cp // u
    held = [dict() for _ in range(members)]  # member -> doc -> set of positions
    for rank, segments in enumerate(plan.rank_segments):
        for doc, start, end in segments:
            held[rank // u].setdefault(doc, set()).update(range(start, end))
    area = [sum(p + 1 for positions in held[m].values() for p in positions) for m in range(members)]
    flops = [4 * area[c // u] * (num_heads_q // u) * head_dim for c in range(cp)]
    docs = {d for m in held for d, pos in m.items() if pos}
    split = sum(sum(bool(held[m].get(d)) for m in range(members)) > 1 for d in docs)
    node = lambda m: topo.node_of_cp_rank[m * u]  # noqa: E731 - one node per member in these shapes
    inter = intra = 0
    for a in range(members):
        for b in range(members):
            if a == b:
                continue
            rows = sum(1 for d, q_pos in held[a].items() if q_pos
                       for k in held[b].get(d, ()) if k <= max(q_pos))
            nbytes = rows * 2 * num_heads_kv * head_dim * elem
            if node(a) == node(b):
                intra += nbytes
            else:
                inter += nbytes
    t = plan.tokens_per_rank
    ulysses_bytes = members * u * (u - 1) * t * (2 * num_heads_q + 2 * num_heads_kv) // u * head_dim * elem
    intra += ulysses_bytes
    tokens = sum(len(p) for m in held for p in m.values())
    return dict(busiest=max(flops), mean=sum(flops) / cp, padding=t * cp - tokens, documents=len(docs),
                split=split, inter=inter, intra=intra)


def _mix(seed: int, total: int):
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left > 0:
        n = int(torch.randint(1, 900, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.8 else 1500
        lengths.append(min(n, left))
        left -= lengths[-1]
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("cp,ulysses,per_node", [(8, 4, 4), (8, 2, 4)])
def test_summary_line_and_json_agree_with_a_recount_from_the_segments(cp, ulysses, per_node):
    topology = CPTopology.offline(cp, ulysses, per_node)
    heads, kv_heads, head_dim = 8, 4, 16
    summary = PlanSummary("sequence-aware", heads, kv_heads, head_dim, torch.bfloat16)
    expected = {layout: dict(busiest=0, mean=0.0, padding=0, documents=0, split=0, inter=0, intra=0)
                for layout in ("sequence-aware", "zigzag")}
    for seed in range(4):
        cu = _mix(seed, 4096 - 8 * seed)  # not a multiple of 2 x CP for some seeds: padding
        plan = plan_batch(cu, topology, "sequence-aware")
        summary.add(plan, cu)
        for layout in expected:
            for key, value in _recount(plan_batch(cu, topology, layout), heads, kv_heads, head_dim, 2).items():
                expected[layout][key] += value
    run = summary.run
    for figures, want in ((run.planned, expected["sequence-aware"]), (run.zigzag, expected["zigzag"])):
        assert figures.micro_batches == 4
        assert (figures.busiest_attn_flops, figures.padding_tokens, figures.documents, figures.documents_split,
                figures.bytes_inter, figures.bytes_intra) == (want["busiest"], want["padding"], want["documents"],
                                                              want["split"], want["inter"], want["intra"])
        assert figures.mean_attn_flops == pytest.approx(want["mean"], rel=1e-12)
    seq, zig = expected["sequence-aware"], expected["zigzag"]
    assert zig["split"] > seq["split"] and zig["inter"] > seq["inter"] > 0
    line = run.line()
    assert f"documents split {seq['split']}/{seq['documents']} vs {zig['split']}/{zig['documents']}" in line
    assert f"inter-node bytes {seq['inter'] / zig['inter']:.2f} x zigzag" in line
    assert f"intra-node bytes {seq['intra'] / zig['intra']:.2f} x zigzag" in line
    assert (f"attention imbalance {seq['busiest'] / seq['mean']:.3f} vs {zig['busiest'] / zig['mean']:.3f}"
            in line)
    record = run.as_dict()
    assert record["bytes_inter_vs_zigzag"] == pytest.approx(seq["inter"] / zig["inter"], rel=1e-12)
    assert record["planned"]["padding_tokens"] == seq["padding"]
    assert re.search(r"padding \d+\.\d% vs \d+\.\d%", line)


def test_summary_interval_restarts_and_run_accumulates():
    topology = CPTopology.offline(4, 2, 2)
    summary = PlanSummary("sequence-aware", 4, 4, 8, torch.float32)
    assert summary.take_interval() is None
    for seed in range(3):
        cu = _mix(seed, 1024)
        summary.add(plan_batch(cu, topology, "sequence-aware"), cu)
        if seed == 1:
            first = summary.take_interval()
    second = summary.take_interval()
    assert (first.planned.micro_batches, second.planned.micro_batches, summary.run.planned.micro_batches) == (2, 1, 3)
    assert first.zigzag.bytes_inter + second.zigzag.bytes_inter == summary.run.zigzag.bytes_inter
