"""The supported Python versions the README states are what setup.cfg requires, and this one."""

import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_python_requires_matches_the_readme_and_the_running_python():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    requires = cfg["options"]["python_requires"].strip()
    assert requires == ">=3.11,<3.12"
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"Supported Python: 3\.11 .*`python_requires = >=3\.11,<3\.12`", readme)
    assert sys.version_info[:2] == (3, 11)
    assert "Programming Language :: Python :: 3.11" in cfg["metadata"]["classifiers"]
