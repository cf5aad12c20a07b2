#!/usr/bin/env python
"""How many flags of Megatron-LM's own pretraining examples ``pretrain_gpt_hsap.py`` accepts.

    python tools/check_megatron_flags.py            # the installed / PYTHONPATH megatron_hsap
    python tools/check_megatron_flags.py --verbose  # also every rejected flag with its message

The flags (with their values) are copied from two scripts of NVIDIA/Megatron-LM at commit
157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9: ``examples/llama/train_llama3_8b_h100_fp8.sh``
(its default, mock-data variant) and ``examples/gpt3/train_gpt3_175b_distributed.sh``.
Paths are replaced by small files made here (a 3-document dataset, a GPT-2 vocab/merges
pair) so that only the flags are judged. Each script's flags are parsed and validated as
``pretrain_gpt_hsap.py`` does, at the script's world size; a flag named by an error is
counted as rejected, dropped, and the rest parsed again, until the flags parse.

Each flag is counted once as: accepted (used or mapped onto an HSAP flag), ignored
(accepted, changes nothing on this path, listed once at start-up) or rejected (an
unrecognized flag or value, or an error naming the flag).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import warnings
from typing import Dict, Iterator, List, Tuple

MEGATRON_LM_COMMIT = "157006d6d9bf4f55c0d4d7dacbd2b65e7bd84dc9"

#: examples/llama/train_llama3_8b_h100_fp8.sh (TOKENIZER_ARG/DATA_ARG = MOCK); world size 8 (1 node x 8 GPUs).
LLAMA3_8B = """
--use-mcore-models --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0
--hidden-dropout 0.0 --swiglu --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 --lr-decay-samples 1949218748
--lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
--grad-reduce-in-bf16 --cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --data-cache-path $DATA_CACHE_PATH
--tiktoken-pattern v2 --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
--save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --tensorboard-dir $TENSORBOARD_LOGS_PATH
"""

#: examples/gpt3/train_gpt3_175b_distributed.sh; world size 128 (TP 8 x PP 16).
GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
--lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH
--eval-iters 10 --tensorboard-dir $TENSORBOARD_LOGS_PATH
"""

SCRIPTS = {"examples/llama/train_llama3_8b_h100_fp8.sh": (LLAMA3_8B, 8),
           "examples/gpt3/train_gpt3_175b_distributed.sh": (GPT3_175B, 128)}


class _ParseError(Exception):
    pass


@contextlib.contextmanager
def _raising_parser() -> Iterator[None]:
    """argparse errors raise instead of printing and exiting, so every error can be attributed to a flag."""
    def error(self: argparse.ArgumentParser, message: str) -> None:
        raise _ParseError(message)

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


def _flags(argv: List[str]) -> List[str]:
    return [t for t in argv if t.startswith("--")]


def _without(argv: List[str], flag: str) -> List[str]:
    """argv minus ``flag`` and its values."""
    i = argv.index(flag)
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return argv[:i] + argv[j:]


def _named_flag(message: str, argv: List[str]) -> str:
    """The flag of argv that the error message names first."""
    found = [(m.start(), flag) for flag in _flags(argv)
             for m in [re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message)] if m]
    if not found:
        raise RuntimeError(f"an error names no flag of the script: {message}")
    return min(found)[1]


def classify(argv: List[str], world_size: int) -> Tuple[List[str], List[str], Dict[str, str]]:
    """(accepted, ignored, rejected flag -> message) for one script's flags."""
    from megatron_hsap.training.arguments import parse_args

    remaining, rejected = list(argv), {}
    while True:
        try:
            with _raising_parser(), contextlib.redirect_stderr(sys.stdout):
                args = parse_args(remaining, world_size=world_size)
            break
        except _ParseError as err:
            message = str(err)
            if message.startswith("unrecognized arguments:"):
                unknown = [f for f in _flags(message.split(":", 1)[1].split()) if f in remaining]
                message = "unrecognized argument"
            else:
                unknown = [_named_flag(message, remaining)]
            for flag in unknown:
                rejected[flag] = message
                remaining = _without(remaining, flag)
    ignored = [f for f in getattr(args, "ignored_flags", []) if f in remaining]
    accepted = [f for f in _flags(remaining) if f not in ignored]
    return accepted, ignored, rejected


def _placeholders(folder: str) -> Dict[str, str]:
    """Small real files for the scripts' path variables."""
    from megatron_hsap.training.corpus import write_indexed_dataset

    data = os.path.join(folder, "data_text_document")
    write_indexed_dataset(data, iter([[1, 2, 3], [4, 5], [6]]), 512)
    vocab, merges = os.path.join(folder, "gpt2-vocab.json"), os.path.join(folder, "gpt2-merges.txt")
    with open(vocab, "w") as f:
        json.dump({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}, f)
    with open(merges, "w") as f:
        f.write("#version: 0.2\na b\n")
    return {"$DATA_PATH": data, "$VOCAB_FILE": vocab, "$MERGE_FILE": merges,
            "$CHECKPOINT_PATH": os.path.join(folder, "checkpoints"),
            "$TENSORBOARD_LOGS_PATH": os.path.join(folder, "tensorboard"), "$DATA_CACHE_PATH": folder}


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--verbose", action="store_true", help="print every ignored and rejected flag")
    opts = p.parse_args(argv)
    warnings.filterwarnings("ignore")  # Megatron-Core's import-time notices are not about the flags
    with tempfile.TemporaryDirectory() as folder:
        paths = _placeholders(folder)
        for script, (text, world_size) in SCRIPTS.items():
            flags = [paths.get(t, t) for t in text.split()]
            accepted, ignored, rejected = classify(flags, world_size)
            total = len(_flags(flags))
            print(f"{script} (Megatron-LM {MEGATRON_LM_COMMIT[:8]}): {total} flags: {len(accepted)} accepted, "
                  f"{len(ignored)} ignored, {len(rejected)} rejected")
            if opts.verbose:
                print(f"  ignored: {' '.join(ignored) or '-'}")
                for flag, message in rejected.items():
                    print(f"  rejected {flag}: {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
