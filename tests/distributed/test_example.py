"""The README recipe end to end: ``torchrun --nproc_per_node=2 examples/distributed_vae.py --smoke``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_distributed_vae_example_under_torchrun():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(ROOT / "examples" / "distributed_vae.py"),
        "--smoke",
        "--timeout=30",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines() if "Warning" not in line]
    assert proc.returncode == 0, proc.stdout[-2000:] + "\n".join(errors)[:6000]
    out = proc.stdout
    assert "1 process  (1 thread):" in out and "2 processes (1 thread each):" in out
    assert "communication share" in out
    assert "params identical across ranks: True" in out
    # the smoke run's untrained losses and 3-step times are labelled; two ranks: a comparison
    for prefix in ("1 process  (", "2 processes (", "speed-up "):
        (line,) = [ln for ln in out.splitlines() if ln.startswith(prefix)]
        assert "(smoke run: not converged)" in line, line
    assert "one process: nothing to compare" not in out


@pytest.mark.slow
def test_lightning_example_smoke_on_two_cpu_ranks():
    """``python examples/lightning_svi.py --smoke``: Trainer(accelerator="cpu", devices=2,
    strategy="ddp"). ``pytorch-lightning`` is in the ``test`` extra (CI installs it), so this
    runs in every suite run (~10-20 s on 2 shared cores)."""
    import pytorch_lightning  # noqa: F401  (the test extra has it: an ImportError is a failure)

    cmd = [sys.executable, str(ROOT / "examples" / "lightning_svi.py"), "--smoke"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = proc.stdout
    assert "2 rank(s), stl, N=1000, b=50 per rank, 10 steps" in out
    assert "(smoke run: not converged)" in out
    assert "params identical across ranks: True" in out
