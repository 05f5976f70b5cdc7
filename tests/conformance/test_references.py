"""The matrix's hand-written references agree with Pyro's estimators where both apply."""

import pyro
import pytest
import torch
from pyro.infer import RenyiELBO, ReweightedWakeSleep, Trace_ELBO
from pyro.poutine.messenger import Messenger

from . import checks
from .cases import BY_NAME
from .checks import (
    K,
    _hand,
    cell,
    dreg_reference_grad,
    grad_of,
    ours,
    pyro_trace,
    reference_grad,
    seeded,
    stl_reference_grad,
)


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


class _DetachDraws(Messenger):
    """The guide reads its own draws detached: a conditional density holds earlier draws fixed."""

    def _postprocess_message(self, msg):
        if msg["type"] == "sample" and not msg["is_observed"]:
            msg["value"] = msg["value"].detach()


@pytest.mark.parametrize("name", ["AutoNormal", "chain3", "aux_reparam"])
def test_hand_rws_is_pyro_rws(name):
    """Without plates that hold every site, per-point weights are Pyro's global weights; and
    wake-phi holds every draw fixed. Pyro's ReweightedWakeSleep detaches the traced values
    only, so on a conditional guide (chain3, aux_reparam's z given u) its densities keep the
    path through the earlier draws, a different expectation: the reference is Pyro's
    estimator on the guide that reads its draws detached."""
    case = BY_NAME[name]
    with cell(case) as c:
        rws = ReweightedWakeSleep(
            num_particles=K,
            insomnia=1.0,
            max_plate_nesting=case.max_plate_nesting,
            vectorize_particles=True,
        )
        fixed = _DetachDraws()(c.guide)
        for seed in range(2):
            _, g = seeded(
                seed, lambda: grad_of(c, lambda: rws.loss_and_grads(c.model, fixed, *c.args))
            )
            _, g_plain = seeded(
                seed, lambda: grad_of(c, lambda: rws.loss_and_grads(c.model, c.guide, *c.args))
            )
            assert torch.allclose(g, g_plain) == (name == "AutoNormal")  # (the others read u, z0)

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


# ---------------------------------------------------------------- the same-draw references


def _chain2_stl_by_hand(c, seed):
    """chain2's STL gradient written out: ``z0 ~ N(b0, s0)``, ``z1 ~ N(b1 + c1 z0, s1)``.

    The draws are Pyro's ``Trace_ELBO``'s on ``seed`` (8 vectorized particles); the surrogate is
    ``-mean_k [log p(x, z_k) - log N(z0_k; b0, s0) - log N(z1_k; b1 + c1 z0_k, s1)]`` with every
    guide parameter in the log-densities detached (the path through ``z0`` kept), in float64.
    """
    m = BY_NAME["chain2"]
    elbo = pyro_trace("STL", m)
    rec = pyro.poutine.trace(c.guide)

    def run():
        ((_, _),) = list(elbo._get_traces(c.model, rec, c.args, {}))
        z0, z1 = rec.trace.nodes["z0"]["value"], rec.trace.nodes["z1"]["value"]
        p = {n: pyro.param(n) for n in ("chain_a", "q_b0", "q_s0", "q_b1", "q_s1", "q_c1")}
        d = {n: v.detach() for n, v in p.items()}
        x = c.model.__self__.x
        sx = c.model.__self__.sx
        N = torch.distributions.Normal
        log_p = (
            N(0.0, 1.0).log_prob(z0)
            + N(p["chain_a"] * z0, 1.0).log_prob(z1)
            + N(z0, sx).log_prob(x[0])
            + N(z1, sx).log_prob(x[1])
        )
        log_q = N(d["q_b0"], d["q_s0"]).log_prob(z0) + N(
            d["q_b1"] + d["q_c1"] * z0, d["q_s1"]
        ).log_prob(z1)
        (-(log_p - log_q).mean()).backward()

    return seeded(seed, lambda: grad_of(c, run))[1]


def test_stl_reference_is_the_hand_written_surrogate():
    """On a conditional guide, the generic STL reference (Pyro's surrogate minus the detached
    replay's score part) equals the surrogate written out by hand, and both equal TraceSTL_ELBO."""
    case = BY_NAME["chain2"]
    with cell(case) as c:
        for seed in range(2):
            hand = _chain2_stl_by_hand(c, seed)
            ref = stl_reference_grad(c, "STL", seed, c.model, c.guide)
            torch.testing.assert_close(ref, hand, rtol=1e-12, atol=1e-12)
            ours_ = seeded(
                seed,
                lambda: grad_of(c, lambda: ours("STL", case).loss_and_grads(c.model, c.guide)),
            )[1]
            torch.testing.assert_close(ours_, hand, rtol=1e-10, atol=1e-10)
            trace = reference_grad(c, "Trace", seed, c.model, c.guide)
            assert (trace - hand)[c.guide_only].abs().max() > 1e-2  # STL is not Trace_ELBO


def _dreg_by_hand(c, seed, rws):
    """chain1 (one site ``z ~ N(b, s)``): DReG-IWAE / RWS-DReG written out on RenyiELBO's draws."""
    elbo = RenyiELBO(alpha=0, num_particles=K, max_plate_nesting=1, vectorize_particles=True)
    rec = pyro.poutine.trace(c.guide)
    N = torch.distributions.Normal

    def run():
        list(elbo._get_traces(c.model, rec, c.args, {}))
        z = rec.trace.nodes["z0"]["value"]
        b, s = pyro.param("q_b0"), pyro.param("q_s0")
        x, sx = c.model.__self__.x, c.model.__self__.sx
        log_p = N(0.0, 1.0).log_prob(z) + N(z, sx).log_prob(x[0])
        lw_path = log_p - N(b.detach(), s.detach()).log_prob(z)  # guide params detached
        w = torch.softmax(lw_path.detach(), 0)
        f = w - w**2 if rws else w**2
        (-(f * lw_path).sum()).backward()

    return seeded(seed, lambda: grad_of(c, run))[1]


@pytest.mark.parametrize("est", ["DReGK", "RWS"])
def test_dreg_reference_is_the_hand_written_surrogate(est):
    case = BY_NAME["chain1"]
    with cell(case) as c:
        for seed in range(2):
            hand = _dreg_by_hand(c, seed, rws=est == "RWS")
            ref = dreg_reference_grad(c, est, seed, c.model, c.guide)
            torch.testing.assert_close(
                ref[c.guide_only], hand[c.guide_only], rtol=1e-12, atol=1e-12
            )
            ours_ = seeded(
                seed, lambda: grad_of(c, lambda: ours(est, case).loss_and_grads(c.model, c.guide))
            )[1]
            torch.testing.assert_close(ours_, ref, rtol=1e-10, atol=1e-10)


class _Broken:
    """An estimator that is Pyro's own one where ours should differ: same mean, other draws."""

    def __init__(self, est, case):
        mpn = case.max_plate_nesting
        if est == "STL":
            self.elbo = Trace_ELBO(
                num_particles=case.particles, vectorize_particles=True, max_plate_nesting=mpn
            )
        elif est == "DReGK":
            self.elbo = RenyiELBO(
                alpha=0, num_particles=K, vectorize_particles=True, max_plate_nesting=mpn
            )
        else:
            self.elbo = ReweightedWakeSleep(
                num_particles=K, insomnia=1.0, vectorize_particles=True, max_plate_nesting=mpn
            )

    def loss_and_grads(self, *a, **k):
        return self.elbo.loss_and_grads(*a, **k)


@pytest.mark.parametrize("est", ["STL", "DReGK", "RWS"])
@pytest.mark.parametrize("name", ["AutoNormal", "chain3", "amortized"])
def test_grad_cell_fails_for_another_estimator(monkeypatch, name, est):
    """A grad cell fails when the estimator is replaced by an unbiased one with other draws
    (Trace_ELBO for STL, the IWAE gradient for DReG, Pyro's RWS for RWS-DReG): the same-draw
    check tells estimators of the same mean apart, which a test of the mean cannot."""
    real = checks.ours
    monkeypatch.setattr(
        checks, "ours", lambda e, case: _Broken(e, case) if e == est else real(e, case)
    )
    with pytest.raises(AssertionError, match="same-draw reference"):
        checks.check_grad(BY_NAME[name], est, False)
