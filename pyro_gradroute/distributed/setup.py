"""Process-group setup for data-parallel SVI: :func:`init_distributed`."""

from __future__ import annotations

import datetime
import importlib
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_BUCKET_CAP_MB = 25.0


def init_distributed(timeout_s: float = 120.0, backend: str | None = None) -> torch.device:
    r"""Join the process group ``torchrun`` describes, or make a group of one process.

    Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
    this is ``torch.distributed.init_process_group(backend, timeout=...)``; without them
    it creates a world of one process on 127.0.0.1 (a free port), so the same script runs
    alone with ``python script.py``. ``backend`` defaults to ``"nccl"`` when CUDA is
    available (one GPU per process: ``cuda:LOCAL_RANK``) and ``"gloo"`` otherwise. The
    timeout bounds every collective: a rank that crashed makes the others fail after at
    most ``timeout_s`` seconds instead of hanging.

    :returns: the device this process should compute on.

    Example::

        >>> import torch.distributed as dist
        >>> from pyro_gradroute.distributed import init_distributed
        >>> device = init_distributed(timeout_s=60)
        >>> dist.get_world_size(), device
        (1, device(type='cpu'))
        >>> dist.destroy_process_group()
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if "RANK" not in os.environ:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        kwargs.update(init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    # torch.optim's first step imports torch._dynamo; imported while a group exists, it keeps
    # a reference to that group past destroy_process_group, and the group's gloo threads are
    # then torn down at interpreter exit, which can abort the process ("terminate called
    # without an active exception"). Imported before the group exists, it holds none.
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, **kwargs)
    return device
