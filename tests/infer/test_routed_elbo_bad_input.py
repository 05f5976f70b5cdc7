"""Every estimator of this package (RoutedELBO's constructor, so also Trace_ELBO, which had
no check: num_particles=0 gave a loss of 0.0 and no gradient) names a bad num_particles."""

import pytest

import pyro_gradroute.infer as infer

ESTIMATORS = [infer.Trace_ELBO, infer.TraceSTL_ELBO, infer.TraceDReG_ELBO,
              infer.TraceAdaptiveSTL_ELBO, infer.TraceAdaptiveDReG_ELBO]  # fmt: skip


@pytest.mark.parametrize("n", [0, -1])
@pytest.mark.parametrize("Elbo", ESTIMATORS, ids=lambda c: c.__name__)
def test_num_particles_below_one(Elbo, n):
    with pytest.raises(ValueError, match=f"{Elbo.__name__}: num_particles must be an integer >= 1"):
        Elbo(num_particles=n)


@pytest.mark.parametrize("n", [2.5, "2", True, None])
def test_num_particles_not_an_integer(n):
    with pytest.raises(TypeError, match=r"Trace_ELBO: num_particles must be an integer >= 1"):
        infer.Trace_ELBO(num_particles=n)


def test_num_particles_positional_is_checked_too():
    with pytest.raises(ValueError, match="Trace_ELBO: num_particles"):
        infer.Trace_ELBO(0)
    assert infer.Trace_ELBO(3).num_particles == 3
