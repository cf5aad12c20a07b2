"""tools/check_docs.py: a quoted figure that the command no longer prints fails; exempt lines and skips do not."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("check_docs", os.path.join(ROOT, "tools", "check_docs.py"))
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # dataclasses look their module up
    spec.loader.exec_module(tool)
    return tool


DOC = """Text.

<!-- check-docs exempt=seconds -->
```
$ python -c "print('bytes 1024'); print('took 3.2 seconds'); print('padding 0.125')"
bytes {bytes}
took 9.9 seconds
padding 0.125
```

<!-- check-docs: skip every figure is a time -->
```
$ false
```

```
$ false
```
"""


def test_a_changed_figure_fails_and_time_lines_are_exempt(tmp_path, capsys):
    tool = _tool()
    good, bad = tmp_path / "good.md", tmp_path / "bad.md"
    good.write_text(DOC.format(bytes=1024))
    bad.write_text(DOC.format(bytes=1000))
    blocks = tool.parse(str(good))
    assert [(b.marker, b.reason) for b in blocks] == [("check", ""), ("skip", "every figure is a time"), (None, "")]
    assert tool.main([str(good), "--python", sys.executable]) == 0
    assert tool.main([str(bad), "--python", sys.executable]) == 1
    assert "doc:     bytes 1000" in capsys.readouterr().out
    assert tool.main([str(good), "--python", sys.executable, "--strict"]) == 1  # the unmarked block


def test_a_skip_needs_a_reason(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- check-docs: skip -->\n```\n$ false\n```\n")
    assert _tool().main([str(doc)]) == 1


SNIPPETS = """<!-- check-docs mask=\\d+\\.\\d{{3}} -->
```
$ python -c "print('step 1.234 s, 64 bytes')"
step 9.999 s, {bytes} bytes
$ python -c "print('second')"
second
```

<!-- check-docs replace="exit 3=>exit 0" -->
```bash
echo shrunk; exit 3
```

<!-- check-docs -->
```python
import sys
sys.exit({python_status})
```

<!-- check-docs same-as=snippet.py -->
```python
print("the file, word for word")
```

```
python tools/untagged.py
```
"""


def _snippet_doc(tmp_path, bytes_=64, python_status=0, file_text='print("the file, word for word")\n'):
    doc = tmp_path / "doc.md"
    doc.write_text(SNIPPETS.format(bytes=bytes_, python_status=python_status))
    (tmp_path / "snippet.py").write_text(file_text)
    return doc


def test_snippets_run_shrunk_masked_and_word_for_word(tmp_path, monkeypatch, capsys):
    tool = _tool()
    monkeypatch.setattr(tool, "ROOT", str(tmp_path))  # same-as paths are relative to the repository root
    blocks = tool.parse(str(_snippet_doc(tmp_path)))
    assert [(b.kind, b.marker) for b in blocks] == [("run", "check"), ("run", "check"), ("bash", "check"),
                                                    ("python", "check"), ("python", "check"), ("untagged", None)]
    assert blocks[2].replacements == [("exit 3", "exit 0")]
    assert tool.main([str(_snippet_doc(tmp_path)), "--python", sys.executable]) == 0
    assert tool.main([str(_snippet_doc(tmp_path)), "--python", sys.executable, "--strict"]) == 1
    assert "(untagged command: tag it bash)" in capsys.readouterr().out
    for broken in (_snippet_doc(tmp_path, bytes_=65), _snippet_doc(tmp_path, python_status=1),
                   _snippet_doc(tmp_path, file_text="print('drifted')\n")):
        assert tool.main([str(broken), "--python", sys.executable]) == 1, broken.read_text()


def test_a_replacement_that_does_not_apply_fails(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text('<!-- check-docs replace="--train-iters 20=>--train-iters 2" -->\n```bash\ntrue\n```\n')
    assert _tool().main([str(doc)]) == 1


def test_every_block_of_the_docs_is_marked():
    """README.md and docs/: every command and snippet is checked or skipped with a reason (run: CI's check_docs)."""
    assert _tool().main(["--list", "--strict"]) == 0


def test_every_example_is_run_by_a_checked_block_or_a_test():
    tool = _tool()
    checked = " ".join(b.command for path in tool.doc_files() for b in tool.parse(path) if b.marker == "check")
    tests = " ".join(open(os.path.join(dirpath, name), encoding="utf-8").read()
                     for dirpath, _, names in os.walk(os.path.join(ROOT, "tests")) for name in names
                     if name.endswith(".py") and name != "test_check_docs.py")
    examples = sorted(os.listdir(os.path.join(ROOT, "examples")))
    assert examples
    unrun = [name for name in examples if f"examples/{name}" not in checked and f'"{name}"' not in tests]
    assert unrun == []


#: A Python statement that prints one warning.
WARN_ONCE = "import warnings; warnings.warn('notice')"


def _blocks_pass(tmp_path, text: str) -> list:
    """Whether each checked block of a doc holding ``text`` passes."""
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    tool = _tool()
    return [tool.check(b, sys.executable) is None for b in tool.parse(str(doc))]


def test_a_warning_repeated_by_every_rank_fails(tmp_path):
    once = WARN_ONCE
    doc = (f'<!-- check-docs -->\n```python\n{once}\n```\n\n'
           f'<!-- check-docs -->\n```bash\npython -c "{once}"; python -c "{once}"\n```\n')
    assert _blocks_pass(tmp_path, doc) == [True, False]


def test_a_block_inside_a_list_item_is_checked_too(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("- item:\n\n  <!-- check-docs -->\n  ```\n  $ python -c \"print(42)\"\n  41\n  ```\n\n"
                   "- another:\n\n  ```\n  $ true\n  ```\n")
    tool = _tool()
    blocks = tool.parse(str(doc))
    assert [(b.command, b.expected, b.marker) for b in blocks] == [('python -c "print(42)"', ["41"], "check"),
                                                                  ("true", [], None)]
    assert tool.check(blocks[0], sys.executable) is not None  # 42 printed, 41 quoted


def test_each_command_of_a_snippet_may_say_a_warning_once(tmp_path):
    once = WARN_ONCE
    doc = (f'<!-- check-docs -->\n```bash\n# two commands, each warns once\npython -c "{once}"\n'
           f'python -c \\\n    "{once}"\n```\n')
    assert _blocks_pass(tmp_path, doc) == [True]
