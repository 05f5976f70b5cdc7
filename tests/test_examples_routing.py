"""The routing examples run (``--smoke``) and pass their own exactness checks."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, expected",
    [
        ("nested_networks_routing.py", "routed vs two-pass: max relative difference"),
        ("vae_aux_loss_routing.py", "decoder gradient, routed vs without the label site"),
    ],
)
def test_routing_example_smoke(script, expected):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout
