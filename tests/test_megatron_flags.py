"""Megatron-LM's flag surface: its example scripts parse, its CP/attention flags map onto HSAP's, unsupported
result-changing flags are errors naming the flag, and its tokenizer types build through Megatron-Core.

Parsing only (no process groups, no ranks): every test here runs in well under a second after imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from megatron_hsap.training.arguments import parse_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["--nproc", "4", "--context-parallel-size", "4", "--seq-length", "64"]
ITERS = ["--train-iters", "10", "--lr-warmup-iters", "1"]


def _parse(*flags: str, iters: bool = True):
    """Parse BASE (+ ITERS unless ``iters`` is False) + flags at world size 4."""
    return parse_args(BASE + (ITERS if iters else []) + list(flags), world_size=4)


def _error(capsys, *flags: str, iters: bool = True) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parse(*flags, iters=iters)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def _tool():
    spec = importlib.util.spec_from_file_location("check_megatron_flags", os.path.join(ROOT, "tools",
                                                                                       "check_megatron_flags.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_megatron_lm_example_scripts_parse(tmp_path):
    """Every flag of the Llama-3 8B and GPT-3 175B scripts parses; only known unsupported ones are errors."""
    tool = _tool()
    paths = tool._placeholders(str(tmp_path))
    unsupported = {"--fp8-format", "--apply-layernorm-1p", "--fp16", "--rampup-batch-size"}
    if importlib.util.find_spec("transformers") is None:
        unsupported.add("--vocab-file")  # GPT-2 BPE, implied by --vocab-file/--merge-file
    results = {}
    for script, (text, world_size) in tool.SCRIPTS.items():
        flags = [paths.get(t, t) for t in text.split()]
        accepted, ignored, rejected = results[script] = tool.classify(flags, world_size)
        assert set(rejected) <= unsupported, rejected
        assert "unrecognized argument" not in rejected.values()
        assert len(accepted) + len(ignored) + len(rejected) == len(tool._flags(flags))
    accepted, ignored, _ = results["examples/llama/train_llama3_8b_h100_fp8.sh"]
    assert {"--overlap-grad-reduce", "--use-mcore-models"} <= set(ignored)
    assert {"--attention-backend", "--train-samples", "--calculate-per-token-loss", "--sequence-parallel",
            "--decoupled-lr", "--grad-reduce-in-bf16", "--num-workers"} <= set(accepted)


@pytest.mark.parametrize("flags, mode, ulysses", [
    (["--cp-comm-type", "p2p"], "ring", None),
    (["--cp-comm-type", "a2a"], "ulysses", None),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2"], "hybrid", 2),
    (["--cp-comm-type", "a2a", "a2a", "a2a", "a2a"], "ulysses", None),  # Megatron-LM's per-layer list
    ([], "hsap", None),
])
def test_cp_comm_type_maps_onto_context_parallel_mode(flags, mode, ulysses):
    args = _parse(*flags)
    assert (args.context_parallel_mode, args.ulysses_size) == (mode, ulysses)


@pytest.mark.parametrize("flags, message", [
    (["--cp-comm-type", "p2p", "--context-parallel-mode", "ulysses"],
     "--cp-comm-type p2p means --context-parallel-mode ring, which conflicts with --context-parallel-mode ulysses"),
    (["--cp-comm-type", "allgather"], "--cp-comm-type allgather is not supported; allowed: p2p, a2a, a2a+p2p"),
    (["--cp-comm-type", "p2p", "a2a"], "--cp-comm-type: one type for all layers is supported"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "--hierarchical-context-parallel-sizes needs --cp-comm-type a2a+p2p"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "4"],
     "--hierarchical-context-parallel-sizes 2 x 4 must equal --context-parallel-size (4)"),
])
def test_cp_comm_type_errors(capsys, flags, message):
    assert message in _error(capsys, *flags)


@pytest.mark.parametrize("flags, kernel", [
    (["--attention-backend", "fused"], "te"), (["--attention-backend", "flash"], "flash"),
    (["--attention-backend", "unfused"], "torch"), (["--attention-backend", "local"], "torch"),
    (["--attention-backend", "auto"], "auto"), (["--use-flash-attn"], "flash"),
    (["--use-flash-attn", "--attention-backend", "auto"], "flash"), ([], "auto"),
])
def test_attention_backend_maps_onto_attention_kernel(flags, kernel):
    assert _parse(*flags).attention_kernel == kernel


def test_conflicting_attention_kernels_are_an_error(capsys):
    err = _error(capsys, "--attention-kernel", "torch", "--use-flash-attn")
    assert "conflicting attention kernels: --attention-kernel (torch), --use-flash-attn (flash)" in err


@pytest.mark.parametrize("flags, message", [
    (["--fp16"], "--fp16 is not supported: fp16 training needs dynamic loss scaling"),
    (["--rampup-batch-size", "16", "16", "100"], "--rampup-batch-size is not supported"),
    (["--fp8-format", "hybrid"], "--fp8-format is not supported"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p is not supported"),
    (["--decoupled-min-lr", "1e-3"], "--decoupled-min-lr needs --decoupled-lr"),
    (["--grad-reduce-in-bf16"], "--grad-reduce-in-bf16 needs --bf16"),
    (["--ckpt-format", "torch"], "--ckpt-format torch is not supported"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 is not supported"),
    (["--hidden-size", "64", "--kv-channels", "16"], "--kv-channels (16) must equal --hidden-size / "
                                                     "--num-attention-heads (8)"),
    (["--mock-data", "--reset-position-ids"], "--reset-position-ids needs --reset-attention-mask"),
    (["--calculate-per-token-loss", "--global-batch-size", "2"],
     "--calculate-per-token-loss is not supported with EOD loss masking"),
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--recompute-activations", "--recompute-granularity", "full"], "--recompute-activations (selective) "
                                                                     "conflicts with --recompute-granularity full"),
    (["--offload-checkpointed-activations"], "--offload-checkpointed-activations needs --recompute-granularity "
                                             "full (got None)"),
    (["--offload-checkpointed-activations", "--recompute-activations"],
     "--offload-checkpointed-activations needs --recompute-granularity full (got selective)"),
])
def test_unsupported_result_changing_flags_are_errors_naming_the_flag(capsys, flags, message):
    assert message in _error(capsys, *flags)


def test_ignored_flags_are_listed_once_and_sequence_parallel_turns_off_at_tp1():
    args = _parse("--overlap-grad-reduce", "--sequence-parallel", "--manual-gc", "--profile",
                  "--profile-step-start", "4")
    assert args.sequence_parallel is False
    assert args.compat_notes == [
        "--sequence-parallel has no effect with --tensor-model-parallel-size 1: turned off (as Megatron-LM does)",
        "ignored on this path: --overlap-grad-reduce, --manual-gc, --profile, --profile-step-start"]
    assert _parse().compat_notes == []
    assert _parse("--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                  "--sequence-parallel").sequence_parallel is True


def test_accepted_megatron_flags():
    args = _parse("--group-query-attention", "--kv-channels", "8", "--recompute-activations", "--mock-data",
                  "--calculate-per-token-loss", "--global-batch-size", "2", "--reset-attention-mask",
                  "--reset-position-ids", "--no-load-rng", "--finetune", "--transformer-impl", "local",
                  "--log-throughput", "--wandb-exp-name", "x")
    assert args.num_query_groups == 1  # Megatron-LM's --num-query-groups default with --group-query-attention
    assert args.recompute_granularity == "selective"
    assert (args.no_load_rng, args.finetune, args.transformer_impl) == (True, True, "local")
    assert (args.eval_interval, args.eval_iters, args.ckpt_format) == (1000, 100, "torch_dist")  # Megatron-LM's


def test_sample_based_schedule_converts_like_megatron_lm():
    args = _parse("--global-batch-size", "8", "--train-samples", "1000", "--lr-warmup-samples", "100",
                  "--lr-decay-samples", "900", iters=False)
    assert (args.train_iters, args.lr_warmup_steps, args.lr_decay_steps, args.wd_incr_steps) == (125, 100, 900, 1000)
    args = _parse("--global-batch-size", "4", "--train-iters", "100", "--lr-decay-iters", "50",
                  "--lr-warmup-fraction", "0.1", iters=False)
    assert (args.lr_warmup_steps, args.lr_decay_steps, args.wd_incr_steps) == (20, 200, 400)
    args = _parse()  # iteration-based defaults: decay over --train-iters, BASE's one warmup iteration
    assert (args.lr_warmup_steps, args.lr_decay_steps) == (1, 10)


@pytest.mark.parametrize("flags, message", [
    (["--train-samples", "100"], "--train-iters and --train-samples are mutually exclusive"),
    (["--lr-warmup-samples", "10"], "--lr-warmup-samples is sample-based; it needs --train-samples"),
    (["--lr-warmup-fraction", "0.1"], "--lr-warmup-fraction and --lr-warmup-iters/--lr-warmup-samples are mutually "
                                      "exclusive"),
])
def test_schedule_flag_errors(capsys, flags, message):
    assert message in _error(capsys, *flags)


def test_iteration_flag_with_train_samples_is_an_error(capsys):
    err = _error(capsys, "--train-samples", "100", "--lr-decay-iters", "5", iters=False)
    assert "--lr-decay-iters is iteration-based; with --train-samples use the -samples flag" in err


# ---- tokenizers --------------------------------------------------------------------------------------------

#: A tiny GPT-2 byte-level BPE ("Ġ" is GPT-2's stand-in for a space).
GPT2_VOCAB = {"<|endoftext|>": 0, "h": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5, "w": 6, "r": 7, "d": 8, "he": 9, "ll": 10,
              "hell": 11, "hello": 12, "Ġw": 13}
GPT2_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]


def write_gpt2_files(folder) -> tuple:
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    with open(vocab, "w") as f:
        json.dump(GPT2_VOCAB, f)
    with open(merges, "w") as f:
        f.write("#version: 0.2\n" + "\n".join(GPT2_MERGES) + "\n")
    return vocab, merges


def test_gpt2_bpe_tokenizer_from_local_files(tmp_path):
    pytest.importorskip("transformers", reason="GPT2BPETokenizer goes through transformers (not installed)")
    from megatron_hsap.training.tokenizer import build_tokenizer

    vocab, merges = write_gpt2_files(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert tok.tokenize("hello world") == [12, 13, 4, 7, 3, 8]
    assert tok.detokenize([12, 13, 4, 7, 3, 8]) == "hello world"
    assert (tok.eod, tok.vocab_size) == (0, len(GPT2_VOCAB))


def test_vocab_and_merge_files_imply_gpt2_bpe(tmp_path, monkeypatch, capsys):
    vocab, merges = write_gpt2_files(tmp_path)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a))
    err = _error(capsys, "--mock-data", "--vocab-file", vocab, "--merge-file", merges)
    assert ("--vocab-file without --tokenizer-type: --tokenizer-type GPT2BPETokenizer needs the 'transformers' "
            "Python package, which is not installed (pip install transformers)") in err


@pytest.mark.parametrize("flags, message", [
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    (["--tokenizer-type", "SentencePieceTokenizer"], "--tokenizer-type SentencePieceTokenizer needs --tokenizer-model"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/nonexistent/tokenizer.model"],
     "--tokenizer-model '/nonexistent/tokenizer.model' does not exist"),
    (["--tokenizer-type", "NullTokenizer"], "--tokenizer-type NullTokenizer needs --vocab-size"),
])
def test_tokenizer_flag_errors(capsys, flags, message):
    assert message in _error(capsys, "--mock-data", *flags)


def test_missing_tokenizer_package_is_named(tmp_path, monkeypatch):
    from megatron_hsap.training import tokenizer

    model = tmp_path / "tokenizer.model"
    model.write_bytes(b"")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ValueError, match=re.escape("--tokenizer-type SentencePieceTokenizer needs the "
                                                   "'sentencepiece' Python package, which is not installed")):
        tokenizer.build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(model))


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece", reason="SentencePiece tokenizers need sentencepiece (not installed)")
    from megatron_hsap.training.tokenizer import build_tokenizer

    text = tmp_path / "text.txt"
    text.write_text("".join(f"the quick brown fox {i} jumps over the lazy dog\n" for i in range(50)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=40,
                                   minloglevel=2)
    tok = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    ids = tok.tokenize("the lazy dog")
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == "the lazy dog"


def test_hugging_face_tokenizer_from_a_local_directory(tmp_path):
    pytest.importorskip("transformers", reason="HuggingFaceTokenizer needs transformers (not installed)")
    from megatron_hsap.training.tokenizer import build_tokenizer

    write_gpt2_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                                "eos_token": "<|endoftext|>"}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert (tok.tokenize("hello world"), tok.eod) == ([12, 13, 4, 7, 3, 8], 0)
