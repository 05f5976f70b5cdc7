import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_pyro():
    """Every test starts with an empty param store, a fixed seed and validation on."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    pyro.enable_validation(True)
    torch.set_default_dtype(torch.float32)
    yield
    pyro.clear_param_store()
