"""The README's guides section: its ```python snippets run as written and print what they claim."""

import pytest

from tests.readme import python_snippets, stated_output


def snippets() -> list[str]:
    return python_snippets("guides")


def test_two_snippets():
    assert len(snippets()) == 2


def test_parametrized_snippet(capsys):
    exec(compile(snippets()[0], "README guides snippet 1", "exec"), {})
    assert "['gamma.concentration', 'gamma.rate', 'lognormal.loc'" in capsys.readouterr().out


def test_auto_mean_field_snippet(capsys):
    code = snippets()[1]
    namespace: dict = {}
    exec(compile(code, "README guides snippet 2", "exec"), namespace)
    # the snippet is seeded: its first print shows exactly what its comment says
    printed = capsys.readouterr().out.splitlines()[0]
    assert printed == stated_output(code, "print(round(q.concentration.item(), 2)")
    q = namespace["q"]
    assert q.concentration.item() == pytest.approx(20.0, rel=0.05)
    assert q.rate.item() == pytest.approx(5.0, rel=0.05)
    assert namespace["samples"]["rate"].shape[0] == 100
