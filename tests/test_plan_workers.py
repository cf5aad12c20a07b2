"""Plans made in data-loader worker processes (``plan_in_workers``, ``--num-workers``) and the bounded plan cache.

Workers read and plan; the training process only looks the plans up (no ``build_plan_data`` call there);
plans are identical on every rank and by either path (workers or the planning thread), byte for byte, on
ranks forked by the real launcher; worker errors keep their message; workers exit with their iterator;
``--num-workers 0`` and 2 train identically.

``.venv/bin/python -m pytest tests/test_plan_workers.py -q`` (~1 min on 2 cores: two CLI runs and one launcher run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.sequence import plan as plan_module
from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
from megatron_hsap.sequence.plan import PLAN_CACHE, build_plan_data, plan_batch
from megatron_hsap.sequence.plan_cache import PlanCache
from megatron_hsap.sequence.prefetch import plan_ahead
from megatron_hsap.training.packing import document_cu_seqlens
from megatron_hsap.training.plan_workers import plan_in_workers

LAYOUTS = ("sequence-aware", "zigzag")
TOPOLOGY = (8, 4, 4)  # CP 8 = ring 2 x Ulysses 4, nodes of 4 ranks


def _token_batches(count: int, seed: int, eod: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Training-like micro-batches ``tokens [2, 2048]`` with random EOD positions (documents split there)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        tokens = torch.randint(1, 100, (2, 2048), generator=generator)
        tokens.view(-1)[torch.randint(0, 4096, (6,), generator=generator)] = eod
        batches.append({"tokens": tokens})
    return batches


def _cu_of(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return document_cu_seqlens(batch["tokens"], 0, True)


def _plan_bytes(plan) -> bytes:
    """The plan's placement table and every member's piece table, as raw bytes (what ranks must agree on)."""
    data = plan._data
    return b"|".join([data.table.tobytes()] + [t.tobytes() for t in data.tables])


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


# ---------------------------------------------------------------- the cache

def test_plan_cache_is_bounded_and_evicts_the_least_recently_used():
    cache = PlanCache(maxsize=4)
    for key in range(4):
        cache.put(key, f"plan {key}")
    assert cache.get(0) == "plan 0"  # 0 is now the most recently used: 1 goes first
    cache.put(4, "plan 4")
    assert len(cache) == 4 and 1 not in cache and all(k in cache for k in (0, 2, 3, 4))
    cache.put(2, "plan 2 again")  # replacing refreshes too
    cache.put(5, "plan 5")
    assert 3 not in cache and cache.get(2) == "plan 2 again"
    assert (cache.get(3), cache.hits, cache.misses) == (None, 2, 1)
    with pytest.raises(ValueError, match="maxsize"):
        PlanCache(maxsize=0)
    with pytest.raises(ValueError, match="None"):
        cache.put(6, None)


def test_plan_batch_keeps_plans_within_its_byte_budget_and_uses_inserted_plan_data(monkeypatch):
    topology = CPTopology.offline(2, 1, 2)
    PLAN_CACHE.clear()
    assert (PLAN_CACHE.maxsize, PLAN_CACHE.max_bytes) == (None, plan_module.PLAN_CACHE_BYTES)
    for n in range(1, 71):  # 70 distinct length signatures, small plans: all kept (the bound is in bytes)
        plan_batch(cu_seqlens_from_lengths([n, 2]), topology, "zigzag")
    assert len(PLAN_CACHE) == 70 and PLAN_CACHE.misses == 70
    # Plan data built elsewhere (a worker) is what plan_batch then returns, without planning.
    cu = cu_seqlens_from_lengths([5, 9, 2])
    key = plan_module.plan_key(cu, topology.signature(), "contiguous")
    data = build_plan_data(*key)
    PLAN_CACHE.put(key, data)
    monkeypatch.setattr(plan_module, "build_plan_data", None)  # any planning here would fail
    assert plan_batch(cu.to(torch.int64), topology, "contiguous")._data is data


def test_the_schedules_a_cached_plan_compiles_count_against_the_budget():
    """A plan's member schedules are built on use, after the plan was stored: their bytes join its entry, and
    over the budget the least recently used plans go (before: the cache counted only what was stored)."""
    from megatron_hsap.sequence.plan_cache import approximate_bytes

    topology = CPTopology.offline(4, 2, 2)
    PLAN_CACHE.clear()
    first = plan_batch(cu_seqlens_from_lengths([300, 50, 150]), topology, "sequence-aware")
    key = first._data.cache_key
    stored = PLAN_CACHE.bytes
    schedule = first.member_schedule(True, member=0)
    grown = PLAN_CACHE.bytes - stored
    assert grown >= approximate_bytes(schedule) > 0  # the schedule, and the piece tables built for it
    first.member_schedule(True, member=0)  # already compiled: nothing more
    assert PLAN_CACHE.bytes == stored + grown
    second = plan_batch(cu_seqlens_from_lengths([120, 380]), topology, "sequence-aware")
    before = PLAN_CACHE.bytes
    old_max = PLAN_CACHE.max_bytes
    try:
        PLAN_CACHE.set_max_bytes(before)  # room for both as they are, not for the second's schedules
        second.member_schedule(True, member=1)
        assert key not in PLAN_CACHE and second._data.cache_key in PLAN_CACHE  # the least recently used went
        assert PLAN_CACHE.bytes <= before
    finally:
        PLAN_CACHE.set_max_bytes(old_max)
        PLAN_CACHE.clear()


# ---------------------------------------------------------------- workers in this process

def test_workers_plan_and_the_training_process_only_looks_up(monkeypatch):
    """The loop's form: micro-batches of tokens, documents split at EOD; every plan_batch after a worker
    delivered its batch is a hit, build_plan_data never runs here, and the workers are gone at the end."""
    topology = CPTopology.offline(*TOPOLOGY)
    batches = _token_batches(6, seed=11)
    planned_here: List[tuple] = []
    real_build = plan_module.build_plan_data
    monkeypatch.setattr(plan_module, "build_plan_data", lambda *key: planned_here.append(key) or real_build(*key))

    def read(index: int) -> dict:
        return dict(batches[index], worker=os.getpid())

    PLAN_CACHE.clear()
    seen = []
    for batch in plan_in_workers(read, range(len(batches)), _cu_of, topology, "sequence-aware", num_workers=2):
        plan = plan_batch(_cu_of(batch), topology, "sequence-aware")
        fresh = real_build(plan.doc_lengths, topology.signature(), "sequence-aware", None)
        assert _plan_bytes(plan) == b"|".join([fresh.table.tobytes()] + [t.tobytes() for t in fresh.tables])
        seen.append(batch)
        if len(seen) == len(batches):  # the last one: the workers are gone before anyone asks for more
            workers = {b["worker"] for b in seen}
            assert len(workers) == 2 and os.getpid() not in workers
            assert all(map(_gone, workers)), "a worker outlived the last item"
    assert planned_here == [] and (PLAN_CACHE.hits, PLAN_CACHE.misses) == (6, 0)
    assert [torch.equal(a["tokens"], b["tokens"]) for a, b in zip(seen, batches)] == [True] * 6


def test_items_arrive_as_read():
    """Dict items' tensors travel by value (bf16 the shared-memory way) and arrive as equal tensors; other
    items arrive unchanged."""
    topology = CPTopology.offline(2, 1, 2)
    item = {"tokens": torch.arange(8).view(1, 8), "mask": torch.ones(1, 8), "half": torch.ones(2, dtype=torch.bfloat16),
            "array": np.arange(3), "name": "batch"}
    got = next(plan_in_workers(lambda i: item, range(1), _cu_of_tokens_only, topology, "zigzag", num_workers=1))
    assert list(got) == list(item) and got["name"] == "batch" and torch.equal(got["array"], torch.arange(3))
    assert all(torch.equal(got[k], item[k]) and got[k].dtype == item[k].dtype for k in ("tokens", "mask", "half"))
    pair = (torch.arange(4).view(1, 4), "pair")
    got = next(plan_in_workers(lambda i: pair, range(1), lambda p: _cu_of_tokens_only({"tokens": p[0]}), topology,
                               "zigzag", num_workers=1))
    assert isinstance(got, tuple) and torch.equal(got[0], pair[0]) and got[1] == "pair"


def test_worker_errors_keep_their_message_and_closing_stops_the_workers():
    from megatron_hsap.training.data import micro_batch_at

    topology = CPTopology.offline(2, 1, 2)
    sample = {"tokens": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([2, 3, 4, 5]), "loss_mask": torch.ones(4)}
    bad = dict(sample, labels=torch.tensor([2, 3, 4, 600]))
    args = SimpleNamespace(global_batch_size=1, micro_batch_size=1, data_parallel_size=1, num_microbatches=1)
    read = lambda index: micro_batch_at([sample, sample, bad, sample], args, 0, index, vocab_size=512)  # noqa: E731
    batches = plan_in_workers(read, range(4), _cu_of_tokens_only, topology, "zigzag", num_workers=2)
    assert len([next(batches), next(batches)]) == 2
    with pytest.raises(ValueError, match=re.escape("iteration 3: samples 2..2 hold labels id 600, outside the "
                                                   "vocabulary [0, 512); the data does not match the tokenizer")):
        next(batches)
    with pytest.raises(StopIteration):
        next(batches)

    def unpicklable(index: int):
        raise _Unpicklable("lock inside")

    with pytest.raises(RuntimeError, match="_Unpicklable: lock inside"):
        next(plan_in_workers(unpicklable, range(2), _cu_of, topology, "zigzag", num_workers=1))
    # Bad cu_seqlens (what plan_batch rejects) surface the same way.
    decreasing = plan_in_workers(lambda i: {"tokens": None}, range(1), lambda b: torch.tensor([0, 4, 2]), topology,
                                 "zigzag", num_workers=1)
    with pytest.raises(ValueError, match="non-decreasing"):
        next(decreasing)
    # Closed before the end: the workers stop at once.
    endless = plan_in_workers(lambda i: {"tokens": torch.ones(1, 8, dtype=torch.long), "worker": os.getpid()},
                              range(10 ** 6), _cu_of, topology, "zigzag", num_workers=2)
    worker = next(endless)["worker"]
    endless.close()
    assert _gone(worker)


def _cu_of_tokens_only(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    return document_cu_seqlens(batch["tokens"], 0, False)


class _Unpicklable(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = __import__("threading").Lock()


def test_bad_arguments_raise_at_the_call():
    topology = CPTopology.offline(2, 1, 2)
    for kwargs, name in [({"num_workers": 0}, "num_workers"), ({"num_workers": True}, "num_workers"),
                         ({"num_workers": 1, "prefetch_factor": 0}, "prefetch_factor")]:
        with pytest.raises(ValueError, match=name):
            plan_in_workers(list.__getitem__, range(1), _cu_of, topology, "zigzag", **kwargs)
    with pytest.raises(ValueError, match="topology"):
        plan_in_workers(list.__getitem__, range(1), _cu_of, "8x4", "zigzag", num_workers=1)
    with pytest.raises(ValueError, match="cu_seqlens_of"):
        plan_in_workers(list.__getitem__, range(1), "tokens", topology, "zigzag", num_workers=1)


@pytest.mark.parametrize("value, message", [("-1", "-1 is negative"), ("two", "'two' is not an integer"),
                                            ("1.5", "'1.5' is not an integer")])
def test_num_workers_flag_errors_name_the_flag_and_the_allowed_values(capsys, value, message):
    from megatron_hsap.training.arguments import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--nproc", "2", "--num-workers", value], world_size=2)
    assert exit_.value.code == 2
    assert f"argument --num-workers: {message}; allowed: 0, 1, 2, ..." in capsys.readouterr().err
    args = parse_args(["--nproc", "2"], world_size=2)
    assert args.num_workers == 2 and not args.compat_notes  # Megatron-LM's default, and not an ignored flag


# ---------------------------------------------------------------- ranks forked by the launcher

def _rank_plans(args: SimpleNamespace) -> int:
    """One launcher rank (gloo group up, so workers fork from a process with communication threads): plan
    the same stream via workers and via the thread; every rank's and path's bytes must be rank 0's."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    topology = CPTopology.offline(*TOPOLOGY)
    batches = _token_batches(args.batches, seed=5)
    mine = {}
    for layout in LAYOUTS:
        PLAN_CACHE.clear()
        mine["workers", layout] = [_plan_bytes(plan_batch(_cu_of(b), topology, layout)) for b in plan_in_workers(
            batches.__getitem__, range(len(batches)), _cu_of, topology, layout, num_workers=2)]
        assert PLAN_CACHE.misses == 0, "the training process planned"
        PLAN_CACHE.clear()
        mine["thread", layout] = [_plan_bytes(plan_batch(_cu_of(b), topology, layout))
                                  for b in plan_ahead(iter(batches), _cu_of, topology, layout)]
    everyone: List[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    reference = {layout: everyone[0]["workers", layout] for layout in LAYOUTS}
    for rank, theirs in enumerate(everyone):
        for (path, layout), plans in theirs.items():
            assert plans == reference[layout], f"rank {rank} planned differently via {path} ({layout})"
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"compared": sum(len(p) for p in mine.values()) * len(everyone),
                       "distinct": len({p for plans in mine.values() for p in plans})}, f)
    dist.destroy_process_group()
    return 0


def test_every_rank_and_both_paths_make_the_same_plans(tmp_path):
    from tests.test_fault_tolerance import _processes_with_marker

    marker = f"HSAP_TEST_RUN_{uuid.uuid4().hex}"
    out = tmp_path / "compared.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{marker: "1"})
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    result = subprocess.run([sys.executable, __file__, str(out)], cwd=os.path.dirname(os.path.dirname(__file__)),
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads(out.read_text())
    assert summary == {"compared": 3 * 2 * 2 * 4, "distinct": 2 * 4}  # 3 ranks x 2 paths x 2 layouts x 4 batches
    assert _processes_with_marker(marker) == [], "a rank or worker survived the run"


# ---------------------------------------------------------------- the training loop

def test_training_with_and_without_workers_is_identical(tmp_path, cache_dir):
    """Same losses, grad norms and evaluation losses bit for bit, ``--num-workers 0`` (thread) and 2."""
    from tests.test_fault_tolerance import TINY
    from tests.test_training_pretrain import _run

    logs = {}
    for workers in ("0", "2"):
        log = tmp_path / f"w{workers}.jsonl"
        result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "3", "--eval-iters", "1",
                              "--eval-interval", "2", "--data-cache-path", cache_dir, "--log-json", str(log),
                              "--num-workers", workers], 2, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        keys = ("iteration", "loss", "grad_norm", "lr", "evaluation", "lm_loss")
        logs[workers] = [{k: r[k] for k in keys if k in r} for r in map(json.loads, log.read_text().splitlines())]
    assert logs["0"] == logs["2"] and len(logs["0"]) == 3 + 3  # 3 iterations; validation x2, test


if __name__ == "__main__":  # the launcher run of test_every_rank_and_both_paths_make_the_same_plans
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_hsap.training.launch import spawn_local_ranks

    sys.exit(spawn_local_ranks(3, _rank_plans, SimpleNamespace(out=sys.argv[1], batches=4), grace_seconds=5.0))
