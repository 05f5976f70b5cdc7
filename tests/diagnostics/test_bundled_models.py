import math

import pyro.distributions as dist
import pytest

from pyro_gradroute.diagnostics.compare import compare_estimators, format_table
from pyro_gradroute.models.registry import MODELS, load_problem


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_bundled_model_runs_through_compare(name):
    (r,) = compare_estimators(name, ["stl"], steps=2, snr_draws=2, num_samples=20, progress=False)
    assert len(r.losses) == 2 and math.isfinite(r.elbo) and math.isfinite(r.log_px)
    assert (r.heldout_ll is not None) == (load_problem(name).heldout_args is not None)
    assert r.idata["posterior"] is not None and r.grads.guide_params
    assert format_table([r]).splitlines()[2].startswith("stl")


def test_swap_family_changes_one_argument():
    from pyro_gradroute.models.swap_family import problem

    for family in (dist.Gamma, dist.LogNormal, dist.Normal):
        assert isinstance(problem(family).guide.q(), family)
    with pytest.raises(ValueError, match="choose one of"):
        problem(dist.Beta)
