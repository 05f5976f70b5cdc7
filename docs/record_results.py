"""Run a command and write what it prints to ``docs/results/NAME.md``, with how it was made.

For the tables of commands that print a table but write no results file themselves (the
conjugate fits, the conformance matrix, Pyro's test suite under the swaps)::

    python docs/record_results.py conjugate -- python -m tests.conjugate

The file starts with the command, the date, the commit, the Python and torch versions and the
machine's load average before and after the run; then the output: its Markdown tables as tables,
every other run of lines as a text block. The pages include it with the ``{results}`` directive
(``docs/_ext/results.py``). A command that fails writes nothing and exits with its status.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    )
    dirty = subprocess.run(
        # edits to the documentation itself do not change what a command measures
        [
            "git",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--",
            ".",
            ":!docs",
            ":!README.md",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def render(command: list[str], output: str, load_before: str, load_after: str) -> str:
    import torch

    # Markdown tables stay tables; every other run of lines becomes a text block
    groups: list[tuple[bool, list[str]]] = []
    for ln in output.rstrip().splitlines():
        is_table = ln.startswith("|")
        if not ln.strip():
            continue
        if groups and groups[-1][0] == is_table:
            groups[-1][1].append(ln)
        else:
            groups.append((is_table, [ln]))
    body = "\n\n".join(
        "\n".join(g) if table else "```text\n" + "\n".join(g) + "\n```" for table, g in groups
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"<!-- written by docs/record_results.py: do not edit, rerun the command -->\n"
        f"`{shlex.join(command)}` · {stamp} · commit {_commit()} · Python "
        f"{platform.python_version()}, torch {torch.__version__} · {os.cpu_count()} CPUs, load "
        f"average {load_before} before, {load_after} after\n\n{body}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the results file's name, without .md")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or not args.name.replace("_", "").replace("-", "").isalnum():
        parser.error("usage: record_results.py NAME -- COMMAND ...")
    before = _load()
    proc = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        print(proc.stdout, end="")
        return proc.returncode
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name}.md"
    path.write_text(render(command, proc.stdout, before, _load()))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
