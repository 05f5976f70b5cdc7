"""The whole test suite on each supported Python: ``nox`` (all four) or ``nox -s tests-3.12``.

Each session is a fresh virtualenv with ``pip install -e ".[test]"``, so it resolves torch and
ArviZ as a user's ``pip install`` would on that Python (ArviZ 1.x on 3.12 and 3.13; on this
project's machines pip's own constraint caps torch at 2.14.1). ``nox -s tests-3.11 -- -x
tests/diagnostics`` passes arguments on to pytest.
"""

import glob
import os

import nox

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]  # setup.cfg's classifiers (test_python_versions.py)

# pyenv's interpreters (as on this project's machines) are found without `pyenv shell`;
# appended, so a python3.X already on PATH comes first
_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
for _v in PYTHONS:
    for _bin in sorted(glob.glob(os.path.join(_root, "versions", f"{_v}.*", "bin")))[-1:]:
        os.environ["PATH"] += os.pathsep + _bin

nox.options.reuse_existing_virtualenvs = True


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    versions = "import arviz, torch; print('arviz', arviz.__version__, 'torch', torch.__version__)"
    session.run("python", "-c", versions)
    session.run("python", "-m", "pytest", "-q", *session.posargs, env={"OMP_NUM_THREADS": "1"})
