"""The supported Pythons, torch and ArviZ lines: setup.cfg, the README's install section, the
nox sessions and CI's compat stage say the same, and the running Python is one of them."""

import ast
import configparser
import re
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("## Installing", 1)[1].split("\n## ", 1)[0]


def test_python_requires_classifiers_and_the_running_python_agree():
    cfg = _cfg()
    assert cfg["options"]["python_requires"].strip() == ">=3.10"
    classifiers = cfg["metadata"]["classifiers"]
    listed = re.findall(r"Programming Language :: Python :: (3\.\d+)", classifiers)
    assert listed == PYTHONS
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in PYTHONS


def test_torch_range_is_the_tested_ends():
    """2.13.0 (the on-disk build, constraints.txt, Python 3.11) and 2.14.1 (the registry's,
    CI's compat stage) are in the range; the releases around them are not."""
    (torch_req,) = [r for r in _cfg()["options"]["install_requires"].split() if "torch" in r]
    spec = SpecifierSet(torch_req.removeprefix("torch"))
    assert "2.13.0" in spec and "2.14.1" in spec
    assert "2.12.1" not in spec and "2.15.0" not in spec
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()


def test_readme_nox_and_ci_name_the_same_pythons():
    section = _install_section()
    assert "Python 3.10, 3.11, 3.12 and 3.13" in section and "`python_requires = >=3.10`" in section
    nox = ast.parse((ROOT / "noxfile.py").read_text())
    (pythons,) = [
        ast.literal_eval(node.value)
        for node in nox.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PYTHONS"
    ]
    assert pythons == PYTHONS
    ci = (ROOT / ".ci" / "run").read_text()
    assert "for v in 3.12 3.13; do" in ci and 'pip" install -q -e ".[test]"' in ci
    assert "-c constraints.txt" not in ci  # the compat stage installs as a user would


def test_the_package_parses_as_python_3_10():
    """No syntax newer than the oldest supported Python (3.11's except*, 3.12's generics)."""
    for path in sorted((ROOT / "pyro_gradroute").rglob("*.py")):
        ast.parse(path.read_text(), str(path), feature_version=(3, 10))
