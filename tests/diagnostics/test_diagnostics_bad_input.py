"""Bad arguments to the diagnostics: a clear error naming the argument, raised before any
work (they were silently accepted, or failed deep inside with an error naming nothing)."""

import math

import pyro
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from pyro_gradroute.diagnostics import (
    compare_gradients,
    gradient_stats,
    pareto_khat,
    psis_khat,
)
from pyro_gradroute.diagnostics.heldout import heldout_log_likelihood
from pyro_gradroute.infer import Trace_ELBO

from .models import gaussian


@pytest.fixture
def setup():
    pyro.clear_param_store()
    x = torch.randn(5, generator=torch.Generator().manual_seed(0))
    guide = AutoNormal(gaussian)
    guide(x)  # create the parameters
    return gaussian, guide, x


def _untouched(fn):
    """``fn()`` raises, and it drew no random number (no model or guide run) on the way."""
    state = torch.get_rng_state()
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)

    with pytest.raises((TypeError, ValueError)) as info:
        fn(spy)
    assert not calls, "the model ran before the argument was checked"
    assert torch.equal(torch.get_rng_state(), state)
    return info


@pytest.mark.parametrize("nesting", [-1, 1.5, "1"])
def test_psis_khat_max_plate_nesting(nesting):
    info = _untouched(lambda spy: psis_khat(spy, spy, max_plate_nesting=nesting))
    assert "psis_khat: max_plate_nesting must be an integer" in str(info.value)


@pytest.mark.parametrize("rtol", [-1.0, math.nan, "1e-6", math.inf])
def test_pareto_khat_rtol(rtol):
    with pytest.raises((TypeError, ValueError), match="pareto_khat: rtol must be"):
        pareto_khat(torch.randn(100), rtol=rtol)


@pytest.mark.parametrize("n", [2.5, 1, "10", True])
def test_gradient_stats_num_draws(setup, n):
    model, guide, x = setup
    with pytest.raises((TypeError, ValueError), match="gradient_stats: num_draws must be"):
        gradient_stats(model, guide, Trace_ELBO(), x, num_draws=n)


def test_gradient_stats_the_class_instead_of_an_instance_is_named(setup):
    model, guide, x = setup
    before = {n: p.detach().clone() for n, p in pyro.get_param_store().items()}
    with pytest.raises(TypeError, match=r"gradient_stats: elbo must be an ELBO instance, not the "
                                        r"class: pass Trace_ELBO\(\)"):  # fmt: skip
        gradient_stats(model, guide, pyro.infer.Trace_ELBO, x, num_draws=3)
    after = dict(pyro.get_param_store().items())
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_gradient_stats_none_instead_of_an_elbo_is_named(setup):
    model, guide, x = setup
    with pytest.raises(TypeError, match="gradient_stats: elbo must be an ELBO instance"):
        gradient_stats(model, guide, None, x, num_draws=3)


def test_compare_gradients_needs_a_dict_of_elbos(setup):
    model, guide, x = setup
    with pytest.raises(TypeError, match=r"compare_gradients: elbos .* must be a dict"):
        compare_gradients(model, guide, [Trace_ELBO()], x, num_draws=3)
    with pytest.raises(TypeError, match=r"compare_gradients: elbos\['t'\] must be an ELBO"):
        compare_gradients(model, guide, {"t": Trace_ELBO}, x, num_draws=3)


def test_heldout_method_is_checked_before_any_work():
    info = _untouched(lambda spy: heldout_log_likelihood(spy, spy, (), (), method="loo"))
    assert "heldout_log_likelihood: method must be one of 'predictive', 'marginal'" in str(
        info.value
    )


def test_an_error_in_a_draw_is_not_masked_by_the_clean_up(setup):
    """The draw's own error is raised, not one from restoring the state afterwards."""
    model, guide, x = setup

    class Broken:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            raise AttributeError("restoring failed too")

        def loss_and_grads(self, *args, **kwargs):
            raise RuntimeError("the draw's own error")

    with pytest.raises(RuntimeError, match="the draw's own error"):
        gradient_stats(model, guide, Broken(), x, num_draws=3)
