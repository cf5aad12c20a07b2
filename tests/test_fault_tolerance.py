"""Failures in ``pretrain_gpt_hsap.py`` runs: a dying rank, preemption, damaged checkpoints, NaN/Inf, bad data.

The end-to-end tests run the real command line on forked CPU ranks (tiny GPT:
2 layers, hidden 32, seq 64, one micro-batch per iteration) and make one rank
misbehave at a chosen iteration through the test-only ``HSAP_TEST_FAULT`` hook
(``megatron_hsap/training/fault_injection.py``): a real SIGKILL, a real
exception, real signals, a real NaN. Preemption, resume, an interrupted save and
the fallback to the previous checkpoint share one chain of runs
(``preemption_chain``). Checks of files and flags run in-process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from types import SimpleNamespace
from typing import Dict, List

import pytest

from megatron_hsap.training.save_lock import LOCK_FILE
from tests.test_training_pretrain import ROOT, SCRIPT, _run

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
        "--lr-warmup-iters", "1", "--no-progress-bar", "--eval-iters", "0"]
ITERS = 5
#: --rank-failure-grace-seconds used by the rank-death test, and the bound it asserts on top of it.
GRACE_SECONDS = 3.0
BOUND_SECONDS = GRACE_SECONDS + 2.0


def _records(path) -> List[Dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def _same_losses(records: List[Dict], reference: List[Dict]) -> None:
    """Bit-identical loss, grad norm and learning rate per iteration (same layout, same data, same state)."""
    ref = {r["iteration"]: r for r in reference}
    for r in records:
        expected = ref[r["iteration"]]
        assert (r["loss"], r["grad_norm"], r["lr"]) == (expected["loss"], expected["grad_norm"], expected["lr"])


def _processes_with_marker(marker: str) -> List[int]:
    """PIDs whose environment holds ``marker`` (forked ranks and their helpers inherit the launcher's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _stat_fields(pid: int) -> List[str]:
    """``/proc/PID/stat`` after the command name: [state, ppid, ...]; [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (a killed child its parent has not reaped yet is dead)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _watch_run_processes(marker: str, run: "concurrent.futures.Future") -> tuple:
    """Polls the run's processes (``marker`` in their environment) until ``run`` is done: (the time the first
    rank died, the time no process of the run is alive), ``time.monotonic`` seconds; (None, time) if no rank
    died first. The ranks are the launcher's forks (the launcher is this process's child): its children with
    its command line. Helpers that end on their own are not a rank's death: a rank's data worker is a
    grandchild, and a short subprocess the launcher runs at start-up (Megatron-Core 0.19 runs ``git
    rev-parse``) has its own command line."""
    parent: Dict[int, int] = {}
    command: Dict[int, bytes] = {}
    first_death = None
    while True:
        for pid in _processes_with_marker(marker):
            if pid not in parent:
                fields = _stat_fields(pid)
                parent[pid] = int(fields[1]) if fields else -1
            # re-read while alive: a subprocess caught between fork and exec still shows the launcher's; a zombie none
            command[pid] = _cmdline(pid) or command.get(pid, b"")
        launchers = {pid for pid, ppid in parent.items() if ppid == os.getpid()}
        ranks = {pid for pid, ppid in parent.items() if ppid in launchers and command[pid] == command[ppid]}
        now = time.monotonic()
        if first_death is None and any(not _alive(pid) for pid in ranks):
            first_death = now
        if parent and not any(_alive(pid) for pid in parent) or run.done():
            return first_death, now
        time.sleep(0.05)


# ---------------------------------------------------------------- a rank dies or raises

def test_killed_rank_stops_every_rank_within_the_bound(cache_dir):
    """SIGKILL of rank 2 of 4 (hybrid CP 4 over 2 emulated nodes) during iteration 3's forward."""
    marker = f"HSAP_TEST_RUN_{uuid.uuid4().hex}"
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        run = pool.submit(_run, TINY + ["--context-parallel-size", "4", "--context-parallel-mode", "hybrid",
                                        "--ranks-per-node", "2", "--train-iters", "6", "--data-cache-path", cache_dir,
                                        "--rank-failure-grace-seconds", str(GRACE_SECONDS)], 4, timeout=300,
                          env={"HSAP_TEST_FAULT": "kill@2:3", marker: "1"}, fresh=True)  # in /proc/*/environ
        first_death, all_gone = _watch_run_processes(marker, run)
        result = run.result()
    wall = time.monotonic() - t0
    # the test's own clock: from the first rank dying (the killed one) to the last process of the run gone
    assert first_death is not None and all_gone - first_death <= BOUND_SECONDS, (first_death, all_gone)
    assert result.returncode == 128 + 9, result.stderr[-3000:]  # the launcher reports the killed rank's status
    assert re.search(r"rank 2 \(pid \d+\) was killed by SIGKILL during iteration 3 \(forward-backward\)",
                     result.stderr), result.stderr[-3000:]
    stopped = re.search(r"all ranks stopped ([\d.]+) s after the first failure", result.stderr)
    assert stopped and float(stopped.group(1)) <= BOUND_SECONDS, result.stderr[-3000:]
    assert re.search(r"iteration +2/", result.stdout) and not re.search(r"iteration +3/", result.stdout)
    assert _processes_with_marker(marker) == [], "a process of the run survived it"
    print(f"rank 2 killed: every process of the run gone {all_gone - first_death:.1f} s after the first died "
          f"(launcher: {stopped.group(1)} s; whole run {wall:.1f} s)")


def test_exception_in_one_rank_under_torchrun_fails_the_job(cache_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HSAP_TEST_FAULT="raise@1:2")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT] + TINY +
        ["--context-parallel-size", "2", "--train-iters", "4", "--data-cache-path", cache_dir,
         "--distributed-timeout-minutes", "0.5"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert ("error: rank 1, iteration 2 (forward-backward): HSAP_TEST_FAULT: injected exception"
            in result.stderr), result.stderr[-3000:]


# ---------------------------------------------------------------- preemption, resume, interrupted save

@pytest.fixture(scope="module")
def preemption_chain(tmp_path_factory, cache_dir) -> SimpleNamespace:
    """A: 5 uninterrupted iterations. B: SIGTERM to rank 0 and SIGUSR1 to rank 1 during iteration 2.
    C: resumes, saves iteration 3, and rank 1 is killed while saving iteration 4. D: resumes again
    with --exit-duration-in-mins 0 (stops after its first iteration).

    Every run uses the distributed optimizer (sharded over the 2 CP ranks, saved 'dp_reshardable') and
    hidden dropout, so the bit-identical resumes also check the optimizer state and every rank's RNG
    state (without the RNG restore the resumed losses differ: 6.0193 vs 6.0238 in a 2-iteration check)."""
    tmp = tmp_path_factory.mktemp("chain")
    ckpt = str(tmp / "ckpt")
    base = TINY + ["--context-parallel-size", "2", "--train-iters", str(ITERS), "--data-cache-path", cache_dir,
                   "--use-distributed-optimizer", "--hidden-dropout", "0.1"]

    def run(name: str, *flags: str, fault: str = "") -> SimpleNamespace:
        log = str(tmp / f"{name}.jsonl")
        result = _run(base + ["--log-json", log] + list(flags), 2, timeout=300,
                      env={"HSAP_TEST_FAULT": fault} if fault else None)
        return SimpleNamespace(result=result, records=_records(log))

    chain = SimpleNamespace(ckpt=ckpt, a=run("a"))
    chain.b = run("b", "--save", ckpt, "--exit-signal-handler", fault="SIGTERM@0:2,SIGUSR1@1:2")
    chain.tracker_after_b = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()
    chain.c = run("c", "--load", ckpt, "--save", ckpt, "--save-interval", "1", fault="kill-in-save@1:4")
    chain.entries_after_c = sorted(e for e in os.listdir(ckpt) if e != LOCK_FILE)
    chain.tracker_after_c = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read()
    shutil.copytree(os.path.join(ckpt, "iter_0000003"), str(tmp / "iter3_copy"))
    chain.iter3_copy = str(tmp / "iter3_copy")
    chain.d = run("d", "--load", ckpt, "--save", ckpt, "--exit-duration-in-mins", "0")
    return chain


def test_uninterrupted_reference_run(preemption_chain):
    a = preemption_chain.a
    assert a.result.returncode == 0, a.result.stderr[-3000:]
    assert [r["iteration"] for r in a.records] == list(range(1, ITERS + 1))


def test_exit_signals_save_and_exit_zero_on_every_rank(preemption_chain):
    b = preemption_chain.b
    assert b.result.returncode == 0, b.result.stderr[-3000:]
    assert "exiting after iteration 2: SIGTERM received by rank 0; SIGUSR1 received by rank 1" in b.result.stdout
    assert "saved checkpoint at iteration 2" in b.result.stdout
    assert [r["iteration"] for r in b.records] == [1, 2]
    assert preemption_chain.tracker_after_b == "2"
    _same_losses(b.records, preemption_chain.a.records)


def test_resume_after_preemption_gives_the_uninterrupted_losses(preemption_chain):
    c, d = preemption_chain.c, preemption_chain.d
    assert [r["iteration"] for r in c.records] == [3, 4]
    _same_losses(c.records + d.records, preemption_chain.a.records)


def test_save_interrupted_by_a_dying_rank_keeps_the_previous_checkpoint(preemption_chain):
    from megatron_hsap.training.checkpoint import verify_files

    c = preemption_chain.c
    assert c.result.returncode == 128 + 9
    assert re.search(r"rank 1 \(pid \d+\) was killed by SIGKILL during iteration 4 \(saving checkpoint\)",
                     c.result.stderr), c.result.stderr[-3000:]
    assert preemption_chain.tracker_after_c == "3"
    assert preemption_chain.entries_after_c == ["iter_0000002", "iter_0000003", "iter_0000004.partial",
                                                "latest_checkpointed_iteration.txt"]
    assert verify_files(preemption_chain.iter3_copy) == []


def test_checkpoint_holds_what_megatron_lm_writes(preemption_chain):
    """args, checkpoint_version, the sharding metadata and one rng_state object (per PP x TP rank)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron_hsap.training.checkpoint import CHECKPOINT_VERSION, _read_common

    common = _read_common(preemption_chain.iter3_copy)
    assert common["checkpoint_version"] == CHECKPOINT_VERSION == 3.0
    assert common["iteration"] == 3
    assert (common["args"].context_parallel_size, common["args"].hidden_dropout) == (2, 0.1)
    assert common["content_metadata"] == {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                                          "distrib_optim_sharding_type": "dp_reshardable"}
    keys = FileSystemReader(preemption_chain.iter3_copy).read_metadata().state_dict_metadata
    assert [k for k in keys if k.startswith("rng_state")] == ["rng_state/shard_0.0_1.1"]


def test_use_checkpoint_args_takes_the_model_flags(preemption_chain, tmp_path):
    from megatron_hsap.training.arguments import build_parser, parse_args
    from megatron_hsap.training.checkpoint import load_args_from_checkpoint

    root = tmp_path / "ckpt"
    shutil.copytree(preemption_chain.iter3_copy, str(root / "iter_0000003"))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    args = parse_args(["--nproc", "2", "--context-parallel-size", "2", "--load", str(root), "--use-checkpoint-args",
                       "--num-layers", "4"])
    # explicit flags win (as Megatron-LM's); the rest come from the checkpoint (TINY: hidden 32, 4 heads, seq 64)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length, args.hidden_dropout) == \
        (4, 32, 4, 64, 0.1)
    assert args.max_position_embeddings == 64
    with pytest.raises(ValueError, match="holds no checkpoint"):
        load_args_from_checkpoint(build_parser().parse_args(["--load", str(tmp_path / "none"),
                                                             "--use-checkpoint-args"]), build_parser())


def test_finetune_loads_the_weights_only_and_starts_at_iteration_0(preemption_chain, tmp_path, cache_dir):
    """--finetune from the CP 2 distributed-optimizer checkpoint on one rank with the plain optimizer: no
    optimizer, scheduler or RNG state is read (so the optimizer switch is fine), the data starts over."""
    root = tmp_path / "ckpt"
    shutil.copytree(preemption_chain.iter3_copy, str(root / "iter_0000003"))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    log = tmp_path / "finetune.jsonl"
    result = _run(TINY + ["--train-iters", "2", "--data-cache-path", cache_dir, "--load", str(root), "--finetune",
                          "--log-json", str(log)], 1, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded model weights from {root} iteration 3 (--finetune: starting at iteration 0)" in result.stdout
    records = _records(log)
    assert [r["iteration"] for r in records] == [1, 2]
    # the trained weights: the first batch's loss is well below the untrained model's on it
    assert records[0]["loss"] < preemption_chain.a.records[0]["loss"] - 0.05


def test_resume_ignores_the_interrupted_save_with_a_warning(preemption_chain):
    d = preemption_chain.d
    assert d.result.returncode == 0, d.result.stderr[-3000:]
    assert re.search(r"WARNING: ignoring \S+iter_0000004\.partial: a save interrupted before it completed",
                     d.result.stdout)
    assert "loaded checkpoint from" in d.result.stdout and "at iteration 3" in d.result.stdout
    assert [r["iteration"] for r in d.records] == [4]
    assert "exiting after iteration 4: --exit-duration-in-mins 0 reached" in d.result.stdout
    assert sorted(e for e in os.listdir(preemption_chain.ckpt) if e != LOCK_FILE) == ["iter_0000002", "iter_0000003", "iter_0000004",
                                                         "latest_checkpointed_iteration.txt"]


# ---------------------------------------------------------------- checkpoint files

def _damage(path: str, how: str) -> str:
    victim = os.path.join(path, sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0])
    if how == "truncated":
        os.truncate(victim, os.path.getsize(victim) // 2)
    else:
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    return victim


@pytest.mark.parametrize("how, message", [("truncated", "is truncated or damaged"),
                                          ("corrupted", "is corrupted: its CRC-32 differs")])
def test_damaged_checkpoint_file_is_named(preemption_chain, tmp_path, how, message):
    from megatron_hsap.training.checkpoint import verify_files

    copy = str(tmp_path / "iter")
    shutil.copytree(preemption_chain.iter3_copy, copy)
    victim = _damage(copy, how)
    problems = [p for rank in range(2) for p in verify_files(copy, rank, 2)]
    assert problems == [f"{victim} {message}" + problems[0][len(victim) + 1 + len(message):]]


def _load_error(root: str) -> str:
    """What load_checkpoint raises on this rank (it checks the files before it touches model or optimizer)."""
    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.checkpoint import load_checkpoint

    with pytest.raises(RuntimeError) as err:
        load_checkpoint(root, model=[], optimizer=None, scheduler=None, args=parse_args(["--nproc", "2"]))
    return str(err.value)


def test_damaged_checkpoint_stops_every_rank_naming_the_file(preemption_chain, tmp_path):
    from tests.distributed import run_distributed

    ckpt = tmp_path / "ckpt"
    shutil.copytree(preemption_chain.iter3_copy, str(ckpt / "iter_0000003"))
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    victim = _damage(str(ckpt / "iter_0000003"), "truncated")
    errors = run_distributed(_load_error, 2, str(ckpt))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"--load {str(ckpt)!r}: {victim} is truncated or damaged: "), errors[0]


def test_tracker_naming_an_incomplete_checkpoint_falls_back_with_a_warning(tmp_path, preemption_chain):
    from megatron_hsap.training.checkpoint import _choose

    root = tmp_path / "ckpt"
    shutil.copytree(preemption_chain.iter3_copy, str(root / "iter_0000003"))
    (root / "iter_0000005").mkdir()  # e.g. a tracker restored from elsewhere, or a lost directory
    (root / "iter_0000005" / "__0_0.distcp").write_bytes(b"half")
    (root / "latest_checkpointed_iteration.txt").write_text("5")
    iteration, warnings = _choose(str(root))
    assert iteration == 3
    assert warnings == [f"WARNING: {root}/iter_0000005 (named by latest_checkpointed_iteration.txt) is missing or "
                        "incomplete; loading the previous complete checkpoint, iteration 3"]


def test_missing_load_directory_starts_from_scratch(tmp_path):
    from megatron_hsap.training.checkpoint import _choose

    assert _choose(str(tmp_path / "nothing")) == (
        None, [f"WARNING: --load {str(tmp_path / 'nothing')!r} does not exist; starting from scratch"])


def test_empty_load_directory_starts_from_scratch(tmp_path):
    from megatron_hsap.training.checkpoint import _choose

    assert _choose(str(tmp_path)) == (
        None, [f"WARNING: --load {str(tmp_path)!r} is empty (no checkpoint saved yet); starting from scratch"])


def test_tracker_write_is_atomic(tmp_path, monkeypatch):
    from megatron_hsap.training import checkpoint

    checkpoint.write_tracker(str(tmp_path), 2)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"

    def crash(*_args):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.write_tracker(str(tmp_path), 4)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"  # the old one, whole


# ---------------------------------------------------------------- NaN / Inf

def test_nan_in_one_ranks_attention_weights_stops_before_the_step(tmp_path, cache_dir):
    log = tmp_path / "log.jsonl"
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "4", "--data-cache-path", cache_dir,
                          "--log-json", str(log)], 2, timeout=300, env={"HSAP_TEST_FAULT": "nan-attention@1:2"})
    assert result.returncode == 1
    lines = [ln for ln in result.stderr.splitlines() if "NaN/Inf at iteration 2" in ln]
    assert len(lines) == 2, result.stderr[-3000:]
    assert "the optimizer step was not applied" in lines[0]
    assert re.search(r"rank 1: attention output of layer 2, loss, gradients", lines[0])
    assert any(re.search(r"rank 1: [^;]*gradients \(\d+ of \d+ tensors, e\.g\. \S+\)", ln) for ln in lines)
    assert [r["iteration"] for r in _records(log)] == [1]


def test_nan_check_flag_is_on_by_default():
    from megatron_hsap.training.arguments import parse_args

    assert parse_args(["--nproc", "1"]).check_for_nan_in_loss_and_grad is True
    assert parse_args(["--nproc", "1", "--no-check-for-nan-in-loss-and-grad"]).check_for_nan_in_loss_and_grad is False


# ---------------------------------------------------------------- corrupt or mismatched data

def _dataset(tmp_path, name: str, docs: List[List[int]], vocab_size: int) -> str:
    from megatron_hsap.training.corpus import write_indexed_dataset

    prefix = str(tmp_path / name)
    write_indexed_dataset(prefix, docs, vocab_size)
    return prefix


DOCS = [[5, 6, 7, 0], [8, 9, 0], list(range(1, 200)) + [0]]


def test_truncated_bin_is_named(tmp_path):
    from megatron_hsap.training.dataset_check import check_indexed_dataset

    prefix = _dataset(tmp_path, "d", DOCS, 512)
    os.truncate(prefix + ".bin", 100)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}.bin is 100 bytes") + ".*truncated"):
        check_indexed_dataset(prefix)


def test_truncated_idx_is_named(tmp_path):
    from megatron_hsap.training.dataset_check import check_indexed_dataset

    prefix = _dataset(tmp_path, "d", DOCS, 512)
    os.truncate(prefix + ".idx", os.path.getsize(prefix + ".idx") - 8)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}.idx is") + ".*truncated or damaged"):
        check_indexed_dataset(prefix)


def test_bin_of_another_dtype_is_named(tmp_path):
    from megatron_hsap.training.dataset_check import check_indexed_dataset

    small = _dataset(tmp_path, "u16", DOCS, 512)          # uint16 tokens
    large = _dataset(tmp_path, "i32", DOCS, 100_000)      # int32 tokens
    shutil.copy(large + ".bin", small + ".bin")
    with pytest.raises(ValueError, match="fits 4-byte tokens: written with another dtype than the index's uint16"):
        check_indexed_dataset(small)


def test_token_ids_beyond_the_vocabulary(tmp_path):
    from megatron_hsap.training.dataset_check import check_token_ids

    prefix = _dataset(tmp_path, "d", DOCS, 512)
    check_token_ids(prefix, 200)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}.bin holds token id 199, outside the tokenizer's "
                                                   "vocabulary [0, 199)")):
        check_token_ids(prefix, 199)


def test_bad_data_stops_every_rank_before_training(tmp_path, cache_dir):
    prefix = _dataset(tmp_path, "d", [list(range(1, 300)) + [0]] * 40, 512)
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", "2", "--data-cache-path", cache_dir]
    # vocabulary: byte ids up to 299 against NullTokenizer --vocab-size 256, found by rank 0, raised on both
    result = _run(TINY + data + ["--context-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
                                 "--vocab-size", "256"], 2, timeout=300)
    assert result.returncode == 2
    assert result.stderr.count(f"{prefix}.bin holds token id 299, outside the tokenizer's vocabulary") == 2
    assert "iteration" not in result.stdout
    # a truncated file: refused while parsing the flags, before any process group
    os.truncate(prefix + ".bin", 64)
    result = _run(TINY + data, 1, timeout=60)
    assert result.returncode == 2 and f"{prefix}.bin is 64 bytes" in result.stderr


def test_out_of_range_ids_in_a_batch_are_caught_before_the_embedding():
    import torch

    from megatron_hsap.training.data import micro_batches

    sample = {"tokens": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([2, 3, 4, 600]),
              "loss_mask": torch.ones(4)}
    args = SimpleNamespace(global_batch_size=1, micro_batch_size=1, data_parallel_size=1, train_iters=3,
                           num_microbatches=1)
    batches = micro_batches([sample] * 3, args, 0, 1, vocab_size=512)
    with pytest.raises(ValueError, match=re.escape("iteration 2: samples 1..1 hold labels id 600, outside the "
                                                   "vocabulary [0, 512)")):
        next(batches)
