"""``{results}`` directive: include a generated results file from ``docs/results/``.

Every measured figure in these pages comes from a file a benchmark writes (with its command,
date, commit and machine load). The directive includes that file as MyST Markdown; where the
file has not been generated in this checkout it says so and names the command that writes it,
so a page never shows a figure that no command produced::

    ```{results} convergence.md
    :command: cd benchmarks && python bench_convergence.py --quick
    ```
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

RESULTS = Path(__file__).resolve().parents[1] / "results"


class Results(SphinxDirective):
    required_arguments = 1
    has_content = False
    option_spec = {"command": directives.unchanged_required}

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        path = RESULTS / name
        command = self.options["command"]
        container = nodes.container(classes=["results"])
        if path.exists():
            self.env.note_dependency(str(path))
            text = path.read_text()
            lines = StringList(text.splitlines(), source=str(path))
        else:
            lines = StringList(
                [
                    f"*`docs/results/{name}` has not been generated in this checkout.* "
                    f"Run `{command}` to write it.",
                ],
                source=str(path),
            )
        self.state.nested_parse(lines, 0, container)
        return [container]


def setup(app):
    app.add_directive("results", Results)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
