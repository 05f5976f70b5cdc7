"""AutoMeanField: a family instance or a non-dict init_params entry is a clear error, raised early."""

import pyro
import pyro.distributions as dist
import pytest

from pyro_gradroute.guides import AutoMeanField


def model():
    pyro.sample("z", dist.Normal(0.0, 1.0))


def test_family_instance_is_a_clear_error():
    with pytest.raises(
        TypeError, match=r"got an instance .*pass the class itself \(family=Normal\)"
    ):
        AutoMeanField(model, family=dist.Normal(0.0, 1.0))


def test_init_params_entry_must_be_a_dict():
    with pytest.raises(TypeError, match=r"init_params\['z'\] must be a dict \{arg: constrained"):
        AutoMeanField(model, init_params={"z": 1.0})
    with pytest.raises(TypeError, match="init_params must be a dict"):
        AutoMeanField(model, init_params=[("z", {"loc": 0.0})])
