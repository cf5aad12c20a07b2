"""The Megatron-LM entry point (megatron_hsap/training/megatron_lm.py), every piece that runs without Megatron-LM.

Megatron-LM (``megatron.training``) is not on the package index, so only the call into its
``pretrain()`` is skipped. Otherwise the pieces run as Megatron-LM would call them: Megatron-Core's
own ``initialize_model_parallel`` (what ``initialize_megatron`` calls, no HSAP sub-groups), then
``model_provider`` (which attaches the HSAP topology), then Megatron-Core's forward-only schedule
with ``forward_step``. The CP=2 loss (ulysses and ring, sub-groups created by the attach) must equal
the training loop's CP=1 loss on the same packed micro-batches within fp32 round-off (ulysses with
Megatron's hierarchical CP groups reused, ring with the HSAP sub-groups created by the attach).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from functools import partial
from typing import List

import pytest
import torch

from megatron_hsap.training.megatron_lm import HSAP_FLAGS, add_hsap_args, main
from megatron_hsap.training.arguments import build_parser, parse_args
from tests.distributed import run_distributed_fresh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 128
SEQ = 64
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", "2", "--layout-independent-init", "--vocab-size", str(VOCAB),
         "--tokenizer-type", "NullTokenizer", "--mock-data", "--lr-warmup-iters", "1"]
#: Megatron-LM flags next to which the HSAP ones must parse (its CP flags and attention-backend flags).
MEGATRON_LM_NEIGHBOURS = ("--context-parallel-size", "--cp-comm-type", "--hierarchical-context-parallel-sizes",
                          "--attention-backend", "--use-flash-attn", "--transformer-impl", "--seq-length")


def _batches() -> List[dict]:
    """Two packed micro-batches [2, SEQ] with EOD (0) inside samples: several documents per sample."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(2):
        tokens = torch.randint(1, VOCAB, (2, SEQ), generator=gen)
        tokens[0, 20] = tokens[1, 45] = tokens[1, 9] = 0
        out.append({"tokens": tokens, "labels": tokens.roll(-1, dims=1), "loss_mask": torch.ones(2, SEQ),
                    "position_ids": torch.arange(SEQ).repeat(2, 1)})
    return out


def _args(cp: int, mode: str) -> argparse.Namespace:
    """A namespace with the fields Megatron-LM's would have (ours plus the ones its own parser adds)."""
    args = parse_args(FLAGS + ["--context-parallel-size", str(cp), "--context-parallel-mode", mode,
                               "--ranks-per-node", "2"], world_size=cp)
    args.padded_vocab_size = VOCAB
    args.calculate_per_token_loss = False
    return args


def test_add_hsap_args_on_a_fresh_parser():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag in MEGATRON_LM_NEIGHBOURS:
        parser.add_argument(flag)
    assert add_hsap_args(parser) is parser
    args = parser.parse_args(["--context-parallel-size", "8", "--context-parallel-mode", "hsap", "--ulysses-size",
                              "4", "--head-chunk-size", "2", "--cp-layout", "zigzag", "--ranks-per-node", "4"])
    assert (args.context_parallel_mode, args.ulysses_size, args.head_chunk_size, args.cp_layout,
            args.ranks_per_node) == ("hsap", 4, 2, "zigzag", 4)
    defaults = build_parser().parse_args([])
    fresh = add_hsap_args(argparse.ArgumentParser()).parse_args([])
    for flag in HSAP_FLAGS:
        dest = flag[2:].replace("-", "_")
        assert getattr(fresh, dest) == getattr(defaults, dest), flag
    with pytest.raises(SystemExit):  # the same choices as pretrain_gpt_hsap.py
        add_hsap_args(argparse.ArgumentParser()).parse_args(["--context-parallel-mode", "nope"])


def test_model_provider_rejects_per_token_loss():
    from megatron_hsap.training.megatron_lm import model_provider

    args = _args(1, "hsap")
    args.calculate_per_token_loss = True
    with pytest.raises(ValueError, match="--calculate-per-token-loss is not supported"):
        model_provider(args=args, config=object())


def _loss_body(cp: int, mode: str, megatron_lm_path: bool) -> List[float]:
    from megatron.core import parallel_state as mpu
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_hsap.megatron.attention import HSAPSelfAttention
    from megatron_hsap.megatron.cpu_shim import apply_cpu_shim
    from megatron_hsap.training.megatron_lm import forward_step, model_provider
    from megatron_hsap.parallel_state import get_cp_topology, initialize_model_parallel
    from megatron_hsap.training.arguments import cp_config_from_args
    from megatron_hsap.training.loop import _eval_forward_step, _packed_iterator
    from megatron_hsap.training.model import build_gpt_chunk, layout_independent_init, transformer_config

    apply_cpu_shim()
    args = _args(cp, mode)
    config = transformer_config(args)
    if megatron_lm_path:  # as Megatron-LM: its own groups, then the provider attaches HSAP's
        # with ulysses, as Megatron-LM's --hierarchical-context-parallel-sizes 2 1 (reused by the attach);
        # with ring, no hierarchical groups (the attach creates the sub-groups)
        hierarchical = [cp, 1] if mode == "ulysses" else None
        mpu.initialize_model_parallel(context_parallel_size=cp, hierarchical_context_parallel_sizes=hierarchical)
        model_parallel_cuda_manual_seed(args.seed)
        model = model_provider(pre_process=True, post_process=True, args=args, config=config)
        topology = get_cp_topology()
        assert topology.cp_size == cp and topology.ulysses_size == (cp if mode == "ulysses" else 1)
        if hierarchical is not None:
            assert topology.ulysses_group is mpu.get_hierarchical_context_parallel_groups()[0]
        step = partial(forward_step, eod=0, split_at_eod=True, offload_activations=False)
        data = iter(_batches())
    else:  # the training loop's own path
        topology = initialize_model_parallel(context_parallel_size=cp, cp_config=cp_config_from_args(args))
        model_parallel_cuda_manual_seed(args.seed)
        model = build_gpt_chunk(args, config, cp_config_from_args(args), VOCAB, True, True, None)
        step = partial(_eval_forward_step, mpu.get_context_parallel_group())
        data = _packed_iterator(iter(_batches()), 0, True, topology, cp_config_from_args(args).resolved_layout,
                                torch.device("cpu"))
    assert any(isinstance(m, HSAPSelfAttention) for m in model.modules())
    layout_independent_init(model, args.seed, args.init_method_std, args.num_layers)
    with torch.no_grad():
        losses = get_forward_backward_func()(forward_step_func=step, data_iterator=data, model=[model],
                                             num_microbatches=2, seq_length=2 * SEQ, micro_batch_size=1,
                                             forward_only=True)
    if megatron_lm_path:  # Megatron-LM's (sum, count) of this CP rank per micro-batch
        return [x["lm loss"].tolist() for x in losses]
    return [float(x["lm loss"]) for x in losses]


def test_forward_step_under_cp_matches_the_loop_at_cp1():
    (expected,) = run_distributed_fresh(_loss_body, 1, 1, "hsap", False, timeout=180)
    assert len(expected) == 2 and all(4.0 < x < 6.0 for x in expected)  # ~ln(128) for a fresh model
    for mode in ("ulysses", "ring"):
        got = run_distributed_fresh(_loss_body, 2, 2, mode, True, timeout=180)
        # Megatron-LM sums the CP ranks' (loss sum, token count) pairs: every rank holds a part of each
        assert all(0 < count < 2 * SEQ for rank in got for _, count in rank), got
        merged = [sum(rank[i][0] for rank in got) / sum(rank[i][1] for rank in got) for i in range(2)]
        assert [sum(rank[i][1] for rank in got) for i in range(2)] == [2 * SEQ, 2 * SEQ]
        assert merged == pytest.approx(expected, rel=1e-5, abs=0.0), (mode, merged, expected)


def test_main_without_megatron_lm_says_what_is_missing():
    try:
        import megatron.training  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="put a Megatron-LM checkout on PYTHONPATH"):
            main(["--help"])
    else:
        pytest.skip("Megatron-LM is importable here; the real-pretrain() tests run it instead")


#: A tiny GPT for Megatron-LM's pretrain(): fixed seed, no dropout, 3 iterations of 2 samples (Megatron-LM's
#: MockGPTDataset: the same samples whatever the parallel layout); documents split at EOD inside samples.
PRETRAIN_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
                  "--max-position-embeddings", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
                  "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", "128", "--eval-iters", "1", "--eval-interval", "3", "--log-interval", "1",
                  "--seed", "1234", "--hidden-dropout", "0", "--attention-dropout", "0", "--reset-attention-mask",
                  "--reset-position-ids", "--transformer-impl", "local", "--disable-bias-linear",
                  "--position-embedding-type", "rope"]


def _start_pretrain(tmp_path, nproc: int, *flags: str) -> subprocess.Popen:
    """Start ``python -m megatron_hsap.training.megatron_lm`` (Megatron-LM's real pretrain()) under torchrun."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
         "megatron_hsap.training.megatron_lm", *PRETRAIN_FLAGS, "--data-cache-path", str(tmp_path / "cache"), *flags],
        cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish_pretrain(run: subprocess.Popen) -> dict:
    """The logged lm loss and grad norm of every iteration and the validation loss of a started run, parsed from
    Megatron-LM's log lines (a run that does not end within 400 s fails: a hang is a bug)."""
    import re

    try:
        out, err = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        run.kill()
        raise
    assert run.returncode == 0, out[-3000:] + err[-5000:]
    iterations = re.findall(r"iteration\s+(\d+)/\s*3 \|.*?lm loss: ([0-9.E+-]+) \|.*?grad norm: ([0-9.]+) \|", out)
    assert [int(i) for i, _, _ in iterations] == [1, 2, 3], out[-3000:]
    (valid,) = re.findall(r"validation loss at iteration 3 \| lm loss value: ([0-9.E+-]+)", out)
    return {"loss": [float(x) for _, x, _ in iterations], "grad_norm": [float(g) for _, _, g in iterations],
            "valid": float(valid), "stdout": out}


def _megatron_training_or_skip() -> None:
    pytest.importorskip("megatron.training", reason="Megatron-LM's megatron.training is not importable: it ships "
                                                    "in the megatron-core wheel from 0.17 (make test-latest); for "
                                                    "0.16 put a Megatron-LM checkout (core_v0.16.1) on PYTHONPATH")


#: The runs the tests below compare: name -> (processes, flags). All start at once (mostly imports: together they
#: take about the time of the slowest on 2 cores).
PRETRAIN_RUNS = {"cp1": (1, []), "cp2-hsap": (2, ["--context-parallel-size", "2", "--context-parallel-mode", "hsap"]),
                 "dp2": (2, [])}


@pytest.fixture(scope="module")
def pretrain_runs(tmp_path_factory) -> dict:
    _megatron_training_or_skip()
    started = {name: _start_pretrain(tmp_path_factory.mktemp(name), nproc, *flags)
               for name, (nproc, flags) in PRETRAIN_RUNS.items()}
    try:
        return {name: _finish_pretrain(run) for name, run in started.items()}
    finally:
        for run in started.values():
            if run.poll() is None:
                run.kill()


def test_pretrain_cp2_hsap_matches_cp1(pretrain_runs):
    """HSAP inside Megatron-LM's real pretrain() (2 gloo ranks, CP 2, hsap): the same logged losses, grad norms
    and validation loss as CP 1, iteration by iteration."""
    cp1, got = pretrain_runs["cp1"], pretrain_runs["cp2-hsap"]
    assert 3.0 < cp1["loss"][0] < 6.0  # ~ln(128) for a fresh model
    assert got["loss"] == pytest.approx(cp1["loss"], rel=1e-5, abs=0.0)
    assert got["grad_norm"] == pytest.approx(cp1["grad_norm"], abs=2e-3)  # logged with 3 decimals
    assert got["valid"] == pytest.approx(cp1["valid"], rel=1e-5, abs=0.0)


def test_pretrain_dp2_logs_the_global_mean_loss(pretrain_runs):
    """With 2 data-parallel ranks the logged loss is the mean over both ranks' micro-batches (Megatron-LM reduces
    the (sum, count) pairs), i.e. CP 1's with both micro-batches on one rank, not rank 0's own."""
    cp1, got = pretrain_runs["cp1"], pretrain_runs["dp2"]
    assert got["loss"] == pytest.approx(cp1["loss"], rel=1e-5, abs=0.0)
    assert got["grad_norm"] == pytest.approx(cp1["grad_norm"], abs=2e-3)


def test_megatron_lm_defaults_are_resolved(capsys):
    """Megatron-LM's own defaults work: no HSAP mode/kernel given -> hsap/auto; its --attention-dropout 0.1 -> 0
    and its default --transformer-impl transformer_engine -> local where TE cannot run, each with a note naming
    the flag."""
    from megatron_hsap.training.megatron_lm import _resolve_hsap_defaults

    args = argparse.Namespace(context_parallel_mode=None, attention_kernel=None, attention_dropout=0.1,
                              transformer_impl="transformer_engine")
    _resolve_hsap_defaults(args)
    assert (args.context_parallel_mode, args.attention_kernel, args.attention_dropout) == ("hsap", "auto", 0.0)
    notes = capsys.readouterr().out
    assert "--attention-dropout 0.1 set to 0" in notes
    if not torch.cuda.is_available():
        assert args.transformer_impl == "local" and "--transformer-impl transformer_engine" in notes
    assert args.apply_rope_fusion is False  # Megatron-LM's default needs TE; HSAP never uses it
    chosen = argparse.Namespace(context_parallel_mode="ring", attention_kernel="torch", attention_dropout=0.0,
                                transformer_impl="local", apply_rope_fusion=False)
    _resolve_hsap_defaults(chosen)
    assert vars(chosen) == dict(context_parallel_mode="ring", attention_kernel="torch", attention_dropout=0.0,
                                transformer_impl="local", apply_rope_fusion=False)
    assert capsys.readouterr().out == ""
