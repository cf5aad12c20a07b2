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
