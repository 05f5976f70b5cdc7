import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_iwae_dreg_digits_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "iwae_dreg_digits.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "paired DReG - IWAE" in out.stdout
    assert "held-out log p(x)" in out.stdout and "(smoke run: not converged)" in out.stdout
    # every figure of the smoke run is labelled, and one seed prints no nan standard error
    figures = [ln for ln in out.stdout.splitlines() if "nats" in ln]
    assert len(figures) == 5, out.stdout
    assert all(ln.endswith("(smoke run: not converged)") for ln in figures), out.stdout
    assert "nan" not in out.stdout and "nats (1 seed: no SE)" in out.stdout
