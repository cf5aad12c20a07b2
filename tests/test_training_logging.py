"""Megatron-LM's log lines and scalar names (iteration_log), device placement of packed micro-batches, GPU fusions.

The scalar names are checked through a fake writer (always run); a real TensorBoard event file is
written only where the optional ``tensorboard`` package is installed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import List, Tuple

import pytest
import torch

from megatron_hsap.parallel_state import CPTopology
from megatron_hsap.training.iteration_log import (
    IterationLogger,
    IterationRecord,
    make_writers,
    num_floating_point_operations,
)
from megatron_hsap.training.model import fusion_settings
from megatron_hsap.training.packing import pack_micro_batch


class FakeWriter:
    """Records ``add_scalar`` calls as a TensorBoard SummaryWriter would receive them."""

    def __init__(self) -> None:
        self.scalars: List[Tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, float(value), step))

    def close(self) -> None:
        self.closed = True


def _record(iteration: int, loss: float, elapsed_ms: float, skipped: bool = False) -> IterationRecord:
    return IterationRecord(iteration=iteration, loss=loss, lr=1e-3 * iteration, grad_norm=0.5, tokens_per_s=1000.0,
                           elapsed_ms=elapsed_ms, peak_memory_bytes=2**20, cp_bytes_intra=10, cp_bytes_inter=20,
                           cp_bytes_by_op={"ring_kv": 30}, consumed_samples=4 * iteration, global_batch_size=4,
                           loss_scale=1.0, skipped=skipped, tflops_per_gpu=2.0)


def test_iteration_line_averages_the_interval_like_megatron_lm(capsys, tmp_path):
    writer = FakeWriter()
    log = IterationLogger(4, rank=0, json_path=str(tmp_path / "log.jsonl"), writers=[writer], progress_bar=False,
                          log_interval=2)
    log.record(_record(1, 4.0, 100.0))
    assert capsys.readouterr().out == ""  # not a log iteration
    log.record(_record(2, float("nan"), 300.0, skipped=True))
    line = capsys.readouterr().out
    for field in ("iteration        2/       4 |", "consumed samples:            8 |",
                  "elapsed time per iteration (ms): 200.0 |", "throughput per GPU (TFLOP/s/GPU): 3.0 |",
                  "learning rate: 2.000000E-03 |", "global batch size:     4 |", "lm loss: 4.000000E+00 |",
                  "loss scale: 1.0 |", "grad norm: 0.500 |", "number of skipped iterations:   1 |",
                  "number of nan iterations:   1 |", "CP bytes sent/rank intra: 10 inter: 20 |"):
        assert field in line, (field, line)
    log.record(_record(3, 3.0, 100.0))
    log.record(_record(4, 2.0, 100.0))
    line = capsys.readouterr().out
    assert "lm loss: 2.500000E+00 |" in line and "number of skipped iterations:   0 |" in line
    log.close()
    assert writer.closed
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [2, 4] and records[1]["loss"] == 2.0


def test_scalars_use_megatron_lm_names():
    writer = FakeWriter()
    log = IterationLogger(10, rank=0, writers=[writer], progress_bar=False, log_interval=10)
    log.record(_record(3, 2.5, 100.0))
    log.evaluation("validation", "iteration 3", 2.0, iteration=3, consumed_samples=12)
    log.evaluation("test", "iteration 3 on test set", 1.5, iteration=3, consumed_samples=12)
    got = {(tag, step): value for tag, value, step in writer.scalars}
    assert got[("lm loss", 3)] == 2.5 and got[("lm loss vs samples", 12)] == 2.5
    assert got[("learning-rate", 3)] == pytest.approx(3e-3) and got[("grad-norm", 3)] == 0.5
    assert got[("batch-size", 3)] == 4 and got[("loss-scale", 3)] == 1.0 and got[("throughput", 3)] == 2.0
    assert got[("iteration-time", 3)] == pytest.approx(0.1)
    assert got[("lm loss validation", 3)] == 2.0 and got[("lm loss validation vs samples", 12)] == 2.0
    assert got[("lm loss validation ppl", 3)] == pytest.approx(math.exp(2.0))
    assert got[("lm loss test", 3)] == 1.5 and got[("lm loss test ppl", 3)] == pytest.approx(math.exp(1.5))
    assert got[("hsap/cp-bytes-inter", 3)] == 20


def test_evaluation_block_is_megatron_lms(capsys):
    IterationLogger(10, rank=0, progress_bar=False).evaluation("validation", "iteration 5", 2.0, 5, 20)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == " validation loss at iteration 5 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert lines[0] == lines[2] == "-" * (len(lines[1]) + 1)


def test_evaluations_at_one_iteration_read_apart(capsys):
    log = IterationLogger(10, rank=0, progress_bar=False)
    log.evaluation("validation", "iteration 4", 2.0, 4, 16, detail="periodic evaluation of validation batches 0-1")
    log.evaluation("validation", "iteration 4 on validation set", 2.5, 4, 16,
                   detail="final evaluation of validation batches 2-3")
    blocks = [line for line in capsys.readouterr().out.splitlines() if "validation loss" in line]
    assert blocks[0].startswith(" validation loss at iteration 4 | lm loss value: 2.000000E+00 | ")
    assert blocks[0].endswith("| periodic evaluation of validation batches 0-1 | ")
    assert blocks[1].endswith("| final evaluation of validation batches 2-3 | ") and blocks[0] != blocks[1]


def test_other_ranks_print_and_write_nothing(capsys):
    writer = FakeWriter()
    log = IterationLogger(1, rank=1, writers=[writer])
    log.record(_record(1, 1.0, 1.0))
    log.evaluation("validation", "iteration 1", 1.0, 1, 4)
    assert capsys.readouterr().out == "" and writer.scalars == []


def test_missing_tensorboard_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="pip install tensorboard"):
        make_writers("/tmp/unused-tb-dir")
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        make_writers(None, wandb_project="p")
    assert make_writers(None) == []


def test_tensorboard_event_file(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is an optional extra (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (writer,) = make_writers(str(tmp_path))
    log = IterationLogger(1, rank=0, writers=[writer], progress_bar=False)
    log.record(_record(1, 2.5, 10.0))
    log.evaluation("validation", "iteration 1", 2.0, 1, 4)
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size", "lm loss validation",
            "lm loss validation ppl"} <= tags
    assert events.Scalars("lm loss")[0].value == 2.5


_FlopsArgs = dataclasses.make_dataclass("_FlopsArgs", ["hidden_size", "num_attention_heads", "num_query_groups",
                                                       "kv_channels", "ffn_hidden_size", "swiglu", "seq_length",
                                                       "num_layers"])
# Worked out by hand, per token: 6 x (qkv + out projection + core attention + MLP) x layers + 6 x logits.
# (a) h=8, 2 heads of 4 channels, 1 KV group, SwiGLU ffn 16, s=32, 2 layers, vocab 64, 3 samples (96 tokens):
#     qkv 6*8*(8+4+4)=768, out 6*8*8=384, MLP 6*8*16*3=2304, core 6*8*32*2=3072 (full) or 1536 (half),
#     logits 6*8*64=3072 -> per token 2*(3456+3072)+3072=16128 (full), 2*(3456+1536)+3072=13056 (half).
# (b) h=16, 4 heads of 4 channels, MHA, GELU ffn 64, s=8, 3 layers, vocab 32, 1 sample (8 tokens):
#     qkv 6*16*48=4608, out 6*16*16=1536, MLP 6*16*64*2=12288, core 6*16*8*2=1536 (full) or 768 (half),
#     logits 6*16*32=3072 -> per token 3*19968+3072=62976 (full), 3*19200+3072=60672 (half).
_FLOPS_SHAPES = {"a": (_FlopsArgs(8, 2, 1, 4, 16, True, 32, 2), 3, 64, 96 * 16128, 96 * 13056),
                 "b": (_FlopsArgs(16, 4, 4, None, None, False, 8, 3), 1, 32, 8 * 62976, 8 * 60672)}


@pytest.mark.parametrize("shape", sorted(_FLOPS_SHAPES))
@pytest.mark.parametrize("release", ["0.11.0", "0.12.0", "0.16.1", "0.19.0"])
def test_flops_formula_matches_megatron_lm(shape, release):
    """Megatron-LM's num_floating_point_operations counts the full causal score matrix up to core_v0.11 and
    half of it from core_v0.12.0 on (megatron/training/training.py at those tags)."""
    args, batch, vocab, full, half = _FLOPS_SHAPES[shape]
    expected = full if release == "0.11.0" else half
    assert num_floating_point_operations(args, batch, vocab, megatron_core_version=release) == expected


def test_flops_formula_follows_the_installed_megatron_core():
    from importlib.metadata import version

    args, batch, vocab, full, half = _FLOPS_SHAPES["a"]
    installed = tuple(int(p) for p in version("megatron-core").split(".")[:2])
    assert num_floating_point_operations(args, batch, vocab) == (half if installed >= (0, 12) else full)


def test_packed_micro_batch_moves_to_the_model_device():
    """Every tensor the model and loss read (tokens, labels, mask, positions, cu_seqlens) lands on the target
    device; "meta" stands in for a GPU here (the copy path is the same apart from pinning)."""
    topology = dataclasses.replace(CPTopology.offline(2, 1, 2), cp_rank=1)
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3], [1, 2, 3, 0, 4, 5, 6, 7]])
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, 8)}
    mb = pack_micro_batch(batch, eod=0, split_at_eod=True, topology=topology, layout="zigzag")
    moved = mb.to(torch.device("meta"))
    params = moved.packed_seq_params
    for t in (moved.tokens, moved.labels, moved.loss_mask, moved.position_ids, params.cu_seqlens_q,
              params.cu_seqlens_kv):
        assert t.device.type == "meta"
    assert params.plan is mb.packed_seq_params.plan and moved.num_loss_tokens == 16
    assert (moved.tokens.shape, moved.loss_mask.dtype) == (mb.tokens.shape, mb.loss_mask.dtype)
    assert mb.to(torch.device("cpu")) is mb  # already there: no copy


def test_fusions_on_gpu_only():
    assert not any(fusion_settings(cuda=False).values())
    gpu = fusion_settings(cuda=True)
    assert gpu["bias_activation_fusion"] and gpu["bias_dropout_fusion"] and not gpu["apply_rope_fusion"]
    assert not fusion_settings(cuda=True, gelu_without_bias=True)["bias_activation_fusion"]


def _data_args(**overrides):
    from megatron_hsap.training.arguments import build_parser

    args = build_parser().parse_args(["--train-iters", "10", "--eval-interval", "4", "--eval-iters", "3"])
    args.global_batch_size = 8
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_split_sizes_are_megatron_lms():
    from megatron_hsap.training.data import split_sizes

    # train_iters x GBS; (train_iters // eval_interval + 1) evaluations of eval_iters x GBS; one test evaluation
    assert split_sizes(_data_args()) == [80, (10 // 4 + 1) * 3 * 8, 3 * 8]


def test_per_split_paths_give_each_split_its_blend(tmp_path):
    from megatron_hsap.training.data import dataset_config
    from megatron_hsap.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("ByteLevelTokenizer", None, None)
    args = _data_args(data_cache_path=str(tmp_path), valid_data_path=["0.3", "v1", "0.7", "v2"])
    config = dataset_config(args, tokenizer, ["t"])
    assert config.blend is None and config.split is None
    assert config.blend_per_split == [(["t"], None), (["v1", "v2"], [0.3, 0.7]), None]
    config = dataset_config(_data_args(data_cache_path=str(tmp_path)), tokenizer, ["t"])
    assert config.blend == (["t"], None) and config.split == "969,30,1" and config.blend_per_split is None


@pytest.mark.parametrize("flags, message", [
    (["--valid-data-path", "/nowhere/v"], "--valid-data-path needs --data-path"),
    (["--mock-data", "--test-data-path", "/nowhere/t"], "--test-data-path needs --data-path"),
])
def test_per_split_flags_are_checked(capsys, flags, message):
    from megatron_hsap.training.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--nproc", "1"] + flags, world_size=1)
    assert message in capsys.readouterr().err
