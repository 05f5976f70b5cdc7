"""The documentation pages (``docs/*.md``): every code block runs or names its runnable twin.

* each page's ```python blocks run in order in one session (``tests/readme.py``), and the claims
  their comments make hold (checked below against the page's namespace);
* a block marked ``<!-- not run: reason -->`` (it needs several processes) names the example or
  test file that runs the same code, and that file exists;
* ```bash blocks: the scripts they run exist and take those flags; ``pyro-gradroute`` lines parse;
* links between pages name pages and headings that exist;
* no page (nor the README) types a measured figure, in a table or in prose: figures come from
  ``docs/results/`` through the ``{results}`` directive, whose command is stated;
* the site builds with ``sphinx -W``.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.readme import DOCS, README, ROOT, blocks, python_blocks, run_session, sessions
from tests.test_readme_blocks import check_cli, check_links, check_scripts, cli_runs, script_runs

PAGES = sorted(DOCS.glob("*.md"))
RUNNABLE = [p for p in PAGES if sessions(p, per_heading=False)]


def test_the_pages_have_code():
    assert len(PAGES) >= 12
    assert len(RUNNABLE) >= 9


@pytest.fixture
def namespace(request):
    (session,) = sessions(DOCS / request.param, per_heading=False)
    return run_session(session)


# pages whose blocks are checked for what their comments claim (below); the others just run
CHECKED = {"stl.md", "guides.md", "adaptive.md", "index.md", "dreg.md"}


@pytest.mark.parametrize("page", [p.name for p in RUNNABLE if p.name not in CHECKED])
def test_page_runs(page):
    (session,) = sessions(DOCS / page, per_heading=False)
    run_session(session)


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["index.md"], indirect=True)
def test_index_first_fit_is_near_the_data_mean(namespace):
    median = namespace["guide"].median()["loc"].item()
    assert median == pytest.approx(namespace["x"].mean().item(), abs=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["stl.md"], indirect=True)
def test_stl_page_fits_what_its_comments_say(namespace):
    # the AutoNormal fit of the first block: the posterior of loc and scale, near the data's
    median = namespace["guide"].median()
    assert median["loc"].item() == pytest.approx(namespace["x"].mean().item(), abs=0.3)
    assert median["scale"].item() == pytest.approx(namespace["x"].std().item(), abs=0.3)
    # the mixture under stick_the_landing: its locations near -3 and 3
    m = namespace["pyro"].param("m").detach().sort().values
    assert abs(m[0] + 3) < 0.7 and abs(m[1] - 3) < 0.7


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["guides.md"], indirect=True)
def test_guides_page_gamma_factor_is_near_the_exact_posterior(namespace):
    q = namespace["q"]  # exact posterior Gamma(20, 5)
    assert q.concentration.item() == pytest.approx(20.0, rel=0.05)
    assert q.rate.item() == pytest.approx(5.0, rel=0.05)
    assert namespace["samples"]["rate"].shape[0] == 100


@pytest.mark.slow
@pytest.mark.parametrize("namespace", ["adaptive.md"], indirect=True)
def test_adaptive_page_mixture_finds_both_components(namespace):
    locs = namespace["guide"].median(namespace["data"])["locs"].detach().sort().values
    assert torch.allclose(locs, torch.tensor([-3.0, 3.0]), atol=0.7)


@pytest.mark.parametrize("namespace", ["dreg.md"], indirect=True)
def test_dreg_page_loss_is_the_negative_iwae_bound_per_batch(namespace):
    # binary images: -log p(x) >= 0 and the bound is below log p(x), so the loss is positive;
    # 20 steps from the initialisation leave it near a decoder of coin flips (64 log 2 per image)
    assert 0 < namespace["loss"] / 128 < 60


def test_blocks_that_cannot_run_here_name_their_runnable_twin():
    marked = [b for p in PAGES for b in python_blocks(p) if b.not_run]
    assert marked
    for b in marked:
        paths = re.findall(r"((?:examples|tests)/[\w/]+\.py)", b.not_run)
        assert paths, b.label
        assert all((ROOT / p).exists() for p in paths), b.label


def test_scripts_and_commands_the_pages_show():
    shell = [b for p in PAGES for b in blocks(p) if b.lang in ("bash", "console")]
    check_scripts(script_runs(shell))
    check_cli(cli_runs(shell))


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_links_between_pages(page):
    check_links((DOCS / page).read_text(), DOCS)


@pytest.mark.parametrize("page", [p.name for p in PAGES])
def test_no_typed_figures_in_tables(page):
    """Table cells hold words, code and complexities, not measured decimals or percentages."""
    for line in (DOCS / page).read_text().splitlines():
        if line.startswith("|"):
            assert not re.search(r"\d\.\d\d|\d+(\.\d+)?%|\+/-|±", line), line


def test_results_directives_name_their_command():
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"```\{results\} (\S+)\n(.*?)```", text, re.S):
            assert re.search(r":command: \S", m.group(2)), (page.name, m.group(1))
            command = re.search(r":command: (.*)", m.group(2)).group(1)
            for script in re.findall(r"(?:benchmarks/)?(bench_\w+\.py)", command):
                source = (ROOT / "benchmarks" / script).read_text()
                assert (
                    "--results" not in command
                    or "add_results_argument" in source
                    or ('"--results"' in source)
                ), f"{page.name}: {script} takes no --results ({command})"


def test_user_model_of_the_command_page_loads_like_the_console_script(tmp_path, monkeypatch):
    """The ``my_model.py`` block loads with ``--model my_model:problem`` from the current folder
    (the console script's sys.path lacks it; ``load_problem`` adds it)."""
    import os
    import sys

    (code,) = [b.code for b in python_blocks(DOCS / "command.md") if b.code.startswith("# my_")]
    (tmp_path / "my_model_cwd.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    from pyro_gradroute.app.models import load_problem

    problem = load_problem("my_model_cwd:problem")
    assert problem.heldout_args is not None and len(problem.args[0]) == 50


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    """``python -m sphinx -W``: autodoc reads every public docstring, every page and include."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", "-d",
         str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


FIGURE = re.compile(r"(?<![\w.])\d+\.\d{2,}(?![\d.])|\d%|±|\+/-|(?<![\w.])\d+(\.\d+)?x\b")


def prose(path) -> list[str]:
    """The lines of a Markdown file outside its fenced blocks."""
    out, fence = [], None
    for line in path.read_text().splitlines():
        m = re.match(r"(`{3,})", line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and line.rstrip() == fence:
            fence = None
        elif fence is None:
            out.append(line)
    return out


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_no_typed_figures_in_prose(path):
    """Measured figures (decimals, percentages, ratios, standard errors) come from results files."""
    for line in prose(path):
        text = re.sub(r"`[^`]*`", "", line)  # code spans: names, arguments, commands
        text = re.sub(
            r"\b(Python|ArviZ|torch|Pyro)( \d+(\.\d+)*(-\d+(\.\d+)*)?( to| or| and|,| /)?)+",
            "",
            text,
        )
        assert not FIGURE.search(text), f"{path.name}: {line}"
