"""End-to-end tests of ``pretrain_gpt_hsap.py``: loss/grad-norm equivalence with CP=1, checkpoints, bad input.

Every run is the real command line (ranks forked by ``--nproc``, gloo), started from a
warm forkserver without the interpreter's ~6 s of imports (``tests/cli_runs.py``), on
the embedded packed corpus (stdlib sources, documents split at EOD), a tiny GPT
(2 layers, hidden 64, 8 heads, seq 256), 2 micro-batches per iteration and
``--layout-independent-init`` so every parallel layout starts from the same weights.

Tolerance: per-iteration loss and grad norm equal the single-rank CP=1 run within
``rtol=1e-5`` (fp32 round-off: the distributed runs sum partial attention
outputs and gradients in a different order; observed differences are ~1e-6
relative). A resumed run with the same layout must match bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from tests.cli_runs import run_fresh, run_warm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "pretrain_gpt_hsap.py")
RTOL = 1e-5
ITERS = 4


def _run(flags: List[str], nproc: int, timeout: float = 420, env: Optional[Dict[str, str]] = None,
         fresh: bool = False) -> subprocess.CompletedProcess:
    """One CLI run (``env``: extra environment variables); a run that does not finish within ``timeout`` fails
    the test (a hang is a bug). ``fresh``: in a new interpreter, else forked from the warm forkserver
    (``tests/cli_runs.py``: the same command line without ~6 s of imports; ``HSAP_TEST_FRESH_CLI=1`` makes
    every run fresh)."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    full_env.update(env or {})
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    run = run_fresh if fresh or os.environ.get("HSAP_TEST_FRESH_CLI") == "1" else run_warm
    return run(SCRIPT, ["--nproc", str(nproc)] + flags, full_env, ROOT, timeout)


def _run_logged(tmp_path, cache_dir: str, nproc: int, name: str, *flags: str) -> SimpleNamespace:
    """A successful run of the tiny GPT: its ``stdout`` and iteration ``records`` (its evaluation records:
    ``_evaluations(tmp_path, name)``). No evaluation unless ``flags`` ask for it (``--eval-iters``)."""
    log = str(tmp_path / f"{name}.jsonl")
    base = ["--train-iters", str(ITERS), "--lr-warmup-iters", "1", "--global-batch-size", "2",
            "--layout-independent-init", "--no-progress-bar", "--data-cache-path", cache_dir, "--log-json", log,
            "--eval-iters", "0"]
    result = _run(base + list(flags), nproc)
    assert result.returncode == 0, \
        f"run failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    with open(log) as f:
        return SimpleNamespace(stdout=result.stdout, records=[r for r in map(json.loads, f) if "evaluation" not in r])


def _train(tmp_path, cache_dir: str, nproc: int, *flags: str, name: str = "log") -> List[Dict[str, float]]:
    """The run's iteration records."""
    return _run_logged(tmp_path, cache_dir, nproc, name, *flags).records


def _evaluations(tmp_path, name: str = "log") -> List[Dict[str, float]]:
    with open(tmp_path / f"{name}.jsonl") as f:
        return [r for r in map(json.loads, f) if "evaluation" in r]


#: Validation after iterations 2 and 4, the final validation and the test split, one global batch each.
EVAL_FLAGS = ["--eval-interval", "2", "--eval-iters", "1"]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir) -> Tuple[List[Dict[str, float]], List[Dict[str, float]], str]:
    """The single-rank CP=1 run every other run is compared with: (iteration records, evaluation records, its
    checkpoint directory). It saves at iterations 2 and 4; the resume test restarts from iteration 2."""
    path = tmp_path_factory.mktemp("ref")
    ckpt = str(path / "ckpt")
    records = _train(path, cache_dir, 1, *EVAL_FLAGS, "--save", ckpt, "--save-interval", "2")
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    return records, _evaluations(path), ckpt


@pytest.fixture(scope="module")
def reference(reference_run) -> List[Dict[str, float]]:
    return reference_run[0]


def _assert_matches(records: List[Dict[str, float]], reference: List[Dict[str, float]], rtol: float = RTOL) -> None:
    ref = {r["iteration"]: r for r in reference}
    assert records, "the run logged no iteration"
    for r in records:
        expected = ref[r["iteration"]]
        for key in ("loss", "grad_norm"):
            assert r[key] == pytest.approx(expected[key], rel=rtol, abs=0.0), \
                f"iteration {r['iteration']} {key}: {r[key]!r} vs CP=1 {expected[key]!r}"


def test_reference_trains(reference):
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3


@pytest.mark.parametrize("nproc, flags", [
    pytest.param(2, ["--context-parallel-size", "2", "--context-parallel-mode", "ulysses",
                     "--cp-layout", "sequence-aware"], id="ulysses-seqaware-cp2"),
    pytest.param(4, ["--context-parallel-size", "4", "--context-parallel-mode", "hybrid", "--ranks-per-node", "2",
                     "--cp-layout", "zigzag"], id="hybrid-zigzag-cp4-2nodes"),
    pytest.param(4, ["--context-parallel-size", "4", "--context-parallel-mode", "ring", "--ranks-per-node", "2",
                     "--cp-layout", "zigzag", "--cp-kv-forwarding"], id="ring-zigzag-cp4-2nodes-kv-forwarding"),
    pytest.param(4, ["--context-parallel-size", "4", "--context-parallel-mode", "hsap", "--ranks-per-node", "2",
                     "--head-chunk-size", "2", "--recompute-granularity", "full",
                     "--offload-checkpointed-activations"], id="hsap-headchunks-seqaware-cp4-2nodes-offload"),
    pytest.param(8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--context-parallel-size", "2", "--sequence-parallel", "--context-parallel-mode", "hsap",
                     "--ranks-per-node", "2"] + EVAL_FLAGS, id="tp2-pp2-cp2-sp-hsap-8ranks-eval"),
])
def test_cp_matches_cp1(tmp_path, cache_dir, reference_run, nproc, flags):
    reference, reference_evaluations, _ = reference_run
    records = _train(tmp_path, cache_dir, nproc, *flags)
    assert len(records) == ITERS
    assert all(r["cp_bytes_intra"] + r["cp_bytes_inter"] > 0 for r in records), "CP moved no bytes"
    if "--head-chunk-size" in flags:  # the fused per-head-chunk (UPipe) path did the all-to-alls
        assert all(r["cp_bytes_by_op"].get("upipe_qkv", 0) > 0 for r in records), records[0]["cp_bytes_by_op"]
    if "--cp-kv-forwarding" in flags:  # rows from the other node were relayed inside the node
        assert all(r["cp_bytes_by_op"].get("ring_kv_relay", 0) > 0 for r in records), records[0]["cp_bytes_by_op"]
    if "--offload-checkpointed-activations" in flags:  # each layer's fp32 input [t_local, hidden] went to the host
        from megatron_hsap.training.arguments import build_parser

        defaults = build_parser().parse_args([])
        per_micro_batch = defaults.num_layers * defaults.seq_length // 4 * defaults.hidden_size * 4
        assert all(r["host_offload_bytes"] >= per_micro_batch for r in records), \
            [r["host_offload_bytes"] for r in records]
    _assert_matches(records, reference)
    if "--eval-iters" in flags:  # forward-only schedule (pipelined here): the same losses as CP=1, PP=1
        evaluations = _evaluations(tmp_path)
        assert [(e["evaluation"], e["iteration"]) for e in evaluations] == \
            [("validation", 2), ("validation", 4), ("validation", 4), ("test", 4)]
        for got, expected in zip(evaluations, reference_evaluations):
            assert got["lm_loss"] == pytest.approx(expected["lm_loss"], rel=RTOL, abs=0.0), (got, expected)


def test_interleaved_pipeline_matches_pp1(tmp_path, cache_dir):
    four_layers = ["--num-layers", "4"]
    ref = _train(tmp_path, cache_dir, 1, *four_layers, name="ref4")
    records = _train(tmp_path, cache_dir, 2, *four_layers, "--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1", name="vpp")
    assert [r["iteration"] for r in records] == [r["iteration"] for r in ref] == list(range(1, ITERS + 1))
    _assert_matches(records, ref)


def test_resume_is_exact_and_reshards_to_another_cp_mode_and_size(tmp_path, cache_dir, reference_run):
    """The reference run's checkpoint at iteration 2 (CP 1): resumed on the same layout every figure is bitwise
    equal to the uninterrupted run; resumed at CP 4 hsap over 2 emulated nodes the losses continue within fp
    tolerance. (Saving and --exit-interval on their own: test_distributed_optimizer_resumes_under_other_layouts.)"""
    reference, _, saved = reference_run
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(saved, "iter_0000002"), os.path.join(ckpt, "iter_0000002"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    resumed = _train(tmp_path, cache_dir, 1, "--load", ckpt, name="resumed")
    assert [r["iteration"] for r in resumed] == [3, 4]
    for r in resumed:
        expected = reference[r["iteration"] - 1]
        assert (r["loss"], r["grad_norm"], r["lr"]) == (expected["loss"], expected["grad_norm"], expected["lr"])
    resharded = _train(tmp_path, cache_dir, 4, "--context-parallel-size", "4", "--context-parallel-mode", "hsap",
                       "--ranks-per-node", "2", "--load", ckpt, name="hsap")
    assert [r["iteration"] for r in resharded] == [3, 4]
    _assert_matches(resharded, reference)


def test_bf16_checkpoint_saves_and_resumes_without_warnings(tmp_path, cache_dir) -> None:
    """bf16 with the distributed optimizer and RMSNorm on CPU: the norms are bf16 like every other parameter (fp32
    norms broke the bf16 optimizer's checkpoint: 'Optimizer shape (64,) does not match model shape (192,)'), the
    save and the resume succeed, and neither prints a warning under Python's default filters (Megatron-Core's
    own deprecations are dropped). Both runs are forked warm with the default filters restored
    (``tests/cli_runs.py``): what the forkserver imported (the launcher's imports) warned there, and
    test_training_demo.py checks those in a new interpreter (its stderr is empty under the default filters)."""
    ckpt = str(tmp_path / "ckpt")
    flags = ["--bf16", "--use-distributed-optimizer", "--normalization", "RMSNorm", "--context-parallel-size", "2",
             "--ranks-per-node", "1", "--save", ckpt, "--lr-warmup-iters", "1", "--global-batch-size", "2",
             "--data-cache-path", cache_dir, "--eval-iters", "0", "--no-progress-bar"]
    first = _run(flags + ["--train-iters", "2"], 2, env={"PYTHONWARNINGS": ""})
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _run(flags + ["--train-iters", "3", "--load", ckpt], 2, env={"PYTHONWARNINGS": ""})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded checkpoint from {ckpt} at iteration 2" in resumed.stdout
    assert "Warning" not in first.stderr + resumed.stderr, first.stderr + resumed.stderr


def test_a_longer_resumed_run_says_what_the_learning_rate_schedule_does(tmp_path, cache_dir, reference_run):
    """Resumed from iteration 2 with --train-iters 8, the checkpoint's schedule (decay over 4 iterations) continues,
    as in Megatron-LM: a start-up note says so and that the rate then stays at min-lr, which the log shows;
    --override-opt_param-scheduler decays over the flags' 8 iterations instead."""
    _, _, saved = reference_run
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(saved, "iter_0000002"), os.path.join(ckpt, "iter_0000002"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    kept = _run_logged(tmp_path, cache_dir, 1, "kept", "--load", ckpt, "--train-iters", "8")
    assert ("the checkpoint's learning-rate schedule continues (as Megatron-LM by default): lr_decay_steps 8 "
            "(the flags: 16)") in kept.stdout
    assert "reaches min-lr 0.0003 at sample 8 and stays there" in kept.stdout
    assert [r["lr"] for r in kept.records if r["iteration"] > 4] == [pytest.approx(3e-4)] * 4
    override = _run_logged(tmp_path, cache_dir, 1, "override", "--load", ckpt, "--train-iters", "8",
                           "--override-opt_param-scheduler")
    assert "--override-opt_param-scheduler: the flags' learning-rate schedule replaces" in override.stdout
    assert all(r["lr"] > 3e-4 * 1.01 for r in override.records if r["iteration"] < 8)


def test_distributed_optimizer_resumes_under_other_layouts(tmp_path, cache_dir, reference):
    """Megatron-LM's two distributed-optimizer formats, resharded: 'dp_reshardable' (the default) from
    CP 2 (ring) to CP 2 x DP 2 (hsap, full recompute); that run saves 'fully_reshardable', which resumes
    at TP 2. Every iteration matches the CP=1 reference. The first run's --load directory does not exist
    yet: its --save lock creates it empty (warn and start from scratch, as Megatron-LM)."""
    first, second = str(tmp_path / "dp_reshardable"), str(tmp_path / "fully_reshardable")
    dist_opt = ["--use-distributed-optimizer"]
    a = _run_logged(tmp_path, cache_dir, 2, "a", *dist_opt, "--context-parallel-size", "2",
                    "--context-parallel-mode", "ring", "--load", first, "--save", first, "--exit-interval", "2")
    assert f"WARNING: --load {first!r} is empty (no checkpoint saved yet); starting from scratch" in a.stdout
    b = _run_logged(tmp_path, cache_dir, 4, "b", *dist_opt, "--context-parallel-size", "2",
                    "--context-parallel-mode", "hsap", "--recompute-granularity", "full", "--load", first,
                    "--save", second, "--dist-ckpt-optim-fully-reshardable", "--exit-interval", "3")
    c = _run_logged(tmp_path, cache_dir, 2, "c", *dist_opt, "--tensor-model-parallel-size", "2", "--load", second)
    assert "note: TP x PP differs from the checkpoint's; its RNG state is ignored" in c.stdout
    assert [r["iteration"] for r in a.records + b.records + c.records] == [1, 2, 3, 4]
    _assert_matches(a.records + b.records + c.records, reference)


@pytest.mark.parametrize("nproc, flags, message", [
    (3, ["--context-parallel-size", "2"], "world size 3 is not divisible"),
    (2, ["--tensor-model-parallel-size", "2", "--num-attention-heads", "3", "--hidden-size", "48"],
     "--num-attention-heads (3) must be divisible by --tensor-model-parallel-size (2)"),
    (4, ["--context-parallel-size", "4", "--seq-length", "250"],
     "--seq-length (250) must be divisible by 2 x --context-parallel-size"),
    (1, ["--data-path", "/nonexistent/corpus_text_document"], "/nonexistent/corpus_text_document.bin"),
    (1, ["--bf16", "--fp32"], "not allowed with argument"),
    (1, ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_flags_fail_fast(nproc, flags, message):
    result = _run(flags, nproc, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


def test_head_chunk_not_fitting_the_ulysses_size_fails_on_every_rank(cache_dir):
    # --head-chunk-size 3 with 12 heads is fine for argparse; Ulysses degree 8 (mode hsap, CP 8) is only known
    # after start-up. (12 heads over 8 Ulysses ranks is fine: uneven splits, tests/test_uneven_heads.py.)
    result = _run(["--context-parallel-size", "8", "--context-parallel-mode", "hsap", "--num-attention-heads", "12",
                   "--head-chunk-size", "3", "--hidden-size", "96", "--seq-length", "256",
                   "--data-cache-path", cache_dir], 8, timeout=300)
    assert result.returncode == 2
    assert result.stderr.count("head_chunk_size=3 must be a multiple of ulysses_size=8") == 8


def test_unreadable_checkpoint_fails_on_every_rank(tmp_path, cache_dir):
    """A tracker naming a missing iteration: the command line fails on both ranks. A tracker that is not a number
    takes the same path from load_checkpoint's ValueError on (one error raised on every rank, see
    tests/test_fault_tolerance.py::_load_error), checked on 2 pooled gloo ranks."""
    from tests.distributed import run_distributed
    from tests.test_fault_tolerance import _load_error

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("7")
    result = _run(["--context-parallel-size", "2", "--load", str(ckpt), "--data-cache-path", cache_dir], 2,
                  timeout=300)
    assert result.returncode == 1
    assert result.stderr.count(f"--load {str(ckpt)!r}") == 2
    assert "names iteration 7, but" in result.stderr
    (ckpt / "latest_checkpointed_iteration.txt").write_text("not-a-number")
    errors = run_distributed(_load_error, 2, str(ckpt))
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"--load {str(ckpt)!r}: cannot read "), errors[0]


def _checkpoint_weights(checkpoint: "os.PathLike", scratch: "os.PathLike") -> Dict[str, "torch.Tensor"]:
    """The model weights of a torch_dist checkpoint directory (converted to one torch.save file at ``scratch``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(scratch))
    state = torch.load(scratch, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k.endswith(".weight")
            and not k.startswith("optimizer")}


def test_decoupled_lr_updates_only_embedding_and_output_at_their_own_rate(tmp_path, cache_dir, reference):
    """Megatron-LM's --decoupled-lr/--decoupled-min-lr (Megatron-Core's param groups): freezing the embedding and
    output layers changes the run while the other layers keep --lr's schedule. (With the same values as
    --lr/--min-lr the run reproduced the reference exactly, checked once by hand.)"""
    ckpt = tmp_path / "ckpt"
    frozen = _train(tmp_path, cache_dir, 1, "--decoupled-lr", "0", "--decoupled-min-lr", "0", "--save", str(ckpt),
                    "--save-interval", "2", name="frozen")
    after_two, after_four = (_checkpoint_weights(ckpt / f"iter_000000{i}", tmp_path / f"{i}.pt") for i in (2, 4))
    # the output layer shares the embedding's weight here (no --untie-embeddings-and-output-weights)
    frozen_names = {"embedding.word_embeddings.weight", "output_layer.weight"} & set(after_two)
    assert "embedding.word_embeddings.weight" in frozen_names and len(after_two) > 1, sorted(after_two)
    for name, weight in after_two.items():  # iterations 3 and 4 update every weight but the decoupled ones
        assert torch.equal(weight, after_four[name]) == (name in frozen_names), name
    # the first update is at warmup step 0 (learning rate 0), so the runs part from iteration 3 on
    assert [f["loss"] for f in frozen[:2]] == [r["loss"] for r in reference[:2]]
    assert all(f["loss"] != r["loss"] for f, r in zip(frozen[2:], reference[2:]))
    assert [f["lr"] for f in frozen] == [r["lr"] for r in reference]  # the other layers keep --lr's schedule
