"""The library never imports the app: importing every library module loads no ``app`` module."""

import pkgutil
import subprocess
import sys

import pyro_gradroute

LIBRARY = sorted(
    m.name
    for m in pkgutil.walk_packages(pyro_gradroute.__path__, "pyro_gradroute.")
    if not m.name.startswith("pyro_gradroute.app") and not m.name.endswith("__main__")
)


def test_library_modules_do_not_import_the_app():
    assert "pyro_gradroute.infer" in LIBRARY and "pyro_gradroute.diagnostics" in LIBRARY
    code = (
        "import importlib, sys\n"
        f"for name in {LIBRARY!r}:\n    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('pyro_gradroute.app')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
