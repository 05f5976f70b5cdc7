"""Sticking the landing inside Pyro's own ELBOs, through the ``score_parts`` hook."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable

from ..distributions.split_distribution import SplitBatch, SplitDistribution
from .split_messenger import SplitMessenger


def uses_pathwise(site) -> bool:
    """Whether a guide site (a trace site or a split record) takes only its pathwise gradient.

    Reparameterized sites do, unless marked ``infer={"stl": False}``;
    ``infer={"stl": True}`` on a site without ``rsample`` is an error naming it.
    """
    get = site.get if isinstance(site, dict) else lambda k: getattr(site, k)
    fn = get("fn")
    fn = fn.base_dist if isinstance(fn, SplitDistribution) else fn
    stl = get("infer").get("stl", None)
    has_rsample = getattr(fn, "has_rsample", False)
    if stl is True and not has_rsample:
        raise ValueError(
            f"Guide site '{get('name')}' is marked infer={{'stl': True}} but its "
            f"distribution {type(fn).__name__} has no rsample, so it has no "
            "pathwise gradient. Use a reparameterizable family or remove the mark "
            "(non-reparameterized sites get the score-function estimator)."
        )
    return not (stl is False or not has_rsample)


def _split_fallback(rec, error) -> bool:
    warnings.warn(
        f"sticking the landing: guide site '{rec.name}' cannot be split into score and "
        f"pathwise parts ({error}); it gets the ordinary gradient instead "
        "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
        "silence this.",
        stacklevel=2,
    )
    return True


_IMPORTANCE_WEIGHTED = ("RenyiELBO", "ReweightedWakeSleep")


def _calling_importance_weighted_elbo() -> str | None:
    """The name of a Pyro importance-weighted ELBO class on the call stack, if any."""
    from pyro.infer import RenyiELBO, ReweightedWakeSleep

    frame = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, (RenyiELBO, ReweightedWakeSleep)):
            return type(obj).__name__
        frame = frame.f_back
    return None


class StickTheLandingMessenger(SplitMessenger):
    r"""Inside it, each reparameterized guide site's log-density carries only its pathwise gradient.

    For a guide sample :math:`z = g(\epsilon; \phi)`, ``log_prob`` and
    ``score_parts`` (``log_prob`` and ``entropy_term``) at the sample equal
    :math:`\log q(z; \phi)` in value, with gradient that of
    :math:`\log q(z; \bot(\phi))` (sticking the landing, Roeder et al. 2017): the
    score part :math:`\partial_\phi \log q(z;\phi)|_z`, whose expectation is zero, is
    dropped. For a conditional :math:`q(z_2 \mid z_1)` the path through :math:`z_1`
    is kept. Every density is evaluated once (one batched split per guide run).
    Non-reparameterized sites keep Pyro's score-function treatment.

    Pyro's ELBOs read these parts through the documented ``score_parts`` hook, so
    ``SVI(model, stick_the_landing(guide), optim, elbo)`` sticks the landing with
    ``Trace_ELBO``, ``TraceGraph_ELBO``, ``TraceEnum_ELBO`` and ``TraceMeanField_ELBO``
    (sites with an analytic KL keep it: it has no sampling variance). Under
    ``RenyiELBO`` and ``ReweightedWakeSleep`` it raises: an importance-weighted bound
    differentiates ``log q`` inside its weights, where dropping the score part biases
    the gradient (use :class:`~pyro_gradroute.infer.TraceDReG_ELBO`).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI, TraceEnum_ELBO
        >>> from pyro_gradroute.poutine import stick_the_landing
        >>> def model(x):
        ...     loc = pyro.sample("loc", dist.Normal(0.0, 5.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(loc, 1.0), obs=x)
        >>> def guide(x):
        ...     m = pyro.param("m", torch.tensor(0.0))
        ...     pyro.sample("loc", dist.Normal(m, 0.5))
        >>> pyro.clear_param_store()
        >>> svi = SVI(model, stick_the_landing(guide), pyro.optim.Adam({"lr": 0.1}),
        ...           TraceEnum_ELBO(max_plate_nesting=1))
        >>> loss = svi.step(torch.randn(5))
    """

    def __init__(self) -> None:
        super().__init__(SplitBatch(uses_pathwise, _split_fallback, uses_pathwise))
        self._warned = False

    def __enter__(self):
        name = _calling_importance_weighted_elbo()
        if name is not None:
            raise ValueError(
                f"stick_the_landing cannot be used with pyro.infer.{name}: an "
                "importance-weighted bound differentiates log q inside its weights, and "
                "dropping the score part there biases the gradient. Use "
                "pyro_gradroute.infer.TraceDReG_ELBO (doubly-reparameterized gradients: the "
                "importance-weighted counterpart of sticking the landing) with the plain guide."
            )
        self.batch = SplitBatch(uses_pathwise, _split_fallback, uses_pathwise)
        return super().__enter__()

    def __exit__(self, *args):
        if (
            not self._warned
            and args[0] is None
            and not any(r.stl for r in self.batch.records.values())
        ):
            self._warned = True
            warnings.warn(
                "stick_the_landing: the guide has no reparameterized site, so sticking the "
                "landing changes nothing (its sites keep the score-function estimator).",
                stacklevel=2,
            )
        return super().__exit__(*args)


def stick_the_landing(fn: Callable | None = None) -> StickTheLandingMessenger | Callable:
    """Handler form of :class:`StickTheLandingMessenger` (like ``pyro.poutine.scale``).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> def guide():
        ...     pyro.sample("z", dist.Normal(pyro.param("m", torch.tensor(0.0)), 1.0))
        >>> stl_guide = stick_the_landing(guide)
        >>> with stick_the_landing():
        ...     guide()

    :returns: the wrapped ``fn``, or the messenger (a context manager) if ``fn`` is None.
    """
    msngr = StickTheLandingMessenger()
    return msngr if fn is None else msngr(fn)
