r"""A prototype of the adaptive policy's cheap-step rule with a per-tensor endpoint (issue 30).

The library's rule (``_ControlVariate._direct``) decides between a *measured* step that
applies the fitted per-element weights :math:`b` (the James-Stein mix) and a *direct* step of
one **whole** estimator, ``Trace_ELBO`` (:math:`b \equiv 1`) or STL (:math:`b \equiv 0`): the
better whole endpoint :math:`E \in \{0, 1\}` is taken directly when its predicted total second
moment is within ``mix_gain`` of the mix's,

.. math::

    S(b) = \lVert \bar p \rVert^2 + \sum_i \operatorname{Var} p_i + 2 b_i \operatorname{Cov}(p_i, c_i)
           + b_i^2 \operatorname{Var} c_i,
    \qquad
    \min(S(\mathbf 0), S(\mathbf 1)) \le \text{mix\_gain} \cdot S(b).

Summed over every element, that whole-estimator choice can put elements whose own better
endpoint is the other one on the wrong estimator, and it does so silently (up to a factor
``mix_gain`` = 2 in total second moment, all of it possibly in a few parameters).

**The rule here: the endpoint per parameter tensor.** The cheap candidate is the endpoint
vector :math:`e` that takes, for each parameter tensor :math:`T` (each guide site's ``loc``
and ``scale``, or each param-store tensor on the general path), the endpoint of the lower
second moment summed over that tensor's elements:

.. math::

    e_i = e_T = \Big[\sum_{i \in T} 2 \operatorname{Cov}(p_i, c_i) + \operatorname{Var} c_i
                < 0\Big] \quad (i \in T),

i.e. ``Trace_ELBO`` for :math:`T` where :math:`\sum_T S_i(1) < \sum_T S_i(0)`, STL elsewhere
(ties: STL, as now). With exact moments :math:`S(e) \le \min(S(\mathbf 0), S(\mathbf 1))`, so
it is never worse than the whole endpoint the library takes now; unlike a per-element choice,
each tensor's decision pools its elements' evidence, as the whole-estimator choice pools
everything. A step with weights :math:`e` costs what a direct step costs (one backward: the
score part kept on the tensors at 1, cut on those at 0; on the one-pass path, Pyro's
``Trace_ELBO`` step with the taps adding :math:`(e - 1) c` and no moments):

.. math::

    b = \begin{cases} e & S(e) \le \text{mix\_gain} \cdot S(b_\text{mix}) \\
                      b_\text{mix} & \text{otherwise (a measured step)} \end{cases}

and the step is a whole-estimator direct step where :math:`e` is constant (as now). Pseudocode,
where the library's ``_fit`` ends (``sizes``: the joint state's layout, which it has)::

    gain = 2 * cov + var_c                       # Var_i(1) - Var_i(0), per element
    end = cat([full(n, float(g.sum() < 0)) for g, n in zip(gain.split(sizes), sizes)])
    s_mix, s_end = S(b_mix), S(end)              # from the same moments, as _direct does now
    if s_end <= mix_gain * s_mix:
        b = end                                  # cheap: one backward with per-tensor cuts
        direct = end[0] if all(end == end[0]) else "per-tensor"
    else:
        b, direct = b_mix, None                  # measured steps apply the mix

No new constant: ``mix_gain`` is the policy's. In this prototype a "per-tensor" step is a
measured step applying :math:`b = e` (on the one-pass path about 1.1-1.2 ``Trace_ELBO`` steps
instead of 1.0, on the general path 1.3-1.45: its cost is over-stated here, never
under-stated). ``pool="element"`` (:math:`e_i = [\hat b_i \ge 1/2]`) and ``pool="margin"``
(the fit's endpoint, STL only where better by ``confidence`` standard errors) are the two
per-element variants measured against it: both lose to the pooled choices (per-element
estimates from ~19 effective measured steps are too noisy; the margin keeps 64-89% of the
low-rank guide's elements on ``Trace_ELBO`` at step 2000 of the centered stochastic-volatility
model, where 100 fresh draws put 85-92% at STL; ``benchmarks/diagnose_rule.py``).

``pooled_endpoints`` and ``per_element_endpoint_rule`` are the rule over plain tensors (moments
in, weights out); ``TraceAdaptiveSTLPerElement_ELBO(pool=...)`` plugs it into the library's
estimator for the benchmark (``adaptive-tensor``, ``adaptive-elem``, ``adaptive-margin``).
"""

from __future__ import annotations

import math

import torch

from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO
from pyro_gradroute.infer.trace_adaptive_elbo import _ControlVariate


def second_moment(
    mean_p: torch.Tensor, var_p: torch.Tensor, cov: torch.Tensor, var_c: torch.Tensor, b
) -> float:
    """:math:`S(b) = \\lVert \\bar p \\rVert^2 + \\sum_i \\operatorname{Var} p_i + 2 b_i
    \\operatorname{Cov}(p_i, c_i) + b_i^2 \\operatorname{Var} c_i` (``b`` a tensor or a float)."""
    return float(mean_p.square().sum()) + max(float((var_p + b * (2 * cov + b * var_c)).sum()), 0.0)


def per_element_endpoint_rule(
    mean_p: torch.Tensor,
    var_p: torch.Tensor,
    cov: torch.Tensor,
    var_c: torch.Tensor,
    b_mix: torch.Tensor,
    endpoint: torch.Tensor,
    mix_gain: float,
) -> dict:
    """The cheap-step rule with a per-element endpoint.

    :param mean_p, var_p, cov, var_c: per element, the mean and variance of the pathwise (STL)
        part :math:`p`, :math:`\\operatorname{Cov}(p, c)` and :math:`\\operatorname{Var} c` of the
        score part :math:`c` (the policy's moments).
    :param b_mix: the fitted (shrunk) weights a measured step applies.
    :param endpoint: per element 0.0 (STL) or 1.0 (``Trace_ELBO``): the better one,
        ``(b_hat >= 0.5)``.
    :param mix_gain: the policy's threshold on :math:`S(e) / S(b_\\text{mix})`.
    :returns: ``{"b": weights, "direct": 0.0 / 1.0 (a whole estimator) / None, "cheap": bool,
        "ratio": S(e) / S(b_mix), "ratio_whole": min(S(0), S(1)) / S(b_mix)}``.
    """
    s_mix = second_moment(mean_p, var_p, cov, var_c, b_mix)
    s_end = second_moment(mean_p, var_p, cov, var_c, endpoint)
    s0 = second_moment(mean_p, var_p, cov, var_c, 0.0)
    s1 = second_moment(mean_p, var_p, cov, var_c, 1.0)
    ratio = s_end / s_mix if s_mix > 0 else 1.0
    cheap = s_end <= mix_gain * s_mix
    direct = None
    if cheap and endpoint.numel():
        first = float(endpoint.reshape(-1)[0])
        if bool((endpoint == first).all()):
            direct = first
    return {
        "b": endpoint.clone() if cheap else b_mix,
        "direct": direct,
        "cheap": cheap,
        "ratio": ratio,
        "ratio_whole": min(s0, s1) / s_mix if s_mix > 0 else 1.0,
    }


def pooled_endpoints(
    mean_p: torch.Tensor,
    var_p: torch.Tensor,
    cov: torch.Tensor,
    var_c: torch.Tensor,
    sizes: list[int],
) -> torch.Tensor:
    r"""Per element, the endpoint (0.0 STL, 1.0 ``Trace_ELBO``) of the lower second moment
    summed over its parameter tensor (``sizes``: the tensors' element counts, in order):
    :math:`e_T = [\sum_{i \in T} \operatorname{Var}_i(1) < \sum_{i \in T} \operatorname{Var}_i(0)]`
    (ties: STL), i.e. :math:`\sum_{i\in T} 2 \operatorname{Cov}(p_i, c_i) + \operatorname{Var}
    c_i < 0`."""
    gain = 2 * cov + var_c  # Var_i(1) - Var_i(0)
    parts = gain.reshape(-1).split(list(sizes))
    return torch.cat([(g.sum() < 0).to(gain.dtype).expand(g.numel()) for g in parts])


class _PerElementControlVariate(_ControlVariate):
    """The library's policy with :func:`per_element_endpoint_rule` as its cheap-step rule:
    the endpoint per element (``pool="element"``: the point estimate; ``"margin"``: the fit's
    endpoint, STL where better by ``confidence`` standard errors) or per parameter tensor
    (``"tensor"``)."""

    pool = "element"

    def _fit(self, st: dict) -> dict:
        fit = super()._fit(st)
        if not self.center or self.mix_gain is None or self.fixed_weight is not None:
            return fit
        w1 = st["w1"]
        mp, mc = st["sp"] / w1, st["sc"] / w1
        var_p = (st["spp"] / w1 - mp.square()).clamp_min(0)
        cov = st["spc"] / w1 - mp * mc
        var_c = (st["scc"] / w1 - mc.square()).clamp_min(0)
        # the mix before the library's whole-estimator switch (mix_gain=inf replaces fit["b"])
        b_mix = fit["b"]
        if self.pool == "tensor":
            key = next(k for k, v in self.state.items() if v is st)
            layout = self.layouts.get(key)
            sizes = [math.prod(shape) for _, shape in layout] if layout else [b_mix.numel()]
            end = pooled_endpoints(mp, var_p, cov, var_c, sizes).view_as(b_mix)
        elif self.pool == "element":
            end = (fit["b_hat"] >= 0.5).to(b_mix.dtype)
        else:  # "margin": the fit's own endpoint, STL only where better by z standard errors
            end = fit["endpoint"]
        rule = per_element_endpoint_rule(mp, var_p, cov, var_c, b_mix, end, self.mix_gain)
        fit.update(b=rule["b"], direct=rule["direct"], ratio=rule["ratio"])
        fit["ratio_whole"] = rule["ratio_whole"]
        return fit


class TraceAdaptiveSTLPerElement_ELBO(TraceAdaptiveSTL_ELBO):
    """:class:`~pyro_gradroute.infer.TraceAdaptiveSTL_ELBO` with the per-element endpoint rule
    (a benchmark prototype; the same arguments)."""

    def __init__(self, *args, pool: str = "element", **kwargs):
        super().__init__(*args, **kwargs)
        cv = self._cv
        new = _PerElementControlVariate(
            cv.decay, cv.clip, cv.warmup, cv.center, cv.confidence, cv.fixed_weight, cv.mix_gain
        )
        new.pool = pool
        self._cv = new
