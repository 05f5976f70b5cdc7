"""Read the README's ```python snippets, section by section (``<!-- section: NAME -->`` markers)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(name: str) -> str:
    text = README.read_text()
    start = text.index(f"<!-- section: {name} -->")
    return text[start : text.index("<!-- section:", start + 1)]


def python_snippets(name: str, prefix: str = "") -> list[str]:
    """The ```python blocks of section ``name`` (optionally only those starting with ``prefix``)."""
    return re.findall(r"```python\n(" + re.escape(prefix) + r".*?)```", section(name), flags=re.S)


def run_snippet(code: str, label: str) -> dict:
    namespace: dict = {"__name__": label.replace(" ", "_")}
    exec(compile(code, label, "exec"), namespace)
    return namespace


def stated_output(code: str, statement: str) -> str:
    """What the snippet says its line starting with ``statement`` prints: the ``  # `` comment."""
    (line,) = [ln for ln in code.splitlines() if ln.startswith(statement)]
    return line.split("  # ", 1)[1].strip()
