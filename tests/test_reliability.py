"""Failures that must neither hang nor lose work (issue 29): a stopped rank, preemption through the launcher,
two jobs on one checkpoint directory, a checkpoint that tries to run code, one-rank-bad attention input.

End-to-end runs use the tiny GPT of ``tests/test_fault_tolerance.py`` on warm forked ranks (``tests/cli_runs.py``)
and the test-only ``HSAP_TEST_FAULT`` hook; several checks share one run where they can.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Iterator, Tuple

import pytest

from megatron_hsap.training.save_lock import lock_save_directory

from tests.distributed import run_distributed
from tests.test_fault_tolerance import TINY
from tests.test_training_pretrain import ROOT, _run

#: A run that outlives this is a hang (the bug these tests guard against): the test fails instead of waiting.
HANG_SECONDS = 90


#: The stopped-rank runs (rank 1 of CP 2 stops in iteration 2): their flags besides the ones each test varies.
STOPPED_RANK = TINY + ["--context-parallel-size", "2", "--train-iters", "4", "--rank-failure-grace-seconds", "2"]


def _stopped_rank_run(cache_dir: str, *flags: str) -> Tuple[subprocess.CompletedProcess, float]:
    """Rank 1 of CP 2 SIGSTOPs itself in iteration 2's forward; returns the finished run and its wall seconds
    (fails on a hang)."""
    t0 = time.monotonic()
    try:
        result = _run(STOPPED_RANK + ["--data-cache-path", cache_dir] + list(flags), 2, timeout=HANG_SECONDS,
                      env={"HSAP_TEST_FAULT": "stop@1:2"})
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the run with a stopped rank hung for {HANG_SECONDS} s: {str(err.stderr)[-2000:]}")
    return result, time.monotonic() - t0


@pytest.fixture(scope="module")
def stopped_rank_runs(cache_dir) -> Iterator[Dict[str, concurrent.futures.Future]]:
    """The two stopped-rank runs at the same time: each spends most of its wall time waiting on the stopped rank
    (a collective's timeout, the stall watchdog), so together they take about as long as the longer one. A run of
    the same flags without the fault comes first, so the two only read the cached dataset indices."""
    warm = _run(STOPPED_RANK + ["--data-cache-path", cache_dir], 2, timeout=HANG_SECONDS)
    assert warm.returncode == 0, warm.stderr[-3000:]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # 15 s: short against the 10-minute default, long enough for start-up's collectives on a slow stack
        yield {"collective timeout": pool.submit(_stopped_rank_run, cache_dir, "--distributed-timeout-minutes",
                                                 "0.25", "--stall-timeout-minutes", "0"),
               "stall watchdog": pool.submit(_stopped_rank_run, cache_dir, "--distributed-timeout-minutes", "10",
                                             "--stall-timeout-minutes", "0.2")}


def _launcher_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("pretrain_gpt_hsap.py:"))


def test_distributed_timeout_bounds_every_group(stopped_rank_runs):
    """With the watchdog off, the CP group's collective must time out after --distributed-timeout-minutes
    (Megatron-Core's groups default to 30 minutes unless given the timeout)."""
    result, wall = stopped_rank_runs["collective timeout"].result()
    assert result.returncode != 0, result.stderr[-3000:]
    assert re.search(r"rank 0 \(pid \d+\) exited with status 1 during iteration 2", result.stderr), \
        result.stderr[-3000:]
    print(f"stopped rank, 15 s collective timeout: run ended after {wall:.1f} s")


def test_stall_watchdog_names_the_stopped_rank_and_prints_every_stack(stopped_rank_runs):
    result, wall = stopped_rank_runs["stall watchdog"].result()
    assert result.returncode == 124, result.stderr[-3000:]
    assert re.search(r"no rank advanced for 12 s \(--stall-timeout-minutes\): rank 1 \(pid \d+\) stopped advancing "
                     r"first, during iteration 2 \(forward-backward\); stopped \(SIGSTOP or a debugger\): rank\(s\) 1",
                     result.stderr), _launcher_lines(result.stderr)
    # faulthandler's dump of each rank under its header: the stopped rank in its forward, rank 0 waiting for it.
    chunks = re.split(r"stack of rank (\d) \(pid \d+\):\n", result.stderr)[1:]
    stacks = dict(zip(chunks[0::2], chunks[1::2]))
    assert sorted(stacks) == ["0", "1"], result.stderr[-5000:]
    for stack in stacks.values():
        assert re.search(r"(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)*  File .*loop\.py", stack), \
            stack
    assert "fault_injection.py" in stacks["1"], stacks["1"]
    print(f"stopped rank, 12 s stall timeout: run ended after {wall:.1f} s")


@pytest.mark.parametrize("fault, saved", [
    ("parent-SIGTERM@0:2", 2),  # during a forward
    ("parent-SIGTERM-in-save@0:1,parent-SIGTERM-in-save@1:1", 2),  # two SIGTERMs during the first save
    ("parent-SIGUSR1-in-save@1:2", 3),  # during a periodic save
    ("parent-SIGUSR1@1:2", 2),  # during a forward
    ("group-SIGUSR1@0:2", 2),  # to a rank and every helper it started (as a cluster signalling all processes)
    ("group-SIGTERM@0:2", 2),
], ids=["SIGTERM", "two-SIGTERMs-in-first-save", "SIGUSR1-in-periodic-save", "SIGUSR1-in-forward",
        "SIGUSR1-to-rank-and-helpers", "SIGTERM-to-rank-and-helpers"])
def test_signal_to_the_launcher_leaves_a_complete_preemption_checkpoint(tmp_path, cache_dir, fault, saved):
    """The launcher passes the signal to the rank processes only, and the helpers the ranks started block it
    (``rank_helpers``): the checkpoint writer's Manager lives on, and every rank saves and exits 0. Before: the
    signal to every process of a rank killed its Manager, and the save failed (BrokenPipeError, exit 1)."""
    ckpt = tmp_path / "ckpt"
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "5", "--data-cache-path", cache_dir,
                          "--save", str(ckpt), "--save-interval", "1", "--exit-signal-handler"], 2,
                  timeout=HANG_SECONDS, env={"HSAP_TEST_FAULT": fault})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exiting after iteration {saved}" in result.stdout + result.stderr, result.stdout[-2000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(saved)
    assert (ckpt / f"iter_{saved:07d}" / "hsap_manifest.json").is_file()
    assert not [p.name for p in ckpt.iterdir() if p.name.endswith(".partial")]


# ---------------------------------------------------------------- one job per --save directory

def test_second_job_on_a_locked_save_directory_fails_at_start_up_naming_the_holder(tmp_path, cache_dir):
    save = tmp_path / "ckpt"
    holder = lock_save_directory(str(save))  # the first job
    try:
        result = _run(TINY + ["--train-iters", "2", "--data-cache-path", cache_dir, "--save", str(save)], 1,
                      timeout=HANG_SECONDS)
    finally:
        holder.close()
    assert result.returncode == 2, result.stderr[-2000:]
    assert re.search(rf"error: --save '{re.escape(str(save))}' is in use by another job \(pid {os.getpid()} on "
                     r"\S+ since .*\)", result.stderr), result.stderr[-2000:]
    assert not any(p.name.startswith("iter_") for p in save.iterdir())
    again = lock_save_directory(str(save))  # released with its holder
    again.close()


@pytest.mark.parametrize("under_file", [False, True], ids=["a-file", "under-a-file"])
def test_unwritable_save_path_is_refused_at_start_up(tmp_path, under_file):
    """A file, or a path below one (a read-only directory cannot be tested here: the tests may run as root)."""
    (tmp_path / "file").write_text("not a directory")
    save = tmp_path / "file" / "ckpt" if under_file else tmp_path / "file"
    with pytest.raises(ValueError, match=rf"--save '{re.escape(str(save))}' is not a writable directory"):
        lock_save_directory(str(save))


def test_read_only_save_directory_is_refused_at_start_up():
    """A directory the job may not write (mode 0555). Root writes anyway, so as root the check runs in a child
    that drops to an unprivileged user; the directory lives outside pytest's root-only tmp tree."""
    parent = tempfile.mkdtemp(prefix="hsap_ro_")
    try:
        os.chmod(parent, 0o755)
        save = os.path.join(parent, "ckpt")
        os.mkdir(save, 0o555)
        os.chmod(save, 0o555)
        code = ("import os, sys\n"  # imported first: the unprivileged user may not read the interpreter's files
                "from megatron_hsap.training.save_lock import lock_save_directory\n"
                "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
                "try:\n    lock_save_directory(sys.argv[1])\nexcept ValueError as err:\n    print(err)\n")
        result = subprocess.run([sys.executable, "-c", code, save], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"--save {save!r} is not a writable directory (Permission denied)" in result.stdout, result.stdout
        assert os.listdir(save) == []
    finally:
        shutil.rmtree(parent)


# ---------------------------------------------------------------- one-rank-bad attention input

def _head_chunked_mismatch(case: str) -> str:
    import torch
    import torch.distributed as dist

    from megatron_hsap.attention.upipe import head_chunked_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode="hsap", ulysses_size=2, kernel="cpu_fused"))
    rank = topo.cp_rank
    plan = plan_batch(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
    dtype = torch.float64 if case == "dtype" and rank == 1 else torch.float32
    chunk = {("head_chunk_size", 2): 4, ("bad", 3): 3}.get((case, rank), 2)
    hidden, weight = torch.randn(plan.tokens_per_rank, 1, 16, dtype=dtype), torch.randn(8 * 8, 16, dtype=dtype)
    with pytest.raises(ValueError) as info:
        head_chunked_attention(hidden, weight, None, plan, num_heads_q=4, num_heads_kv=2, head_dim=8,
                               head_chunk_size=chunk)
    dist.barrier()  # every rank got here: nobody is stuck in an attention collective
    return str(info.value)


@pytest.mark.parametrize("case,expected", [("dtype", "dtype (CP ranks [1] differ from CP rank 0)"),
                                           ("head_chunk_size", "head_schedule (CP ranks [2] differ from CP rank 0)"),
                                           ("bad", "CP rank(s) [3] rejected their attention inputs")])
def test_head_chunked_input_bad_on_one_rank_raises_on_every_rank(case, expected):
    messages = run_distributed(_head_chunked_mismatch, 4, case, timeout=120)
    if case == "bad":
        assert "head_chunk_size" in messages[3] and "[3]" in messages[3], messages[3]
        messages = messages[:3]
    assert all(m == messages[0] for m in messages), messages
    assert expected in messages[0], messages[0]


# ---------------------------------------------------------------- NaN / Inf propagate in every mode

#: (tensor, token, head, value): one poisoned element. Token 5 is in document 0 ([0, 40)), token 50 in document 1.
POISON = [("q", 5, 1, float("nan")), ("k", 50, 0, float("nan")), ("q", 44, 3, float("-inf")),
          ("k", 20, 1, float("inf"))]


def _poisoned_attention(mode: str, ulysses_size, poison) -> list:
    import torch

    from megatron_hsap.attention import context_parallel_attention
    from megatron_hsap.config import ContextParallelConfig
    from megatron_hsap.parallel_state import initialize_model_parallel
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import plan_batch

    topo = initialize_model_parallel(context_parallel_size=4, ranks_per_node=2,
                                     cp_config=ContextParallelConfig(mode=mode, ulysses_size=ulysses_size,
                                                                     kernel="cpu_fused"))
    plan = plan_batch(cu_seqlens_from_lengths([40, 24]), topo, "zigzag")
    gen = torch.Generator().manual_seed(3)
    qkv = {"q": torch.randn(64, 4, 8, generator=gen, dtype=torch.float64),
           "k": torch.randn(64, 2, 8, generator=gen, dtype=torch.float64),
           "v": torch.randn(64, 2, 8, generator=gen, dtype=torch.float64)}
    name, token, head, value = poison
    qkv[name][token, head] = value
    out = context_parallel_attention(*(plan.shard(qkv[n]) for n in "qkv"), plan)
    return plan.unshard(out).tolist()


@pytest.mark.parametrize("mode,ulysses_size", [("ring", None), ("ulysses", None), ("hybrid", 2)])
def test_nan_and_inf_propagate_as_in_the_single_rank_reference(mode, ulysses_size):
    """Every output element is NaN (or +-Inf) exactly where the fp64 single-process reference's is; the
    finite ones agree with it."""
    import torch

    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from tests.reference import dense_attention

    for poison in POISON:
        got = torch.tensor(run_distributed(_poisoned_attention, 4, mode, ulysses_size, poison, timeout=120)[0],
                           dtype=torch.float64)
        gen = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(64, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
        name, token, head, value = poison
        {"q": q, "k": k, "v": v}[name][token, head] = value
        expected = dense_attention(q, k, v, cu_seqlens_from_lengths([40, 24]))
        assert expected.isnan().any() or expected.isinf().any(), f"{poison}: the poison reaches no output"
        assert torch.equal(got.isnan(), expected.isnan()), f"{mode} {poison}: NaN at " \
            f"{got.isnan().nonzero().tolist()[:8]}, reference at {expected.isnan().nonzero().tolist()[:8]}"
        finite = expected.isfinite()
        assert torch.equal(got[~finite & ~expected.isnan()], expected[~finite & ~expected.isnan()]), poison
        assert torch.allclose(got[finite], expected[finite], atol=1e-10, rtol=0), poison


# ---------------------------------------------------------------- start-up errors say what is wrong

@pytest.mark.parametrize("flags, message", [
    (["--lr", "1e-4", "--min-lr", "1e-3"], r"--min-lr \(0.001\) must not exceed --lr \(0.0001\)"),
    (["--data-path", "0", "{a}", "1", "{b}"], r"--data-path: the weight of '.*/a' is '0'; weights must be finite"),
    (["--data-path", "1", "{a}", "nan", "{b}"], r"--data-path: the weight of '.*/b' is 'nan'; weights must be"),
    (["--data-path", "-1", "{a}", "2", "{b}"], r"--data-path: the weight of '.*/a' is '-1'; weights must be"),
], ids=["min-lr-above-lr", "weight-0", "weight-nan", "weight-negative"])
def test_start_up_errors_name_the_flag(tmp_path, capsys, flags, message):
    """Before these checks the run failed later with an empty message (``error: rank 1, start-up: ``)."""
    from megatron_hsap.training.arguments import parse_args

    for name in "ab":
        for ext in (".bin", ".idx"):
            (tmp_path / (name + ext)).write_bytes(b"")
    argv = ["--nproc", "1"] + [f.format(a=tmp_path / "a", b=tmp_path / "b") for f in flags]
    with pytest.raises((ValueError, SystemExit)) as err:  # parse_args reports some as argparse errors (exit 2)
        parse_args(argv)
    assert re.search(message, str(err.value) + capsys.readouterr().err)


# ---------------------------------------------------------------- no code runs from a checkpoint

def _rewrite_manifest(path, how: str) -> None:
    """``recomputed``: every file's size and CRC-32 written anew (as whoever edited the files could);
    ``deleted``: no manifest (an unverified checkpoint)."""
    import json
    import zlib

    manifest = path / "hsap_manifest.json"
    if how == "deleted":
        manifest.unlink()
        return
    files = {p.name: [p.stat().st_size, zlib.crc32(p.read_bytes())] for p in path.iterdir()
             if p.name != manifest.name}
    manifest.write_text(json.dumps({"iteration": json.loads(manifest.read_text())["iteration"], "files": files}))


class _RunsCode:
    """Unpickled, runs ``code`` (creates a marker file) and returns ``then``'s value: the real content, so a
    loader without an allow-list carries on as if nothing happened."""

    def __init__(self, marker: str, then: str) -> None:
        self.marker, self.then = marker, then

    def __reduce__(self):
        return eval, (f"[__import__('pathlib').Path({self.marker!r}).touch(), {self.then}][1]",)


def _craft(path, kind: str, marker: str) -> str:
    """Make checkpoint directory ``path`` run code when loaded; returns the file that carries the code.

    ``metadata``: ``.metadata`` becomes a pickle that runs code, then returns the real metadata.
    ``sharded-object``: ``rng_state`` points at a new ``evil.distcp`` holding a ``torch.save`` object that runs
    code, then returns the real RNG states (``.metadata`` itself holds only allowed classes).
    """
    import io
    import pickle

    import torch

    meta_file = path / ".metadata"
    if kind == "metadata":
        original = meta_file.read_bytes()
        meta_file.write_bytes(pickle.dumps(_RunsCode(marker, f"__import__('pickle').loads({original!r})")))
        return str(meta_file)
    metadata = pickle.loads(meta_file.read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn.startswith("rng_state"))
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        original = f.read(info.length)
    buffer = io.BytesIO()
    torch.save(_RunsCode(marker, f"__import__('torch').load(__import__('io').BytesIO({original!r}), "
                                 "weights_only=False)"), buffer)
    (path / "evil.distcp").write_bytes(buffer.getvalue())
    metadata.storage_data[index] = type(info)("evil.distcp", 0, len(buffer.getvalue()))
    meta_file.write_bytes(pickle.dumps(metadata))
    return str(path / "evil.distcp")


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory, cache_dir) -> str:
    """One iteration of the tiny GPT on CP 2, saved (a real rng_state sharded object, layers' _extra_state)."""
    ckpt = tmp_path_factory.mktemp("small") / "ckpt"
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "2", "--save-interval", "1",
                          "--exit-interval", "1", "--data-cache-path", cache_dir, "--save", str(ckpt)], 2,
                  timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    return str(ckpt)


def _copy_checkpoint(small_checkpoint: str, tmp_path) -> "os.PathLike":
    import shutil

    root = tmp_path / "ckpt"
    shutil.copytree(small_checkpoint, root, ignore=shutil.ignore_patterns(".hsap_lock"))
    return root


def _load_problem(root: str) -> str:
    """What load_checkpoint raises on this rank; it reads no model state before the checks."""
    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.checkpoint import load_checkpoint

    args = parse_args(["--nproc", "2", "--context-parallel-size", "2"] + TINY)
    with pytest.raises(RuntimeError) as err:
        load_checkpoint(root, model=[], optimizer=None, scheduler=None, args=args)
    return str(err.value)


@pytest.mark.parametrize("manifest", ["recomputed", "deleted"])
@pytest.mark.parametrize("kind, refused", [("metadata", "builtins.eval"), ("sharded-object", "builtins.eval")])
def test_checkpoint_pickle_that_runs_code_is_refused_on_every_rank(small_checkpoint, tmp_path, kind, refused,
                                                                   manifest):
    """Before: ``.metadata`` went through ``pickle.load`` and sharded objects through
    ``torch.load(weights_only=False)``, so the marker file appeared on every rank and training went on."""
    root = _copy_checkpoint(small_checkpoint, tmp_path)
    marker = tmp_path / "code-ran"
    carrier = _craft(root / "iter_0000001", kind, str(marker))
    _rewrite_manifest(root / "iter_0000001", manifest)
    errors = run_distributed(_load_problem, 2, str(root), timeout=120)
    assert errors[0] == errors[1], errors
    assert f"{carrier}" in errors[0] and f"names {refused}" in errors[0] and "refusing to load it" in errors[0], \
        errors[0]
    assert not marker.exists()


def test_resume_from_a_checkpoint_that_runs_code_stops_every_rank(small_checkpoint, tmp_path, cache_dir):
    """End to end: the sharded-object attack with a recomputed manifest; every rank names the file, none runs it."""
    root = _copy_checkpoint(small_checkpoint, tmp_path)
    marker = tmp_path / "code-ran"
    carrier = _craft(root / "iter_0000001", "sharded-object", str(marker))
    _rewrite_manifest(root / "iter_0000001", "recomputed")
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "2", "--data-cache-path", cache_dir,
                          "--load", str(root)], 2, timeout=HANG_SECONDS)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count(f"{carrier} (object 'rng_state/shard_0.0_1.1') names builtins.eval") == 2, \
        result.stderr[-3000:]
    assert not marker.exists()
    assert "iteration        2/" not in result.stdout


def test_checkpoint_without_a_manifest_loads_with_a_note_that_it_is_unverified(small_checkpoint, tmp_path,
                                                                               cache_dir):
    root = _copy_checkpoint(small_checkpoint, tmp_path)
    (root / "iter_0000001" / "hsap_manifest.json").unlink()
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "2", "--data-cache-path", cache_dir,
                          "--load", str(root)], 2, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"note: \S+iter_0000001 has no hsap_manifest\.json: unverified", result.stdout), result.stdout
    assert "loaded checkpoint from" in result.stdout


@pytest.mark.parametrize("kind", ["metadata", "sharded-object"])
def test_megatron_core_load_itself_reads_through_the_allow_list(small_checkpoint, tmp_path, kind):
    """Defence in depth: a file changed after ``check_pickles`` is refused by the load itself
    (``restricted_loading``: torch's ``FileSystemReader.read_metadata`` and its ``load_bytes``'s torch.load)."""
    import io
    import pickle
    from types import SimpleNamespace

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron_hsap.training.checkpoint_trust import UnsafeCheckpointError, restricted_loading

    root = _copy_checkpoint(small_checkpoint, tmp_path)
    marker = tmp_path / "code-ran"
    carrier = _craft(root / "iter_0000001", kind, str(marker))
    with restricted_loading():
        if kind == "metadata":
            with pytest.raises(UnsafeCheckpointError, match=re.escape(carrier) + " names builtins.eval"):
                FileSystemReader(str(root / "iter_0000001")).read_metadata()
        else:
            planner = DefaultLoadPlanner()
            planner.flatten_state_dict, planner.state_dict = False, {}
            read_item = SimpleNamespace(dest_index=SimpleNamespace(fqn="rng_state"))  # all load_bytes reads
            with pytest.raises(pickle.UnpicklingError, match="GLOBAL eval was not an allowed global"):
                planner.load_bytes(read_item, io.BytesIO(open(carrier, "rb").read()))
    assert not marker.exists()


# ---------------------------------------------------------------- errors that name the cause

def test_disk_full_during_a_save_names_the_cause_and_the_file(tmp_path, cache_dir):
    """Before: ``error: rank 0, saving checkpoint: CheckpointException ranks:dict_keys([0])`` (torch's
    ``CheckpointException`` is a BaseException whose message lists the ranks, not the cause). Rank 0 writes
    every shard here (the CP ranks hold replicas), so its writer gets the full disk. Both ranks learn of the
    failure in the same collective and report it; rank 0 does not exit by itself afterwards (it is killed when
    the launcher's grace ends), so the run gets 3 s of grace instead of the default 10."""
    ckpt = tmp_path / "ckpt"
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "2", "--data-cache-path", cache_dir,
                          "--save", str(ckpt), "--save-interval", "1", "--rank-failure-grace-seconds", "3"], 2,
                  timeout=HANG_SECONDS, env={"HSAP_TEST_FAULT": "disk-full-in-save@0:1"})
    assert result.returncode == 1, result.stderr[-3000:]
    staging = ckpt / "iter_0000001.partial"
    line = re.compile(rf"error: rank \d, iteration 1 \(saving checkpoint\): --save '{re.escape(str(ckpt))}': saving "
                      rf"iteration 1 into {re.escape(str(staging))} failed: rank 0: No space left on device: "
                      rf"{re.escape(str(staging))}/__0_\d\.distcp")
    # megatron-core >= 0.19's writer passes on only the error's class and logs the error: the cause comes from
    # that log line in the same process (checkpoint._writer_error_log)
    assert len(line.findall(result.stderr)) == 1, result.stderr[-3000:]
    assert re.search(r"error: rank 1, iteration 1 \(saving checkpoint\): .* failed: on another rank \(its error "
                     r"names the cause\)", result.stderr), result.stderr[-3000:]
    assert "CheckpointException" not in result.stderr
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()


def test_sigint_in_a_rank_is_named(tmp_path, cache_dir):
    """Before: ``error: rank 1, iteration 1 (forward-backward): `` and nothing after it (KeyboardInterrupt has
    no message)."""
    result = _run(TINY + ["--context-parallel-size", "2", "--train-iters", "2", "--data-cache-path", cache_dir], 2,
                  timeout=HANG_SECONDS, env={"HSAP_TEST_FAULT": "SIGINT@1:1"})
    assert result.returncode == 1, result.stderr[-3000:]
    assert "error: rank 1, iteration 1 (forward-backward): interrupted by SIGINT (KeyboardInterrupt)" in \
        result.stderr, result.stderr[-3000:]
    assert not re.search(r"error: [^\n]*: $", result.stderr, re.M), result.stderr[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--ffn-hidden-size", "64"], "--ffn-hidden-size is 64 but {path} was written with 128"),
    (["--num-query-groups", "2"], "--num-query-groups is 2 but {path} was written with 4"),
    (["--swiglu"], "--swiglu is True but {path} was written with False"),
    (["--ffn-hidden-size", "128"], None),  # the default, 4 x hidden size, given explicitly: the same model
], ids=["ffn-hidden-size", "num-query-groups", "swiglu", "ffn-default-given"])
def test_load_checks_the_mlp_and_query_group_shapes_first(small_checkpoint, flags, message):
    """Before: these differences failed deep inside megatron-core's load (shape mismatch of a sharded tensor)."""
    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.checkpoint import _problems

    args = parse_args(["--nproc", "2", "--context-parallel-size", "2"] + TINY + flags)
    problems, _ = _problems(small_checkpoint, 1, args)
    path = os.path.join(small_checkpoint, "iter_0000001")
    assert problems == ([] if message is None else [f"--load {small_checkpoint!r}: {message.format(path=path)} "
                                                    "(--use-checkpoint-args takes the checkpoint's)"])


def test_a_renamed_iteration_directory_is_refused(small_checkpoint, tmp_path):
    """Before: after swapping two iteration directories the run resumed (and logged) the directory's iteration
    with the other one's state."""
    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.checkpoint import _problems

    root = _copy_checkpoint(small_checkpoint, tmp_path)
    (root / "iter_0000001").rename(root / "iter_0000003")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    problems, _ = _problems(str(root), 3, parse_args(["--nproc", "2", "--context-parallel-size", "2"] + TINY))
    assert problems == [f"--load {str(root)!r}: {root}/iter_0000003 holds iteration 1, not 3 (its directory was "
                        "renamed or swapped with another): refusing to resume at the wrong iteration"]


@pytest.mark.parametrize("name", ["/etc/hostname", "../outside.txt", "sub/../../outside.txt"])
def test_manifest_entries_outside_the_checkpoint_are_refused(small_checkpoint, tmp_path, name):
    """Before: an absolute (or ``..``) manifest entry was opened and checksummed outside the checkpoint."""
    import json

    from megatron_hsap.training.checkpoint import verify_files

    root = _copy_checkpoint(small_checkpoint, tmp_path)
    (root / "outside.txt").write_text("x")
    path = root / "iter_0000001"
    manifest = json.loads((path / "hsap_manifest.json").read_text())
    manifest["files"][name] = [1, 0]
    (path / "hsap_manifest.json").write_text(json.dumps(manifest))
    problems = [p for rank in range(2) for p in verify_files(str(path), rank, 2)]
    assert problems == [f"{path}/hsap_manifest.json names {name!r}, outside the checkpoint directory: refusing to "
                        "read it"]


@pytest.mark.parametrize("per_node, error", [(3, True), (2, False), (4, False)])
def test_hsap_whose_node_size_leaves_no_ulysses_group_is_refused(per_node, error, capsys):
    """Before: CP 4 with 3 ranks per node ran hsap as a pure ring without a word."""
    from megatron_hsap.training.arguments import parse_args

    argv = ["--nproc", "4", "--context-parallel-size", "4", "--ranks-per-node", str(per_node)]
    if not error:
        assert parse_args(argv).context_parallel_mode == "hsap"
        return
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert ("--context-parallel-mode hsap with --context-parallel-size 4: 3 ranks per node (--ranks-per-node, or "
            "the launcher's LOCAL_WORLD_SIZE) leave no Ulysses group of 2 or more CP ranks inside one node, so it "
            "would run as a pure ring; use a node size that is a multiple of one of [2, 4] ranks") in \
        capsys.readouterr().err


# ---------------------------------------------------------------- data checked before it trains

def _damaged_index(tmp_path, how: str) -> str:
    """A 3-document dataset (3 sequences, document index [0, 1, 2, 3]) with one index entry made wrong."""
    import numpy as np

    from tests.test_fault_tolerance import DOCS, _dataset

    prefix = _dataset(tmp_path, "d", DOCS, 512)
    idx = prefix + ".idx"
    sequences, header = 3, 34
    if how == "extra-documents":  # the header claims a fifth document boundary, appended past the end
        with open(idx, "r+b") as f:
            f.seek(26)
            f.write((5).to_bytes(8, "little"))
            f.seek(0, 2)
            f.write((7).to_bytes(8, "little"))
        return prefix
    dtype, offset, count, value = {
        "negative-size": (np.int32, header, sequences, -5),
        "pointer-past-end": (np.int64, header + 4 * sequences, sequences, os.path.getsize(prefix + ".bin") + 64),
        "wild-document-index": (np.int64, header + 12 * sequences, sequences + 1, 1 << 40)}[how]
    entries = np.memmap(idx, dtype=dtype, mode="r+", offset=offset, shape=(count,))
    entries[1] = value
    entries.flush()
    return prefix


@pytest.mark.parametrize("how, message", [
    ("negative-size", r"sequence 1 has a negative size \(-5 tokens; 1 such\)"),
    ("pointer-past-end", r"sequence 1 \(\d+ tokens at byte \d+; 1 such\) lies outside .*d\.bin"),
    ("wild-document-index", "document-index entry 1 is 1099511627776; the entries must rise from 0 to the sequence "
                            r"count \(3\)"),
    ("extra-documents", r"document-index entry 4 is 7; the entries must rise from 0 to the sequence count \(3\)"),
])
def test_index_entries_are_checked_against_the_bin_before_training(tmp_path, how, message):
    """Before: these trained with exit 0, or (a pointer past the end) failed only at the iteration that read it,
    without naming the file."""
    from megatron_hsap.training.dataset_check import check_indexed_dataset

    prefix = _damaged_index(tmp_path, how)
    with pytest.raises(ValueError, match=re.escape(prefix + ".idx") + ": " + message):
        check_indexed_dataset(prefix)


def test_data_cache_is_keyed_by_the_datasets_content(tmp_path):
    """Before: the sample-index cache was named after the configuration alone, so a dataset rewritten at the
    same prefix trained on the stale indices (or raised IndexError)."""
    from megatron_hsap.training.arguments import parse_args
    from megatron_hsap.training.data import dataset_config
    from megatron_hsap.training.tokenizer import build_tokenizer
    from tests.test_fault_tolerance import DOCS, _dataset

    prefix = _dataset(tmp_path, "d", DOCS, 512)
    args = parse_args(["--nproc", "1", "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size",
                       "512", "--data-cache-path", str(tmp_path / "cache")])
    tokenizer = build_tokenizer("NullTokenizer", None, 512, None, None, None)
    first = dataset_config(args, tokenizer, args.data_path).path_to_cache
    assert dataset_config(args, tokenizer, args.data_path).path_to_cache == first  # same files: the same cache
    _dataset(tmp_path, "d", DOCS[::-1], 512)  # the same sizes, another document order
    assert dataset_config(args, tokenizer, args.data_path).path_to_cache != first



# ---------------------------------------------------------------- no orphans

def _descendants(pid: int) -> list:
    """Every living descendant of ``pid`` (from /proc: the parent of each process)."""
    from tests.test_fault_tolerance import _alive

    children: dict = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
        except (OSError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if _alive(p)]


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wait_for_the_first_save(ckpt, running, stderr) -> None:
    """Until the run's first checkpoint is complete (its save started the checkpoint writer's helpers)."""
    deadline = time.monotonic() + HANG_SECONDS
    while not (ckpt / "latest_checkpointed_iteration.txt").exists():
        assert running() and time.monotonic() < deadline, stderr.read_text()[-3000:]
        time.sleep(0.05)


def _survivors(processes: list, seconds: float = 5.0) -> list:
    """(pid, command line) of ``processes`` still alive ``seconds`` after the launcher's death."""
    from tests.test_fault_tolerance import _alive

    deadline = time.monotonic() + seconds
    while any(map(_alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [(p, _command_line(p)) for p in processes if _alive(p)]


def test_sigkill_of_torchrun_leaves_no_process_behind(tmp_path, cache_dir):
    """torchrun's ranks and their helpers die with its agent (each worker is in a session of its own, so
    nothing else would stop them). Before: both ranks and the checkpoint writer's Manager lived on."""
    from tests.test_fault_tolerance import _alive
    from tests.test_training_pretrain import SCRIPT

    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    with open(tmp_path / "stderr", "w") as stderr:
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT] + TINY +
            ["--context-parallel-size", "2", "--train-iters", "200", "--data-cache-path", cache_dir,
             "--save", str(ckpt), "--save-interval", "1"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    processes: list = []
    try:
        _wait_for_the_first_save(ckpt, lambda: agent.poll() is None, tmp_path / "stderr")
        processes = _descendants(agent.pid)
        assert sum(SCRIPT in _command_line(p) for p in processes) >= 2, [_command_line(p) for p in processes]
        agent.kill()
        agent.wait()
        survivors = _survivors(processes)
    finally:
        agent.kill()
        for pid in processes:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert survivors == [], survivors


def test_sigkill_of_the_launcher_leaves_no_process_behind(tmp_path, cache_dir):
    """Ranks, the checkpoint writer's spawned Manager and Python's resource tracker all die with the launcher.
    Before: the Manager and the resource tracker were alive 60 s later."""
    from tests.cli_runs import _script_main, forkserver_context
    from tests.test_training_pretrain import ROOT, SCRIPT

    ckpt = tmp_path / "ckpt"
    argv = ["--nproc", "2"] + TINY + ["--context-parallel-size", "2", "--train-iters", "200", "--data-cache-path",
                                      cache_dir, "--save", str(ckpt), "--save-interval", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    launcher = forkserver_context().Process(target=_script_main, name="hsap-test-cli", args=(
        SCRIPT, argv, env, ROOT, str(tmp_path / "stdout"), str(tmp_path / "stderr")))
    launcher.start()
    try:
        _wait_for_the_first_save(ckpt, launcher.is_alive, tmp_path / "stderr")
        processes = _descendants(launcher.pid)
        helpers = [p for p in processes if "spawn_main" in _command_line(p) or "resource_tracker" in
                   _command_line(p)]
        assert helpers, [_command_line(p) for p in processes]  # the Manager (and the tracker) exist
        os.kill(launcher.pid, signal.SIGKILL)
        survivors = _survivors(processes)
    finally:
        launcher.kill()
        launcher.join()
        for pid in _descendants(launcher.pid):
            os.kill(pid, signal.SIGKILL)
    assert survivors == [], survivors


# ---------------------------------------------------------------- the plan cache is bounded in bytes

def test_plan_cache_is_bounded_in_bytes():
    """Before: 64 entries whatever their size (a zigzag plan of 10^5 short documents is tens of MB)."""
    import numpy as np

    from megatron_hsap.sequence.plan_cache import PlanCache

    cache = PlanCache(max_bytes=1000)
    for key in "abc":
        cache.put(key, np.zeros(50, np.int64))  # 400 bytes each
    assert list(cache._entries) == ["b", "c"] and cache.bytes == 800
    assert cache.get("b") is not None  # now the most recently used: "c" goes next
    cache.put("d", np.zeros(50, np.int64))
    assert list(cache._entries) == ["b", "d"]
    cache.put("huge", np.zeros(200, np.int64))  # 1600 bytes: larger than the budget, not kept
    assert "huge" not in cache and cache.bytes == 800
    cache.put("b", np.zeros(100, np.int64))  # replaced by 800 bytes: its old 400 freed, "d" evicted
    assert cache.bytes == 800 and list(cache._entries) == ["b"]


PLAN_CACHE_LINE = re.compile(r"^plan cache of rank 0's training process: (\d+) of (\d+) lookups found a plan \| holds "
                             r"(\d+) plans, ([\d.]+) KiB of ([\d.]+) MiB \(--plan-cache-mb\) \| (\d+) evicted$", re.M)


@pytest.mark.parametrize("budget_mb", ["0", "256"])
def test_plan_cache_budget_reaches_the_training_loop(cache_dir, budget_mb):
    """--plan-cache-mb is what the training process's cache holds to: with no budget every plan is made again
    (no lookup finds one, nothing is held); with room the model's attention finds the plan the data made."""
    result = _run(TINY + ["--context-parallel-size", "2", "--context-parallel-mode", "hsap", "--ranks-per-node", "1",
                          "--train-iters", "2", "--data-cache-path", cache_dir, "--plan-cache-mb", budget_mb], 2)
    assert result.returncode == 0, result.stderr[-3000:]
    found = PLAN_CACHE_LINE.findall(result.stdout)
    assert len(found) == 1, result.stdout[-3000:]
    hits, lookups, held, held_kib, budget, evicted = found[0]
    assert float(budget) == float(budget_mb) and int(lookups) > 0 and int(evicted) == 0
    if budget_mb == "0":
        assert (int(hits), int(held), float(held_kib)) == (0, 0, 0.0)
    else:
        assert 0 < int(hits) < int(lookups) and int(held) > 0 and 0 < float(held_kib) <= 1024 * float(budget)


def test_training_plan_cache_holds_at_most_its_budget():
    from megatron_hsap.parallel_state import CPTopology
    from megatron_hsap.sequence.doc_lengths import cu_seqlens_from_lengths
    from megatron_hsap.sequence.plan import PLAN_CACHE, PLAN_CACHE_BYTES, plan_batch
    from megatron_hsap.training.arguments import parse_args

    assert parse_args(["--nproc", "1", "--plan-cache-mb", "0.5"]).plan_cache_mb == 0.5
    assert parse_args(["--nproc", "1"]).plan_cache_mb * (1 << 20) == PLAN_CACHE_BYTES
    topology = CPTopology.offline(8, 2, 4)
    budget = 6 << 20
    PLAN_CACHE.clear()
    PLAN_CACHE.set_max_bytes(budget)
    try:
        for extra in range(6):  # six batches of 5000 short documents: about 2 MB of plan each
            plan_batch(cu_seqlens_from_lengths([16] * 5000 + [16 + extra]), topology, "zigzag")
            assert 0 < PLAN_CACHE.bytes <= budget
        assert 1 <= len(PLAN_CACHE) < 6 and PLAN_CACHE.evictions == 6 - len(PLAN_CACHE)
    finally:
        PLAN_CACHE.set_max_bytes(PLAN_CACHE_BYTES)
        PLAN_CACHE.clear()
