"""The command outputs README.md and docs/*.md quote, checked against what the commands print today.

Every fenced block of output in the docs (a fence with no language, or ``json``) sits right after
an HTML comment, which the rendered page does not show, saying what the block is:

``<!-- output-of-above name=quick-start variable="searched in * s" -->``
    the output of the ``bash`` block right above the comment: a fast, deterministic command
    (``autohet plan/compare/show/replan`` on bundled configs: seconds). The check runs that block
    with bash in a scratch directory holding links to the repository's ``configs/`` and
    ``scripts/`` (``autohet`` is this checkout's, run by this interpreter), the blocks of one
    document in order and in the same directory, so a later block reads what an earlier one
    wrote (``plan.yaml``). The quoted block must equal what it prints (stdout and stderr as a
    terminal shows them) line for line, but for each ``variable`` pattern: a field that honestly
    differs between runs (seconds taken, a timestamp), ``*`` standing for one word, in the quoted
    and the printed line alike. ``name`` (optional) is what ``figures-from`` calls the block.
``<!-- output-of command="autohet compare ..." variable="..." -->``
    the same, for an output whose command the page names in prose instead of a ``bash`` block
    (the quick start's, which scripts/quickstart.sh runs): the command is the comment's.
``<!-- figures-from quick-start="$0.02567 per million tokens" -->``
    the paragraph after the comment quotes these figures from the output of the named block of the
    same document: each must be in the paragraph and in what that block's command prints today.
``<!-- measured date=2026-11-27 load="6-10 on 2 cores" -->``
    the output of a slow run (training, a benchmark), quoted as it was measured that day at that
    load average; not re-run (``load`` may say it was not recorded).
``<!-- illustration -->``
    an example written for the text, not the output of a run.

A fence of output without such a comment is a problem too, so a new quoted output cannot slip
past the check. tests/testing/test_doc_outputs.py runs the check on the repository's docs;
by hand (after a change to the planner, say)::

    python -m megatron_autohet.testing.doc_outputs            # list the drift, status 1 if any
    python -m megatron_autohet.testing.doc_outputs --write    # rewrite the output-of blocks

``--write`` replaces each ``output-of(-above)`` block by what its command prints today (the
variable fields as printed); figures quoted in prose it only reports, for a person to reword.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUTPUT_FENCES = ("", "json")
KINDS = ("output-of-above", "output-of", "figures-from", "measured", "illustration")
# the kinds that say what the fenced block right below them is
BLOCK_KINDS = ("output-of-above", "output-of", "measured", "illustration")
# The longest a documented fast command may take, at any machine load.
COMMAND_TIMEOUT_S = 600


def documents(root: Path = REPO) -> list[Path]:
    """README.md and docs/*.md: the documents whose quoted outputs are checked."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclasses.dataclass
class Fence:
    """A fenced block: ``start`` is the index of its opening line, ``end`` of its closing one;
    ``lines`` without the ``indent`` of the fence (a block inside a list item)."""
    lang: str
    start: int
    end: int
    lines: list[str]
    indent: int = 0


@dataclasses.dataclass
class Marker:
    """A ``<!-- KIND key=value ... -->`` comment: lines ``start``..``end``."""
    kind: str
    fields: list[tuple[str, str]]
    start: int
    end: int

    def get(self, key: str) -> list[str]:
        return [v for k, v in self.fields if k == key]


@dataclasses.dataclass
class OutputBlock:
    """An output-of(-above) block: its command (the bash block above, or the comment's) and its
    quoted output."""
    name: str | None
    command: str
    variable: list[str]
    fence: Fence


@dataclasses.dataclass
class FiguresQuote:
    """A figures-from comment: (block name, figure) pairs and the paragraph after it."""
    figures: list[tuple[str, str]]
    paragraph: str
    line: int


@dataclasses.dataclass
class Document:
    path: Path
    lines: list[str]
    blocks: list[OutputBlock]
    quotes: list[FiguresQuote]
    problems: list[str]


_MARKER = re.compile(r"^<!--\s*(\S+)(.*?)\s*-->$", re.S)


def _parse_marker(text: str, start: int, end: int) -> Marker | None:
    match = _MARKER.match(text.strip())
    if match is None or match.group(1) not in KINDS:
        return None
    fields = []
    for token in shlex.split(match.group(2)):
        key, eq, value = token.partition("=")
        fields.append((key, value) if eq else (token, ""))
    return Marker(match.group(1), fields, start, end)


def parse(path: Path, text: str | None = None) -> Document:
    """The document's fences and markers, paired; what does not pair is a problem."""
    lines = (path.read_text() if text is None else text).splitlines()
    items: list[Fence | Marker] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            indent = len(line) - len(line.lstrip())
            lang, end = line.strip()[3:].strip(), i + 1
            while end < len(lines) and not lines[end].lstrip().startswith("```"):
                end += 1
            items.append(Fence(lang, i, end, [text[indent:] if not text[:indent].strip()
                                              else text.lstrip()
                                              for text in lines[i + 1:end]], indent))
            i = end + 1
            continue
        if line.lstrip().startswith("<!--"):
            end = i
            while end < len(lines) and "-->" not in lines[end]:
                end += 1
            marker = _parse_marker("\n".join(lines[i:end + 1]), i, end)
            if marker is not None:
                items.append(marker)
            i = end + 1
            continue
        i += 1
    doc = Document(path, lines, [], [], [])

    def blank_between(a: int, b: int) -> bool:
        return all(not lines[k].strip() for k in range(a + 1, b))

    for n, item in enumerate(items):
        where = f"{path.name}:{item.start + 1}"
        if isinstance(item, Fence):
            if item.lang not in OUTPUT_FENCES:
                continue
            before = items[n - 1] if n else None
            if not (isinstance(before, Marker) and before.kind in BLOCK_KINDS
                    and blank_between(before.end, item.start)):
                doc.problems.append(f"{where}: a quoted output with no <!-- output-of-above -->, "
                                    "<!-- measured --> or <!-- illustration --> comment above it")
            continue
        below = items[n + 1] if n + 1 < len(items) else None
        output_below = (isinstance(below, Fence) and below.lang in OUTPUT_FENCES
                        and blank_between(item.end, below.start))
        if item.kind == "output-of":
            commands = item.get("command")
            if not (commands and commands[0] and output_below):
                doc.problems.append(f"{where}: output-of needs command=... and the quoted output "
                                    "right below it")
            else:
                names = item.get("name")
                doc.blocks.append(OutputBlock(names[0] if names else None, commands[0],
                                              item.get("variable"), below))
        elif item.kind == "output-of-above":
            above = items[n - 1] if n else None
            if not (isinstance(above, Fence) and above.lang == "bash"
                    and blank_between(above.end, item.start)):
                doc.problems.append(f"{where}: output-of-above needs the ```bash block of the "
                                    "command right above it")
            elif not output_below:
                doc.problems.append(f"{where}: output-of-above needs the quoted output right "
                                    "below it")
            else:
                names = item.get("name")
                doc.blocks.append(OutputBlock(names[0] if names else None,
                                              "\n".join(above.lines), item.get("variable"),
                                              below))
        elif item.kind == "figures-from":
            end = item.end + 1
            while end < len(lines) and lines[end].strip():
                end += 1
            doc.quotes.append(FiguresQuote(item.fields, " ".join(lines[item.end + 1:end]),
                                           item.start))
        elif item.kind == "measured":
            dates, loads = item.get("date"), item.get("load")
            if not (dates and re.fullmatch(r"\d{4}-\d{2}-\d{2}", dates[0]) and loads
                    and loads[0]):
                doc.problems.append(f"{where}: measured needs date=YYYY-MM-DD and load=...")
    names = [b.name for b in doc.blocks if b.name]
    for name in sorted({n for n in names if names.count(n) > 1}):
        doc.problems.append(f"{path.name}: two output blocks named {name!r}")
    return doc


def _normalise(text: str, variable: list[str]) -> str:
    for pattern in variable:
        regex = r"\S+".join(re.escape(part) for part in pattern.split("*"))
        text = re.sub(regex, pattern, text)
    return text.rstrip()


def run_block(command: str, workdir: Path) -> tuple[int, list[str]]:
    """(exit status, output lines) of a documented bash block run in ``workdir``."""
    script = (f'autohet() {{ {shlex.quote(sys.executable)} -m megatron_autohet.cli.main "$@"; }}\n'
              f"set -e\n{command}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    done = subprocess.run(["bash", "-c", script], cwd=workdir, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT_S)
    lines = [line.rstrip() for line in done.stdout.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return done.returncode, lines


def check(doc: Document, write: bool = False) -> list[str]:
    """The document's problems: its markers', each output-of(-above) block that differs from what
    its command prints (a diff), each quoted figure missing from the paragraph or the output.
    With ``write``, the differing blocks are replaced in ``doc.lines`` by today's output."""
    problems = list(doc.problems)
    outputs: dict[str, str] = {}
    replacements = []
    with tempfile.TemporaryDirectory(prefix="doc-outputs-") as scratch:
        workdir = Path(scratch)
        for link in ("configs", "scripts"):
            (workdir / link).symlink_to(REPO / link)
        for block in doc.blocks:
            where = f"{doc.path.name}:{block.fence.start + 1}"
            status, printed = run_block(block.command, workdir)
            if block.name:
                outputs[block.name] = "\n".join(printed)
            if status != 0:
                problems.append(f"{where}: the command above exited with status {status}:\n"
                                + "\n".join(printed[-20:]))
                continue
            quoted = [_normalise(line, block.variable) for line in block.fence.lines]
            today = [_normalise(line, block.variable) for line in printed]
            if quoted != today:
                diff = difflib.unified_diff(quoted, today, "quoted", "printed today", lineterm="")
                problems.append(f"{where}: the quoted output differs from what the command "
                                "prints:\n" + "\n".join(diff))
                replacements.append((block.fence, printed))
    for quote in doc.quotes:
        paragraph = " ".join(quote.paragraph.split())
        for name, figure in quote.figures:
            where = f"{doc.path.name}:{quote.line + 1}"
            if name not in outputs:
                problems.append(f"{where}: figures-from names {name!r}, which no output block "
                                "of this document is called")
            elif " ".join(figure.split()) not in paragraph:
                problems.append(f"{where}: {figure!r} is not in the paragraph below the comment")
            elif " ".join(figure.split()) not in " ".join(outputs[name].split()):
                problems.append(f"{where}: {figure!r} is no longer in {name!r}'s output (the "
                                "paragraph and the comment need today's figure)")
    if write:
        for fence, printed in sorted(replacements, key=lambda r: -r[0].start):
            doc.lines[fence.start + 1:fence.end] = [" " * fence.indent + line if line else ""
                                                    for line in printed]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="markdown files (default: README.md and docs/*.md)")
    parser.add_argument("--write", action="store_true",
                        help="replace each differing output block by today's output")
    args = parser.parse_args(argv)
    for path in args.files:
        if not path.is_file():
            print(f"doc_outputs: error: <command line>: field 'files': {path}: no such file "
                  "(allowed: markdown files)", file=sys.stderr)
            return 2
    problems = []
    for path in args.files or documents():
        doc = parse(path)
        found = check(doc, write=args.write)
        if args.write and doc.blocks:
            path.write_text("\n".join(doc.lines) + "\n")
        problems += found
    for problem in problems:
        print(problem)
    print(f"> {len(problems)} problem(s)" + (" (output blocks rewritten)" if args.write else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
