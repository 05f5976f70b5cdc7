"""The README's routing section: its ```python snippets run as written."""

import pytest

from tests.readme import python_snippets


def snippets() -> list[str]:
    return python_snippets("routing")


def test_two_snippets():
    assert len(snippets()) == 2


@pytest.mark.parametrize("index", [0, 1])
def test_snippet_runs(index):
    exec(compile(snippets()[index], f"README routing snippet {index + 1}", "exec"), {})
