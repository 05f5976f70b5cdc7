"""The README: short, a working SVI loop early, every code block runs, every command exists.

* the README has at most 300 lines and its first code block, an ``SVI`` loop with
  ``TraceAdaptiveSTL_ELBO()``, ends within its first 60 lines and prints what it says;
* ```python blocks run (one session per ``## `` section, ``tests/readme.py``) or say why not
  and name the file that runs the same code;
* ```bash / ```console blocks: every ``examples/*.py``, ``benchmarks/*.py`` or ``tests/*.py``
  script they run exists and takes those flags; every ``pyro-gradroute`` line parses;
* the CI command (after ``<!-- test-command -->``) installs the docs and builds them with
  warnings as errors;
* "Which estimator?" is a table of words (no figures); every link into ``docs/`` names an
  existing page and, with ``#anchor``, an existing heading there.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest

from tests.readme import README, ROOT, blocks, python_blocks, run_session, sessions

TEXT = README.read_text()
LINES = TEXT.splitlines()
BLOCKS = blocks(README)
SHELL = [b for b in BLOCKS if b.lang in ("bash", "console")]
SESSIONS = sessions(README, per_heading=True)


def test_the_readme_is_short():
    assert len(LINES) <= 300


def test_a_working_svi_loop_with_the_default_estimator_within_60_lines():
    first = python_blocks(README)[0]
    end = first.line + len(first.code.splitlines()) + 1
    assert end <= 60, end
    assert "TraceAdaptiveSTL_ELBO()" in first.code and "SVI(" in first.code
    assert first.prints, "the first example says what it prints"


@pytest.mark.slow
def test_the_first_fit_lands_on_the_exact_posterior():
    session = SESSIONS[0]
    assert session[0].line == python_blocks(README)[0].line
    ns = run_session(session)  # also checks the printed line
    assert abs(ns["mean"] - ns["exact_mean"]) < 0.01
    assert abs(ns["sd"] - ns["exact_sd"]) < 0.01


@pytest.mark.slow
def test_the_three_questions_run_and_the_route_equals_the_naive_two_passes():
    import torch

    (session,) = [s for s in SESSIONS if s[0].heading == "The three questions"]
    ns = run_session(session)
    A, B, x = ns["A"], ns["B"], ns["x"]
    y1, y2 = B(A(x)), B(A(x))  # the naive reference: two forward passes
    loss1, loss2 = y1.pow(2).mean(), (y2 - 1).abs().mean()
    ref_A = torch.autograd.grad(loss1 + loss2, list(A.parameters()), retain_graph=True)
    ref_B = torch.autograd.grad(loss1, list(B.parameters()))
    for p, r in zip([*A.parameters(), *B.parameters()], [*ref_A, *ref_B]):
        assert torch.allclose(p.grad, r, atol=1e-6)


@pytest.mark.parametrize(
    "session",
    [s for s in SESSIONS[1:] if s[0].heading != "The three questions"],
    ids=lambda s: s[0].heading.split(":")[0],
)
def test_every_python_session_runs(session):
    run_session(session)


def test_blocks_that_cannot_run_here_name_their_runnable_twin():
    for b in python_blocks(README):
        if b.not_run:
            paths = re.findall(r"((?:examples|tests)/[\w/]+\.py)", b.not_run)
            assert paths, b.label
            assert all((ROOT / p).exists() for p in paths), b.label


def _commands(block) -> list[list[str]]:
    out = []
    for raw in block.code.splitlines():
        line = raw[2:] if raw.startswith("$ ") else raw
        if block.lang == "console" and not raw.startswith("$ "):
            continue  # output
        line = line.split("  #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"&&|\|", line):
            words = shlex.split(part)
            if words:
                out.append(words)
    return out


def _script(words: list[str]) -> tuple[str, list[str]] | None:
    for i, w in enumerate(words):
        if re.match(r"(examples|benchmarks|tests)/[\w/]+\.py$", w):
            return w, words[i + 1 :]
    return None


def script_runs(blocks_) -> list[tuple[str, str, list[str]]]:
    return [
        (b.label, *s)
        for b in blocks_
        for words in _commands(b)
        if (s := _script(words)) is not None
    ]


def cli_runs(blocks_) -> list[list[str]]:
    return [words[1:] for b in blocks_ for words in _commands(b) if words[0] == "pyro-gradroute"]


def check_scripts(runs) -> None:
    for label, path, args in runs:
        script = ROOT / path
        assert script.exists(), f"{label}: {path} does not exist"
        source = script.read_text()
        for flag in (a.split("=")[0] for a in args if a.startswith("--")):
            assert f'"{flag}"' in source, f"{label}: {path} has no flag {flag}"


def check_cli(argvs) -> None:
    code = (
        "import sys, json\n"
        "from pyro_gradroute.app.cli import _parser\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    _parser().parse_args(argv)\n"
    )
    argvs = [a for a in argvs if a and a[0] in ("compare", "list")]
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_pyro_gradroute_command_lines_parse():
    argvs = cli_runs(SHELL)
    assert len(argvs) >= 3
    check_cli(argvs)


def test_scripts_the_readme_runs_exist_and_take_those_flags():
    check_scripts(script_runs(SHELL))


def test_the_ci_command_builds_the_docs_with_warnings_as_errors():
    i = LINES.index("<!-- test-command -->")
    assert LINES[i + 1] == "```bash"
    command = LINES[i + 2]
    assert "docs]" in command.split("pip install", 1)[1].split("&&")[0]
    assert "python -m pytest" in command
    assert "sphinx -W -b html docs" in command


def _table(heading: str) -> list[list[str]]:
    start = LINES.index(f"## {heading}")
    rows = []
    for ln in LINES[start + 1 :]:
        if ln.startswith("## "):
            break
        if ln.startswith("| ") and not set(ln) <= set("|- "):
            rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_which_estimator_is_a_table_of_words_each_row_linking_to_what_was_measured():
    header, *rows = _table("Which estimator?")
    assert header[-1] == "measured" and len(rows) >= 8
    for row in rows:
        for cell in row[2:3]:  # "why": words, not figures
            assert not re.search(r"\d\.\d|\d+%|\+/-|±", cell), cell
        assert row[-1] == "—" or re.search(r"\]\(docs/[\w/]+\.md(#[\w-]+)?\)", row[-1]), row


def slug(heading: str) -> str:
    """The anchor MyST (``myst_heading_anchors``) and GitHub give a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def check_links(text: str, base) -> None:
    for target, anchor in re.findall(r"\]\(((?:\.\./)?(?:docs/)?[\w/]+\.md)(?:#([\w-]+))?\)", text):
        path = (base / target).resolve()
        assert path.exists(), target
        if anchor:
            headings = [
                slug(ln.lstrip("#")) for ln in path.read_text().splitlines() if ln.startswith("#")
            ]
            assert anchor in headings, (target, anchor, headings)


def test_links_into_the_docs_name_pages_and_headings_that_exist():
    check_links(TEXT, ROOT)
