"""What a user sees before training starts: short errors that name the remedy, the resolved configuration,
Megatron-LM's arguments block, and the dry run that checks a GPU job's flags on any machine.

``.venv/bin/python -m pytest tests/test_startup.py -q`` (~30 s).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_hsap.training.arguments import parse_args
from megatron_hsap.training.startup import arguments_block, dry_run_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_FLAGS = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "32", "--num-query-groups", "8",
             "--seq-length", "65536", "--context-parallel-size", "16", "--context-parallel-mode", "hsap", "--bf16",
             "--recompute-granularity", "full"]


def test_demo_with_fewer_iterations_than_the_default_warm_up_runs() -> None:
    args = parse_args(["--demo", "--train-iters", "6"], world_size=8)
    assert args.train_iters == 6 and args.lr_warmup_iters == 0
    assert parse_args(["--demo"], world_size=8).lr_warmup_iters == 10  # the preset's 150 iterations keep 10


def test_a_world_size_mismatch_is_two_lines_naming_the_remedy(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--context-parallel-size", "8"], world_size=1)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 2, err
    assert "world size 1 is not divisible" in err and "--nproc 8 on CPU" in err and "torchrun" in err


def test_arguments_block_lists_every_argument_sorted() -> None:
    args = parse_args(["--demo"], world_size=8)
    lines = arguments_block(args).splitlines()
    assert lines[0].strip("-") == " arguments " and lines[-1].strip("-") == " end of arguments "
    names = [line.split()[0] for line in lines[1:-1]]
    assert names == sorted(vars(args)) and "context_parallel_mode" in names


def test_dry_run_resolves_the_topology_of_a_two_node_job() -> None:
    args = parse_args(["--dry-run", "16", "--ranks-per-node", "8"] + GPU_FLAGS)
    text = "\n".join(dry_run_lines(args))
    assert "dry run for 16 ranks, 8 per node" in text
    assert "world 16 = TP 1 x PP 1 x CP 16 x DP 1; 2 node(s)" in text
    assert "Ulysses 8 (inside a node) x ring 2" in text and "layout sequence-aware" in text
    assert "head chunks: 8 of 32 query heads per stage (4 stage(s), UPipe)" in text
    assert "fits 80 GiB of GPU memory" in text


def test_dry_run_says_when_the_job_does_not_fit() -> None:
    flags = [f if f != "65536" else str(1 << 25) for f in GPU_FLAGS]  # 32M tokens on 16 GPUs
    text = "\n".join(dry_run_lines(parse_args(["--dry-run", "16"] + flags)))
    assert "does NOT fit 80 GiB of GPU memory (+" in text


def test_dry_run_of_bad_flags_is_the_same_error_as_a_run(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--dry-run", "12"] + GPU_FLAGS)
    assert "world size 12 is not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("script, world", [("train_gpt_1node_8gpu.sh", 8), ("train_gpt_2node_slurm.sh", 16)])
def test_gpu_examples_pass_their_dry_run(script: str, world: int) -> None:
    env = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, PYTHONPATH=ROOT)
    env.pop("DATA", None)
    result = subprocess.run([os.path.join(ROOT, "examples", script)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"dry run for {world} ranks" in result.stdout and "predicted peak per GPU" in result.stdout


def test_every_flag_says_what_it_does() -> None:
    from megatron_hsap.training.arguments import build_parser

    silent = [a.option_strings[0] for a in build_parser()._actions if a.option_strings and not a.help]
    assert silent == []
