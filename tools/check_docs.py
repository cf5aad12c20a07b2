"""Re-run the commands and snippets quoted in README.md and docs/ and fail when one breaks or a figure changed.

Two kinds of fenced block are checked (docs/benchmarks.md, "Figures that stay true"):

- a quoted run: a block whose first line is ``$ <command>``, followed by the lines it printed; the check
  requires every quoted output line, whitespace normalised, to appear in the output (within a printed
  line: pytest's progress dots may precede it) in the same order;
- a snippet: a block tagged ``bash``/``sh`` (run as one ``bash -eo pipefail`` script) or ``python`` (run as
  a file); the check requires exit status 0.

Either way the output may not hold the same warning twice (a library's notice repeated by every rank;
pytest runs aside: pytest lists warnings in its own summary).

Every such block carries an HTML comment on the line just above it:

- ``<!-- check-docs [OPTIONS] -->``: run it from the repository root (``python`` / ``.venv/bin/python`` at
  the start of a command line replaced by ``--python``). Options, space separated, a value in double
  quotes when it holds spaces:
  ``exempt=REGEX`` -- quoted lines matching REGEX hold time-like figures and are not compared (the doc
  says so next to the block); ``mask=REGEX`` -- tokens matching REGEX (time columns) are blanked in the
  quoted and the printed lines before comparing; ``replace="OLD=>NEW"`` (repeatable) -- run the block
  with OLD replaced by NEW: how the doc's command is shrunk for CI (the doc says so next to the block;
  ``$TMPDIR`` is a scratch directory for files the command writes);
  ``same-as=PATH`` -- a snippet that must be the file PATH word for word (another checked block runs the
  file); ``timeout=SECONDS`` (default 300).
- ``<!-- check-docs: skip REASON -->``: not run; REASON (required) says why, e.g. every figure is a
  time, it needs a GPU or the user's data, or it is a fragment whose runnable whole is named.

A block without a marker is reported as unmarked, and so is an untagged block whose first line reads
like a command (tag it ``bash`` or quote it with ``$``); ``--strict`` makes both errors.

    python tools/check_docs.py [--python PATH] [--strict] [--list] [FILE ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTION = r'[\w-]+=(?:"[^"]*"|\S+)'
MARKER = re.compile(r"^<!--\s*check-docs(?::\s*(?P<skip>skip)\b\s*(?P<reason>.*?))?(?P<options>(?:\s+" + OPTION
                    + r")*)\s*-->$")
PYTHON_PREFIX = re.compile(r"^(\s*(?:\w+=\S*\s+)*)(?:\.venv/bin/python3?|python3?)(?=\s)", re.MULTILINE)
COMMAND_SEPARATOR = "@@check-docs: next command@@"
WARNING = re.compile(r"^.*?\b(\w*Warning: .*)$", re.MULTILINE)
PYTEST = re.compile(r"(?:^|\s)(?:-m\s+)?pytest\s")
SNIPPET_LANGUAGES = {"bash": "bash", "sh": "bash", "shell": "bash", "python": "python"}
# An untagged block starting like one of these is a command the reader will run: it must be checked too.
COMMAND_START = re.compile(r"^(?:\$ |(?:\w+=\S*\s+)*(?:\.venv\S*/bin/|\./)?(?:python3?|make|torchrun|pytest|bash)\s)")


@dataclass
class Block:
    """One fenced block to check: a quoted run (``$`` command and its output) or a snippet to execute."""

    path: str
    line: int  # 1-based line of the block's first content line
    command: str  # the ``$`` command, or the snippet's whole text
    expected: List[str]
    kind: str = "run"  # "run" ($ block), "bash" or "python" (snippets), "untagged" (a command without a tag)
    marker: Optional[str] = None  # None: unmarked; "check" or "skip"
    reason: str = ""
    options: dict = field(default_factory=dict)
    replacements: List[Tuple[str, str]] = field(default_factory=list)


def _normalise(line: str) -> str:
    return " ".join(line.split())


def _parse_marker(above: str, block: Block) -> None:
    match = MARKER.match(above)
    if not match:
        return
    block.marker = "skip" if match.group("skip") else "check"
    block.reason = (match.group("reason") or "").strip()
    for name, value in re.findall(r'([\w-]+)=("[^"]*"|\S+)', match.group("options")):
        value = value[1:-1] if value.startswith('"') else value
        if name == "replace":
            old, _, new = value.partition("=>")
            block.replacements.append((old, new))
        else:
            block.options[name] = value


def _quoted_runs(path: str, first_line: int, body: List[str]) -> List[Block]:
    """One block per ``$`` command of a fenced block, each with the output lines up to the next command."""
    starts = [k for k, line in enumerate(body) if line.startswith("$ ")] + [len(body)]
    runs = []
    for start, stop in zip(starts, starts[1:]):
        command, first_output = body[start][2:], start + 1
        while command.endswith("\\") and first_output < stop:  # continued command lines
            command = command[:-1] + " " + body[first_output].strip()
            first_output += 1
        runs.append(Block(path, first_line + start, command, [ln for ln in body[first_output:stop] if ln.strip()]))
    return runs


def parse(path: str) -> List[Block]:
    """The checkable fenced blocks of one markdown file (quoted runs, snippets, untagged commands)."""
    lines = open(path, encoding="utf-8").read().splitlines()
    blocks: List[Block] = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())  # a block inside a list item is indented
        end = next((j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("```")), len(lines))
        language, body = lines[i].strip()[3:].strip(), [line[indent:] for line in lines[i + 1:end]]
        found: List[Block] = []
        if body and body[0].startswith("$ "):
            found = _quoted_runs(path, i + 2, body)
        elif language in SNIPPET_LANGUAGES:
            found = [Block(path, i + 2, "\n".join(body) + "\n", [], kind=SNIPPET_LANGUAGES[language])]
        elif not language and body and COMMAND_START.match(body[0]):
            found = [Block(path, i + 2, "\n".join(body) + "\n", [], kind="untagged")]
        for block in found:
            _parse_marker(lines[i - 1].strip() if i > 0 else "", block)
        blocks += found
        i = end + 1
    return blocks


def _bash_commands(text: str) -> List[str]:
    """The snippet's commands: its lines with backslash continuations joined, blank and comment lines dropped."""
    commands, current = [], ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip() and not current.strip().startswith("#"):
            commands.append(current)
        current = ""
    return commands + ([current] if current.strip() else [])


def _with_python(text: str, python: str) -> str:
    return PYTHON_PREFIX.sub(lambda m: m.group(1) + shlex.quote(python), text)


def _run(block: Block, python: str) -> Tuple[Optional[str], str]:
    """(None, output) when the block's command or snippet exited 0, else (what failed, output)."""
    timeout = float(block.options.get("timeout", 300))
    text = block.command
    for old, new in block.replacements:
        if old not in text:
            return f"replace: {old!r} is not in the block", ""
        text = text.replace(old, new)
    with tempfile.TemporaryDirectory() as scratch:
        env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=scratch)
        env.pop("PYTHONWARNINGS", None)  # a warning the user would see is seen here
        if block.kind == "python":
            script = os.path.join(scratch, "snippet.py")
            with open(script, "w", encoding="utf-8") as handle:
                handle.write(text)
            argv = [python, script]
        else:
            separator = f"; echo {COMMAND_SEPARATOR}; echo {COMMAND_SEPARATOR} >&2\n"
            script = separator.join(_bash_commands(_with_python(text, python)))
            argv = ["bash", "-eo", "pipefail", "-c", script]
        try:
            result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"did not finish within {timeout:g} s", ""
    output = (result.stdout + "\n" + result.stderr).replace(COMMAND_SEPARATOR + "\n", "")
    if result.returncode != 0:
        return f"exit status {result.returncode}:\n{output[-2000:]}", output
    if PYTEST.search(text):  # pytest gathers the warnings of every test into its own summary
        return None, output
    repeated = []
    # each command of a snippet on its own: one warning per command is what its user sees
    for out, err in zip(result.stdout.split(COMMAND_SEPARATOR), result.stderr.split(COMMAND_SEPARATOR)):
        warnings = collections.Counter(m.group(1) for m in WARNING.finditer(out + "\n" + err))
        repeated += [f"{count} x {warning}" for warning, count in warnings.items() if count > 1]
    if repeated:
        return "a warning printed more than once (an entry point says each one once):\n" + "\n".join(repeated), output
    return None, output


def check(block: Block, python: str) -> Optional[str]:
    """None when the block runs and every compared quoted line appears in its output in order, else what differs."""
    if "same-as" in block.options:
        with open(os.path.join(ROOT, block.options["same-as"]), encoding="utf-8") as handle:
            if handle.read().strip() != block.command.strip():
                return f"the snippet is not {block.options['same-as']} word for word"
        return None
    problem, output = _run(block, python)
    if problem is not None:
        return problem
    exempt = re.compile(block.options["exempt"]) if "exempt" in block.options else None
    mask = re.compile(block.options["mask"]) if "mask" in block.options else None

    def comparable(line: str) -> str:
        return _normalise(mask.sub("#", line) if mask is not None else line)

    printed = [comparable(ln) for ln in output.splitlines()]
    position = 0
    for quoted in block.expected:
        if exempt is not None and exempt.search(quoted):
            continue
        want = comparable(quoted)
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


def _summary(block: Block) -> str:
    first = block.command.strip().splitlines()[0] if block.command.strip() else ""
    return first if block.kind == "run" else f"[{block.kind}] {first}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="markdown files, or FILE:LINE for one block (default: README.md "
                        "and docs/*.md)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for quoted python commands")
    parser.add_argument("--strict", action="store_true", help="unmarked blocks and untagged commands are errors")
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers, run nothing")
    args = parser.parse_args(argv)
    blocks: List[Block] = []
    for name in args.files or doc_files():
        path, _, line = name.partition(":") if re.search(r":\d+$", name) else (name, "", "")
        blocks += [b for b in parse(path) if not line or b.line == int(line)]
    failures, unmarked = 0, []
    for block in blocks:
        where = f"{os.path.relpath(block.path, ROOT)}:{block.line}"
        if block.kind == "untagged" or block.marker is None:
            unmarked.append(where + (" (untagged command: tag it bash)" if block.kind == "untagged" else ""))
            continue
        if block.marker == "skip":
            if not block.reason:
                print(f"FAIL {where}: 'check-docs: skip' needs a reason")
                failures += 1
            elif args.list:
                print(f"skip {where}: {block.reason}")
            continue
        if args.list:
            print(f"check {where}: {_summary(block)}")
            continue
        start = time.monotonic()
        problem = check(block, args.python)
        status = "ok  " if problem is None else "FAIL"
        print(f"{status} {where} ({time.monotonic() - start:.0f} s): {_summary(block)}", flush=True)
        if problem is not None:
            print("     " + problem.replace("\n", "\n     "), flush=True)
            failures += 1
    if unmarked:
        print(f"{'FAIL' if args.strict else 'note'}: {len(unmarked)} block(s) without a check-docs marker: "
              + ", ".join(unmarked))
        failures += len(unmarked) if args.strict else 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
