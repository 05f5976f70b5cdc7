"""``normal_pushforward`` reads a ``Normal`` through parameter-free bijections only: a
``ComposeTransform`` whose parts hold parameters is not one (its score part lives there)."""

import pyro.distributions as dist
import torch

from pyro_gradroute.distributions.normal import normal_pushforward


def test_compose_transform_with_parameters_is_not_a_pushforward():
    loc = torch.tensor(0.2, requires_grad=True)
    t = dist.transforms.ComposeTransform(
        [dist.transforms.AffineTransform(loc, 0.6), dist.transforms.ExpTransform()]
    )
    fn = dist.TransformedDistribution(dist.Normal(torch.zeros(()), 1.0), t)
    assert normal_pushforward(fn)[0] is None


def test_parameter_free_compose_transform_is_read_through():
    t = dist.transforms.ComposeTransform(
        [dist.transforms.AffineTransform(1.0, 2.0), dist.transforms.ExpTransform()]
    )
    base = dist.Normal(torch.tensor(0.5, requires_grad=True), 1.0)
    got, n, ts = normal_pushforward(dist.TransformedDistribution(base, t))
    assert got is base and n == 0
    assert [type(x).__name__ for x in ts] == ["AffineTransform", "ExpTransform"]
