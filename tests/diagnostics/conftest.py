import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """These models are tiny: one torch thread avoids contention on shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
