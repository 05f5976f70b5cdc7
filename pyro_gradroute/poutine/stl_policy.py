"""Which guide sites stick the landing, when, and in which estimators (imports nothing from ``infer``)."""

from __future__ import annotations

import warnings

__all__ = ["STLPolicy", "check_elbo", "uses_pathwise"]


def uses_pathwise(site) -> bool:
    """Whether a guide site (a trace site or a message) takes only its pathwise gradient.

    Reparameterized sites do, unless marked ``infer={"stl": False}``;
    ``infer={"stl": True}`` on a site without ``rsample`` is an error naming it.

    Example::

        >>> import pyro.distributions as dist
        >>> uses_pathwise({"name": "z", "fn": dist.Normal(0.0, 1.0), "infer": {}})
        True
        >>> uses_pathwise({"name": "z", "fn": dist.Normal(0.0, 1.0), "infer": {"stl": False}})
        False
    """
    fn, infer = site["fn"], site["infer"]
    stl = infer.get("stl", None)
    has_rsample = getattr(fn, "has_rsample", False)
    if stl is True and not has_rsample:
        raise ValueError(
            f"Guide site '{site['name']}' is marked infer={{'stl': True}} but its "
            f"distribution {type(fn).__name__} has no rsample, so it has no "
            "pathwise gradient. Use a reparameterizable family or remove the mark "
            "(non-reparameterized sites get the score-function estimator)."
        )
    return not (stl is False or not has_rsample)


class STLPolicy:
    """Which guide sites stick the landing: shared by ``TraceSTL_ELBO`` and the handler.

    * :meth:`uses_pathwise`: reparameterized sites do, unless marked
      ``infer={"stl": False}``;
    * :meth:`fallback`: a site that cannot be split gets the ordinary gradient, with a
      warning naming it (once per site);
    * ``trace_steps``: the first ``trace_steps`` steps take the ordinary (``Trace_ELBO``)
      gradient everywhere, then sticking the landing starts (:meth:`advance` counts steps).
      Far from the posterior, from a narrow initial scale especially, the score part that
      STL drops is what cancels the noise of the entropy gradient (for a Normal site the
      gradient of the entropy with respect to ``log sigma`` is exactly -1 with it, ``-eps^2``
      without it), so a short ``Trace_ELBO`` phase first avoids STL's worst regime.

    Example::

        >>> policy = STLPolicy("my estimator", trace_steps=1)
        >>> policy.active
        False
        >>> policy.advance(); policy.active
        True

    :param owner: the name the warnings use.
    :param trace_steps: number of initial steps with the ordinary gradient (``>= 0``).
    """

    def __init__(self, owner: str, trace_steps: int = 0):
        if isinstance(trace_steps, bool) or not isinstance(trace_steps, int) or trace_steps < 0:
            raise ValueError(
                f"{owner}: trace_steps must be an integer >= 0 (the number of initial steps "
                f"with the ordinary Trace_ELBO gradient), got {trace_steps!r}"
            )
        self.owner = owner
        self.trace_steps = trace_steps
        self.steps = 0
        self._warned: set[str] = set()

    @property
    def active(self) -> bool:
        """Whether sticking the landing is on (the ``Trace_ELBO`` phase is over)."""
        return self.steps >= self.trace_steps

    def advance(self) -> None:
        """Count one step (a gradient evaluation)."""
        self.steps += 1

    def uses_pathwise(self, site) -> bool:
        return uses_pathwise(site) and self.active

    def fallback(self, name: str, error) -> bool:
        """Warn (once per site) that site ``name`` gets the ordinary gradient; True."""
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"{self.owner}: guide site '{name}' cannot be split into score and "
                f"pathwise parts ({error}); it gets the ordinary Trace_ELBO gradient instead "
                "(unbiased, but not sticking the landing). Mark it infer={'stl': False} to "
                "silence this.",
                stacklevel=4,
            )
        return True

    def __getstate__(self) -> dict:
        return {"owner": self.owner, "trace_steps": self.trace_steps, "steps": self.steps}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["owner"], state["trace_steps"])
        self.steps = state["steps"]


def _allowed_elbos() -> tuple:
    """Pyro's estimators whose gradient stays unbiased when the score part is dropped (exact types)."""
    import pyro.infer as pi

    return (
        pi.Trace_ELBO,
        pi.JitTrace_ELBO,
        pi.TraceGraph_ELBO,
        pi.JitTraceGraph_ELBO,
        pi.TraceEnum_ELBO,
        pi.JitTraceEnum_ELBO,
        pi.TraceMeanField_ELBO,
        pi.JitTraceMeanField_ELBO,
    )


_GRADIENT_METHODS = ("loss_and_grads", "differentiable_loss", "_differentiable_loss_particle")
_VALID: dict[type, bool] = {}  # estimator class -> whether STL is valid in it


def _valid_in(cls) -> bool:
    """An allowed estimator, or a subclass of one that keeps its gradient computation.

    Allowed: Pyro's listed classes, and a class whose MRO declares ``_stl_safe = True``
    (a capability flag, as ``has_rsample`` is on distributions: this package's
    ``Trace_ELBO`` sets it). A subclass that redefines ``loss_and_grads``,
    ``differentiable_loss`` or ``_differentiable_loss_particle`` below the allowed class
    is refused.
    """
    allowed = _allowed_elbos()
    base = next((c for c in cls.__mro__ if c in allowed or vars(c).get("_stl_safe") is True), None)
    if base is None:
        return False
    for name in _GRADIENT_METHODS:
        own = next((c for c in cls.__mro__ if name in vars(c)), None)
        if own is not None and own not in base.__mro__:
            return False  # a subclass (or mixin) redefines how the gradient is formed
    return True


def check_elbo(elbo) -> None:
    """Raise unless ``elbo`` (the estimator running the guide, or None) is one STL is valid in.

    Allowed: the ELBOs that take ``log q``'s gradient as a plain sum (Pyro's by class, this
    package's by the ``_stl_safe`` flag), and subclasses of them that do not redefine
    ``loss_and_grads``, ``differentiable_loss`` or ``_differentiable_loss_particle``.

    Example::

        >>> import pyro.infer
        >>> check_elbo(pyro.infer.Trace_ELBO())
        >>> check_elbo(pyro.infer.RenyiELBO())
        Traceback (most recent call last):
        ...
        ValueError: stick_the_landing cannot be used with RenyiELBO: ...
    """
    if elbo is None:
        return
    cls = type(elbo)
    ok = _VALID.get(cls)
    if ok is None:
        ok = _VALID[cls] = _valid_in(cls)
    if ok:
        return
    raise ValueError(
        f"stick_the_landing cannot be used with {type(elbo).__name__}: sticking the landing "
        "drops the score part of log q, which leaves the gradient unbiased only in the "
        "ELBOs that take log q's gradient as a plain sum: pyro.infer.Trace_ELBO, "
        "TraceGraph_ELBO, TraceEnum_ELBO, TraceMeanField_ELBO (and their Jit versions) and "
        "pyro_gradroute.infer.Trace_ELBO. An estimator whose particle weights depend on log q "
        "(RenyiELBO, ReweightedWakeSleep, TraceTailAdaptive_ELBO) would be biased: use "
        "pyro_gradroute.infer.TraceDReG_ELBO (doubly-reparameterized gradients) with the plain "
        "guide, or pyro_gradroute.infer.TraceSTL_ELBO."
    )
