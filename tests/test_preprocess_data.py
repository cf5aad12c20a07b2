"""tools/preprocess_data.py: JSONL and folders -> indexed datasets that read back exactly and train."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys

import pytest

from tests.test_training_pretrain import _run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")


def _preprocess(*flags: str) -> subprocess.CompletedProcess:
    """The tool's ``main(argv)`` in this process (its imports are paid once, not per call), with the
    exit status and output a command line would give."""
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # --workers pickles the tool's functions by module name
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = tool.main(list(flags))
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(["preprocess_data.py", *flags], code, out.getvalue(), err.getvalue())


def _read(prefix: str):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(prefix)
    return [data[i].tolist() for i in range(len(data))]


def test_jsonl_roundtrip_with_eod(tmp_path):
    texts = ["def f():\n    return 1\n", "héllo wörld", "x"]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"content": t}) + "\n" for t in texts) + "\n")
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--json-keys", "content",
                         "--append-eod")
    assert result.returncode == 0, result.stderr
    docs = _read(str(tmp_path / "out_content_document"))
    assert docs == [list(t.encode("utf-8")) + [0] for t in texts]  # byte-level: id = byte, EOD = 0


def test_folder_of_text_files_in_sorted_order(tmp_path):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bbb")
    (folder / "a.txt").write_text("aa")
    (folder / "sub" / "c.txt").write_text("c")
    result = _preprocess("--input", str(folder), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert _read(str(tmp_path / "out_text_document")) == [list(b"aa"), list(b"bbb"), list(b"c")]


@pytest.mark.parametrize("content, message", [
    ('{"text": "ok"}\nnot json\n', "line 2 is not valid JSON"),
    ('{"body": "ok"}\n', "line 1 has no key 'text'"),
])
def test_bad_jsonl_is_a_clear_error(tmp_path, content, message):
    src = tmp_path / "bad.jsonl"
    src.write_text(content)
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"))
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "out_text_document.bin").exists()


def test_token_ids_beyond_vocab_size_are_refused(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"text": "1 2 3"}) + "\n" + json.dumps({"text": "4 700 5"}) + "\n")
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--tokenizer-type",
                         "NullTokenizer", "--vocab-size", "512")
    assert result.returncode == 2
    # NullTokenizer's vocabulary is --vocab-size plus its EOD id
    assert "document 2 has token id 700, outside the tokenizer's vocabulary [0, 513)" in result.stderr
    assert not (tmp_path / "out_text_document.bin").exists()


def test_preprocessed_data_trains(tmp_path):
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i}: " + "abc " * (i % 50)}) + "\n" for i in range(200)))
    assert _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "c"), "--append-eod").returncode == 0
    log = tmp_path / "log.jsonl"
    result = _run(["--context-parallel-size", "2", "--data-path", str(tmp_path / "c_text_document"), "--split",
                   "100,0,0", "--reset-attention-mask", "--eod-mask-loss", "--train-iters", "3", "--lr-warmup-iters",
                   "1", "--data-cache-path", str(tmp_path), "--log-json", str(log), "--no-progress-bar"], 2,
                  timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["cp_bytes_intra"] > 0 for r in records)


def test_megatron_lm_command_line_several_keys_and_workers(tmp_path):
    """Megatron-LM's flags: two --json-keys (one dataset each), --workers 2, and its no-op runtime flags."""
    records = [{"text": f"text {i}", "title": f"t{i}"} for i in range(300)]  # more than one worker batch
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--json-keys", "text",
                         "title", "--append-eod", "--workers", "2", "--partitions", "1", "--log-interval", "100",
                         "--keep-sequential-samples", "--tokenizer-type", "ByteLevelTokenizer")
    assert result.returncode == 0, result.stderr
    for key in ("text", "title"):
        assert _read(str(tmp_path / f"out_{key}_document")) == [list(r[key].encode()) + [0] for r in records]
    assert "processed 256 documents" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--partitions", "2"], "--partitions 2 is not supported; allowed: 1"),
    (["--split-sentences"], "--split-sentences is not supported"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
])
def test_unsupported_megatron_lm_preprocess_flags(tmp_path, flags, message):
    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"), *flags)
    assert result.returncode == 2 and message in result.stderr


def test_gpt2_bpe_vocab_and_merges(tmp_path):
    pytest.importorskip("transformers", reason="GPT2BPETokenizer goes through transformers (not installed)")
    from tests.test_megatron_flags import write_gpt2_files

    vocab, merges = write_gpt2_files(tmp_path)
    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "hello"}) + "\n")
    result = _preprocess("--input", str(src), "--output-prefix", str(tmp_path / "out"), "--vocab-file", vocab,
                         "--merge-file", merges, "--append-eod")  # GPT2BPETokenizer implied, as in Megatron-LM
    assert result.returncode == 0, result.stderr
    assert _read(str(tmp_path / "out_text_document")) == [[12, 13, 4, 7, 3, 8, 0], [12, 0]]
