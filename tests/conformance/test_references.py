"""The matrix's hand-written references agree with Pyro's estimators where both apply."""

import pyro
import pytest
import torch
from pyro.infer import RenyiELBO, ReweightedWakeSleep

from .cases import BY_NAME
from .checks import K, _hand, cell, grad_of, seeded


@pytest.mark.parametrize("name", ["amortized", "nested_plates", "chain3", "AutoNormal"])
def test_hand_iwae_is_renyi(name):
    case = BY_NAME[name]
    with cell(case) as c:
        renyi = RenyiELBO(
            alpha=0,
            num_particles=K,
            max_plate_nesting=case.max_plate_nesting,
            vectorize_particles=True,
        )
        for seed in range(2):
            loss, g = seeded(
                seed, lambda: grad_of(c, lambda: renyi.loss_and_grads(c.model, c.guide, *c.args))
            )

            def hand():
                value, surrogate = _hand(c, c.model, c.guide, rws=False)
                (-surrogate).backward()
                return value

            hloss, hg = seeded(seed, lambda: grad_of(c, hand))
            assert hloss == pytest.approx(loss, rel=1e-12)
            torch.testing.assert_close(hg, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["AutoNormal", "chain3", "aux_reparam"])
def test_hand_rws_is_pyro_rws(name):
    """Without plates that hold every site, per-point weights are Pyro's global weights."""
    case = BY_NAME[name]
    with cell(case) as c:
        rws = ReweightedWakeSleep(
            num_particles=K,
            insomnia=1.0,
            max_plate_nesting=case.max_plate_nesting,
            vectorize_particles=True,
        )
        for seed in range(2):
            _, g = seeded(
                seed, lambda: grad_of(c, lambda: rws.loss_and_grads(c.model, c.guide, *c.args))
            )

            def hand():
                _, surrogate = _hand(c, c.model, c.guide, rws=True)
                (-surrogate).backward()

            _, hg = seeded(seed, lambda: grad_of(c, hand))
            torch.testing.assert_close(hg, g, rtol=1e-10, atol=1e-12)


def test_hand_iwae_with_scale_outside():
    """subsample_all's reference: per-point bounds of unscaled log-densities, times N/b."""
    case = BY_NAME["subsample_all"]
    with cell(case) as c:
        renyi = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=1, vectorize_particles=True)
        pyro.set_rng_seed(0)
        ((mt, gt),) = list(renyi._get_traces(c.model, c.guide, c.args, {}))
        s = case.outer_scale
        lw = sum(x["log_prob"] for x in mt.nodes.values() if x["type"] == "sample") - sum(
            x["log_prob"] for x in gt.nodes.values() if x["type"] == "sample"
        )
        expected = s * (torch.logsumexp(lw / s, 0) - torch.log(torch.tensor(float(K)))).sum()
        assert seeded(0, lambda: _hand(c, c.model, c.guide, rws=False))[0] == pytest.approx(
            -expected.item(), rel=1e-12
        )
