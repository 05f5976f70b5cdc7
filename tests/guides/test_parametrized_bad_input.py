"""ParametrizedDistribution and AutoMeanField: bad arguments are clear errors naming them,
raised by the constructor (they were silently accepted: event_dim=1.5 truncated to 1,
event_dim=-1, a non-string name, init_scale=inf)."""

import math

import pyro
import pyro.distributions as dist
import pytest

from pyro_gradroute.guides import AutoMeanField, ParametrizedDistribution


@pytest.mark.parametrize("event_dim", [-1, 1.5, "1", True])
def test_event_dim_must_be_a_non_negative_integer(event_dim):
    with pytest.raises((TypeError, ValueError), match=r"event_dim must be an integer >= 0"):
        ParametrizedDistribution("q", dist.Normal, loc=0.0, scale=1.0, event_dim=event_dim)


@pytest.mark.parametrize("name", [3, None, ("q",)])
def test_name_must_be_a_string(name):
    with pytest.raises(TypeError, match=r"ParametrizedDistribution: name must be a string"):
        ParametrizedDistribution(name, dist.Normal, loc=0.0, scale=1.0)


def test_fixed_must_be_a_dict():
    with pytest.raises(TypeError, match=r"fixed must be a dict or None; got \[1.0\]"):
        ParametrizedDistribution("q", dist.Normal, loc=0.0, fixed=[1.0])


def model():
    pyro.sample("z", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize("scale", [math.inf, math.nan, 0.0, -1.0, "0.1", True])
def test_init_scale_must_be_a_positive_finite_number(scale):
    with pytest.raises((TypeError, ValueError), match=r"AutoMeanField: init_scale must be"):
        AutoMeanField(model, init_scale=scale)
