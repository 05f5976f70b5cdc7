"""Every code block of the README is run by a test, or says why not; the commands it shows exist.

* ```python blocks: each section's blocks are run by the test module named in ``RUNNERS``
  (checked: that module calls ``python_snippets("<section>")``); a block that cannot run in
  one process (it needs ``torchrun`` or a launcher) carries a ``<!-- not run: reason -->`` line
  right above it, and the reason names where the same code is tested;
* ```bash / ```console blocks: every ``examples/*.py``, ``benchmarks/*.py`` or ``tests/*.py``
  script they run exists, its flags are flags of that script, and every ``pyro-gradroute``
  command line parses (without running);
* the Performance section's setup table names a command for every figure.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.readme import README, python_snippets

ROOT = README.parent
TEXT = README.read_text()

# section -> the test module that executes its ```python blocks
RUNNERS = {
    "split": "tests/test_readme_estimators.py",
    "stl": "tests/test_readme_estimators.py",
    "dreg": "tests/test_readme_estimators.py",
    "stl-pyro": "tests/test_readme_estimators.py",
    "routing": "tests/routing/test_readme_routing.py",
    "guides": "tests/guides/test_readme_guides.py",
    "recipes": "tests/test_readme_recipes.py",
    "diagnostics": "tests/test_readme_recipes.py",
    "install": "tests/diagnostics/test_inference_data.py",
}


def _blocks() -> list[dict]:
    """``{"lang", "code", "line", "section", "marker"}`` of every fenced block, in order."""
    out, section = [], None
    lines = TEXT.splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"<!-- section: (\S+) -->", lines[i])
        if m:
            section = m.group(1)
        fence = re.match(r"```(\w*)$", lines[i])
        if fence:
            start = i
            i += 1
            body = []
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            prev = lines[start - 1] if start else ""
            marker = re.match(r"<!-- not run: (.+) -->", prev)
            out.append(
                {
                    "lang": fence.group(1),
                    "code": "\n".join(body) + "\n",
                    "line": start + 1,
                    "section": section,
                    "marker": marker.group(1) if marker else None,
                }
            )
        i += 1
    return out


BLOCKS = _blocks()
PYTHON = [b for b in BLOCKS if b["lang"] == "python"]
SHELL = [b for b in BLOCKS if b["lang"] in ("bash", "console")]


def test_the_readme_has_blocks_of_each_kind():
    assert len(PYTHON) >= 15 and len(SHELL) >= 6


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: f"line{b['line']}")
def test_every_python_block_is_run_or_says_why_not(block):
    if block["marker"]:
        reason = block["marker"]
        assert "torchrun" in reason or "launcher" in reason, reason
        assert "examples/" in reason or "tests/" in reason or "needs torchrun" in reason, reason
        return
    section = block["section"]
    assert section in RUNNERS, (
        f"README line {block['line']}: the python block of section {section!r} is run by no "
        "test: add a runner to RUNNERS (or a '<!-- not run: reason -->' line above it)"
    )
    runner = (ROOT / RUNNERS[section]).read_text()
    assert f'python_snippets("{section}"' in runner, RUNNERS[section]
    # the runner finds this very block
    assert block["code"] in [s if s.endswith("\n") else s + "\n" for s in python_snippets(section)]


def test_not_run_blocks_have_a_tested_twin():
    """The torchrun/Lightning recipes are tested as the example scripts they point to."""
    for block in PYTHON:
        for path in re.findall(r"(examples/\w+\.py|tests/[\w/]+\.py)", block["marker"] or ""):
            assert (ROOT / path).exists(), path


def _commands(block) -> list[list[str]]:
    out = []
    for raw in block["code"].splitlines():
        line = raw[2:] if raw.startswith("$ ") else raw
        if block["lang"] == "console" and not raw.startswith("$ "):
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
    """(script path, its arguments) of ``python X.py ...`` / ``torchrun [opts] X.py ...``."""
    for i, w in enumerate(words):
        if re.match(r"(examples|benchmarks|tests)/[\w/]+\.py$", w):
            return w, words[i + 1 :]
    return None


SCRIPT_RUNS = [
    (b["line"], *s) for b in SHELL for words in _commands(b) if (s := _script(words)) is not None
]
CLI_RUNS = [
    (b["line"], words[1:]) for b in SHELL for words in _commands(b) if words[0] == "pyro-gradroute"
]


def test_the_readme_shows_script_and_cli_commands():
    assert len(SCRIPT_RUNS) >= 5 and len(CLI_RUNS) >= 4
    assert any(path == "examples/lightning_svi.py" for _, path, _ in SCRIPT_RUNS)


@pytest.mark.parametrize("run", SCRIPT_RUNS, ids=lambda r: f"line{r[0]}-{r[1]}")
def test_scripts_the_readme_runs_exist_and_take_those_flags(run):
    line, path, args = run
    script = ROOT / path
    assert script.exists(), f"README line {line}: {path} does not exist"
    source = script.read_text()
    for flag in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{flag}"' in source, f"README line {line}: {path} has no flag {flag}"


def test_pyro_gradroute_command_lines_parse():
    """Each ``pyro-gradroute ...`` line of the README parses (``--help`` would exit 0 too)."""
    code = (
        "import sys, json\n"
        "from pyro_gradroute.app.cli import _parser\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    _parser().parse_args(argv)\n"
    )
    import json

    argvs = [args for _, args in CLI_RUNS if args and args[0] in ("compare", "list")]
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_setup_table_names_a_command_for_every_figure():
    start = TEXT.index("### Setup, tests and scale-out")
    table = [ln for ln in TEXT[start:].splitlines() if ln.startswith("| ")][2:]
    assert len(table) >= 5
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert "`" in cells[-1], f"no command in: {row}"
        assert "load" in row, f"no load stated in: {row}"
