"""block_grad: bad input, warnings, and the gated distribution's transparency."""

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import infer as pinfer
from pyro.nn import PyroModule

from pyro_gradroute import infer as rinfer
from pyro_gradroute.poutine import block_grad
from pyro_gradroute.poutine.block_grad_messenger import BlockSpec, GatedDistribution

from ..routing.reference import assert_rel_close, naive_grads
from .models import Seed

BOTH = [rinfer.Trace_ELBO, pinfer.Trace_ELBO]


@pytest.mark.parametrize("elbo_cls", BOTH)
def test_missing_site_names_it_and_lists_seen(elbo_cls):
    s = Seed()
    with pytest.raises(ValueError, match=r"\['loss3'\] never occurred.*'loss1', 'loss2', 'z'"):
        elbo_cls().loss_and_grads(block_grad(s.model, sites=["loss3"], modules=["B"]), s.guide)


@pytest.mark.parametrize("elbo_cls", BOTH)
def test_unknown_module_lists_available(elbo_cls):
    s = Seed()
    with pytest.raises(ValueError, match=r"module 'b' matches no parameter.*\['A', 'B', 'q_loc'"):
        elbo_cls().loss_and_grads(block_grad(s.model, sites=["loss2"], modules=["b"]), s.guide)


@pytest.mark.parametrize("spec", ["C$$$*", "q_locc", lambda n: False])
def test_unknown_param_lists_available(spec):
    s = Seed()
    with pytest.raises(ValueError, match=r"param .* matches no parameter.*'A\$\$\$0.bias'"):
        rinfer.Trace_ELBO().loss_and_grads(
            block_grad(s.model, sites=["loss2"], params=spec), s.guide
        )


def test_constructor_errors():
    with pytest.raises(ValueError, match="nothing to block"):
        block_grad(sites=["x"])
    with pytest.raises(ValueError, match="at least one site"):
        block_grad(sites=[], modules=["B"])
    with pytest.raises(TypeError, match="site names"):
        block_grad(sites=[1], modules=["B"])


@pytest.mark.parametrize("elbo_cls", BOTH)
def test_blocking_site_without_gradient_is_fine(elbo_cls):
    def model():
        pyro.module("lin", lin)
        pyro.factor("const", torch.tensor(1.5))
        pyro.factor("f", lin(torch.ones(1)).sum())

    lin = torch.nn.Linear(1, 1)
    elbo_cls().loss_and_grads(block_grad(model, sites=["const"], modules=["lin"]), lambda: None)
    assert lin.weight.grad is not None and lin.weight.grad.item() != 0


def test_param_blocked_from_every_term_warns():
    s = Seed()
    routed = block_grad(s.model, sites=["loss1", "loss2"], modules=["B"])
    with pytest.warns(UserWarning, match=r"B\$\$\$0.weight.*never train"):
        rinfer.Trace_ELBO().loss_and_grads(routed, s.guide)


@pytest.mark.filterwarnings("ignore:Encountered NaN")
def test_nan_at_blocked_site_is_named():
    def model():
        pyro.module("lin", lin)
        loc = lin(torch.ones(1)) * float("nan")
        pyro.sample("x", dist.Normal(loc, 1.0, validate_args=False), obs=torch.zeros(1))

    lin = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="NaN log-density at model site 'x'"):
        rinfer.Trace_ELBO().loss_and_grads(
            block_grad(model, sites="x", modules=[lin]), lambda: None
        )


def test_gated_distribution_is_transparent():
    loc = torch.zeros(3, requires_grad=True)
    base = dist.Normal(loc, 1.0).to_event(1)
    d = GatedDistribution(base, [BlockSpec(frozenset({"x"}), (), (loc,))])
    assert d.has_rsample and d.event_shape == (3,) and d.batch_shape == ()
    assert repr(d.support) == repr(base.support) and torch.equal(d.mean, base.mean)
    e = d.expand([2])
    assert isinstance(e, GatedDistribution) and e.batch_shape == (2,)
    assert d.rsample([4]).shape == (4, 3)
    value = torch.ones(3)
    assert torch.equal(d.log_prob(value), base.log_prob(value))
    d.log_prob(value).sum().backward()  # loc was the only leaf: fully blocked
    assert loc.grad is None
    c = GatedDistribution(dist.Bernoulli(torch.tensor(0.3)), [])
    assert torch.equal(c.enumerate_support(), torch.tensor([0.0, 1.0]))
    assert GatedDistribution.wrap(d, d.specs[0]).specs == d.specs * 2


def test_user_infer_dict_is_not_mutated():
    infer = {"foo": 1}
    s = Seed()

    def model():
        s.model()
        pyro.sample("w", dist.Normal(0.0, 1.0), obs=torch.tensor(0.0), infer=infer)

    rinfer.Trace_ELBO().loss_and_grads(
        block_grad(model, sites=["w", "loss2"], modules=["B"]), s.guide
    )
    assert infer == {"foo": 1}


class _Net(PyroModule):
    def __init__(self):
        super().__init__()
        self.fc = PyroModule[torch.nn.Linear](2, 2)
        self.head = PyroModule[torch.nn.Linear](2, 1)

    def forward(self, x):
        h = self.fc(x)
        pyro.factor("a", -h.pow(2).sum())
        pyro.factor("b", -self.head(h).pow(2).sum())


@pytest.mark.parametrize("elbo_cls", BOTH)
def test_pyro_module_dotted_names(elbo_cls):
    """PyroModule params are named ``fc.weight``...: ``modules=["fc"]`` blocks them."""
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(3, 2)
    elbo_cls().loss_and_grads(block_grad(net, sites="b", modules="fc"), lambda x: None, x)
    fc, head = net.fc, net.head
    fc_params, head_params = [fc.weight, fc.bias], [head.weight, head.bias]

    def forward():
        h = torch.nn.functional.linear(x, fc.weight, fc.bias)
        out = torch.nn.functional.linear(h, head.weight, head.bias)
        return {"a": h.pow(2).sum(), "b": out.pow(2).sum()}

    want = naive_grads(forward, fc_params + head_params, {"b": fc_params})
    store = pyro.get_param_store()._params
    for name, p in zip(["fc.weight", "fc.bias", "head.weight", "head.bias"], want):
        assert_rel_close(store[name].grad, want[p], what=name)


def test_constrained_param_value_is_refused_with_the_name_to_use():
    s = Seed()
    rinfer.Trace_ELBO().loss_and_grads(s.model, s.guide)
    scale = pyro.param("q_scale")  # constrained: exp of the stored leaf
    with pytest.raises(ValueError, match="non-leaf.*'q_scale'"):
        rinfer.Trace_ELBO().loss_and_grads(s.model, block_grad(s.guide, sites="z", params=[scale]))
