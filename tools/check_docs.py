"""Re-run the commands quoted in docs/ and README.md and fail when a printed figure differs from the doc.

Convention (docs/benchmarks.md, "Figures that stay true"): a fenced code block whose first line is
``$ <command>`` quotes a command and, below it, the lines it printed. An HTML comment on the line just
above the block says what to do with it:

- ``<!-- check-docs -->``: run the command (from the repository root, ``python`` / ``.venv/bin/python`` at
  the start of the command replaced by ``--python``) and require every quoted output line, whitespace
  normalised, to appear in its output (within a printed line: pytest's progress dots may precede it) in
  the same order. Options, space separated:
  ``exempt=REGEX`` -- quoted lines matching REGEX hold time-like figures and are not compared (the doc
  says so next to the block); ``timeout=SECONDS`` (default 300).
- ``<!-- check-docs: skip REASON -->``: not run; REASON (required) says why, e.g. every figure is a
  time, or the command needs a GPU or takes too long for CI (the doc then quotes a shrunk variant that
  is checked, where one exists).

A ``$`` block without a comment is reported as unmarked; ``--strict`` makes that an error.

    python tools/check_docs.py [--python PATH] [--strict] [--list] [FILE ...]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*check-docs(?::\s*(?P<skip>skip)\b\s*(?P<reason>.*?))?(?P<options>(?:\s+\w+=\S+)*)\s*-->$")
PYTHON_PREFIX = re.compile(r"^((?:\w+=\S*\s+)*)(?:\.venv/bin/python3?|python3?)(?=\s)")


@dataclass
class Block:
    """One quoted command and the lines the doc says it printed."""

    path: str
    line: int  # 1-based line of the ``$`` command
    command: str
    expected: List[str]
    marker: Optional[str] = None  # None: unmarked; "check" or "skip"
    reason: str = ""
    options: dict = field(default_factory=dict)


def _normalise(line: str) -> str:
    return " ".join(line.split())


def parse(path: str) -> List[Block]:
    """The ``$`` blocks of one markdown file with their markers."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```") and i + 1 < len(lines) and lines[i + 1].startswith("$ "):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            command, first_output = lines[i + 1][2:], i + 2
            while command.endswith("\\") and first_output < end:  # continued command lines
                command = command[:-1] + " " + lines[first_output].strip()
                first_output += 1
            block = Block(path, i + 2, command, [ln for ln in lines[first_output:end] if ln.strip()])
            above = lines[i - 1].strip() if i > 0 else ""
            match = MARKER.match(above)
            if match:
                block.marker = "skip" if match.group("skip") else "check"
                block.reason = (match.group("reason") or "").strip()
                block.options = dict(opt.split("=", 1) for opt in match.group("options").split())
            blocks.append(block)
            i = end + 1
        else:
            i += 1
    return blocks


def _command_line(command: str, python: str) -> str:
    return PYTHON_PREFIX.sub(lambda m: m.group(1) + shlex.quote(python), command.strip(), count=1)


def check(block: Block, python: str) -> Optional[str]:
    """None when every compared quoted line appears in the command's output in order, else what differs."""
    timeout = float(block.options.get("timeout", 300))
    exempt = re.compile(block.options["exempt"]) if "exempt" in block.options else None
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONWARNINGS="ignore")
    try:
        result = subprocess.run(["bash", "-c", _command_line(block.command, python)], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"did not finish within {timeout:g} s"
    if result.returncode != 0:
        return f"exit status {result.returncode}:\n{result.stderr[-2000:]}"
    printed = [_normalise(ln) for ln in (result.stdout + "\n" + result.stderr).splitlines()]
    position = 0
    for quoted in block.expected:
        if exempt is not None and exempt.search(quoted):
            continue
        want = _normalise(quoted)
        found = next((i for i in range(position, len(printed)) if want in printed[i]), None)
        if found is not None:
            position = found + 1
        else:
            close = [ln for ln in printed if ln.split()[:1] == want.split()[:1]]
            return f"quoted line not printed (in order):\n  doc:     {want}\n  printed: " + \
                ("\n           ".join(close[:3]) or "(no line starting alike)")
    return None


def doc_files() -> List[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + sorted(os.path.join(docs, n) for n in os.listdir(docs)
                                                     if n.endswith(".md"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for quoted python commands")
    parser.add_argument("--strict", action="store_true", help="unmarked $ blocks are errors")
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers, run nothing")
    args = parser.parse_args(argv)
    blocks = [b for path in (args.files or doc_files()) for b in parse(path)]
    failures, unmarked = 0, []
    for block in blocks:
        where = f"{os.path.relpath(block.path, ROOT)}:{block.line}"
        if block.marker is None:
            unmarked.append(where)
            continue
        if block.marker == "skip":
            if not block.reason:
                print(f"FAIL {where}: 'check-docs: skip' needs a reason")
                failures += 1
            elif args.list:
                print(f"skip {where}: {block.reason}")
            continue
        if args.list:
            print(f"check {where}: {block.command}")
            continue
        start = time.monotonic()
        problem = check(block, args.python)
        status = "ok  " if problem is None else "FAIL"
        print(f"{status} {where} ({time.monotonic() - start:.0f} s): {block.command}")
        if problem is not None:
            print("     " + problem.replace("\n", "\n     "))
            failures += 1
    if unmarked:
        print(f"{'FAIL' if args.strict else 'note'}: {len(unmarked)} quoted command(s) without a check-docs "
              "marker: " + ", ".join(unmarked))
        failures += len(unmarked) if args.strict else 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
