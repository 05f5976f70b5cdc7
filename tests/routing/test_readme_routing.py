"""The README's routing section: its ```python snippets run as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def snippets() -> list[str]:
    text = README.read_text()
    start = text.index("<!-- section: routing -->")
    section = text[start : text.index("<!-- section:", start + 1)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_two_snippets():
    assert len(snippets()) == 2


@pytest.mark.parametrize("index", [0, 1])
def test_snippet_runs(index):
    exec(compile(snippets()[index], f"README routing snippet {index + 1}", "exec"), {})
