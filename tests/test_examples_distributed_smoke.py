"""examples/distributed_vae.py --smoke on one process: its 3 small steps time nothing, so it
prints no speed-up figure (it printed "speed-up 0.01x"), saying why instead."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_smoke_run_prints_no_speed_up_figure():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distributed_vae.py"), "--smoke", "--timeout=30"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("speed-up ")]
    assert "not measured" in line and "too small to time (run without --smoke)" in line
    assert not re.search(r"\d+\.\d+x", line), line
