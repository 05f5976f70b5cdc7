"""The fenced code blocks of the README and of the documentation pages (``docs/*.md``).

Conventions the tests enforce (``tests/test_readme_blocks.py``, ``tests/test_docs_pages.py``):

* the ```python blocks of a file run in order; a *session* is one namespace: the README starts a
  fresh one at every ``## `` heading, a documentation page is one session from top to bottom;
* a block that cannot run in one process (a launcher that starts several) carries a
  ``<!-- not run: reason -->`` line right above it; the reason names the example or test file
  that runs the same code;
* ``# prints: TEXT`` comments in a block are, in order, exactly the lines the block prints.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


@dataclass
class Block:
    path: Path
    lang: str
    code: str
    line: int  # 1-based line of the opening fence
    heading: str  # the last ``## `` heading above it ("" before the first)
    not_run: str | None  # the reason of a ``<!-- not run: ... -->`` line above it

    @property
    def label(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def prints(self) -> list[str]:
        return [m.group(1) for m in re.finditer(r"#\s*prints:\s*(.*?)\s*$", self.code, re.M)]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file (MyST directives such as ```{toctree} excluded)."""
    out, heading = [], ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            heading = lines[i][3:].strip()
        fence = re.match(r"(`{3,})(\S*)", lines[i])
        if fence:
            start, ticks = i, fence.group(1)
            i += 1
            body = []
            while lines[i].rstrip() != ticks:
                body.append(lines[i])
                i += 1
            prev = lines[start - 1] if start else ""
            marker = re.match(r"<!-- not run: (.+) -->", prev)
            out.append(
                Block(
                    path=path,
                    lang=fence.group(2),
                    code="\n".join(body) + "\n",
                    line=start + 1,
                    heading=heading,
                    not_run=marker.group(1) if marker else None,
                )
            )
        i += 1
    return out


def python_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang == "python"]


def sessions(path: Path, per_heading: bool) -> list[list[Block]]:
    """The runnable python blocks grouped into sessions (one namespace each)."""
    out: list[list[Block]] = []
    current = None
    for b in python_blocks(path):
        if b.not_run:
            continue
        if not out or (per_heading and b.heading != current):
            out.append([])
            current = b.heading
        out[-1].append(b)
    return out


def run_session(session: list[Block]) -> dict:
    """Run a session's blocks in one namespace; each block prints what its ``# prints:`` say."""
    import pyro

    pyro.clear_param_store()
    namespace: dict = {"__name__": "__doc_session__"}
    for b in session:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b.code, b.label, "exec"), namespace)
        if b.prints:
            assert out.getvalue().splitlines() == b.prints, (b.label, out.getvalue())
    return namespace
