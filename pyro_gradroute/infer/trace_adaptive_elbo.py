r"""Adaptive estimators: STL / DReG plus a learned, per-element control variate on the score part.

Both estimators write the gradient of one step as

.. math::

    g(b) = g_\text{path} + b \odot g_\text{cv},

where :math:`g_\text{path}` is the estimator of the base class (:class:`TraceSTL_ELBO`,
:class:`TraceDReG_ELBO`), :math:`g_\text{cv}` is a vector with mean zero, and :math:`b`
holds one weight per parameter element, chosen from the parts of earlier steps: it
starts at 1 (``Trace_ELBO`` / IWAE) and moves on evidence.
"""

from __future__ import annotations

import math

import pyro
import torch
import torch.distributed as torch_dist
from pyro.infer import Trace_ELBO as _PyroTrace_ELBO
from pyro.infer import TraceEnum_ELBO as _PyroTraceEnum_ELBO
from pyro.util import warn_if_nan
from torch.distributions import TransformedDistribution
from torch.distributions.transforms import ExpTransform

from .. import routing
from .._compat import trace_elbo_particles, trace_enum_elbo_particles
from ..distributions.detached import delta_base, is_delta
from ..distributions.normal import normal_pushforward, normal_score
from ..poutine.pathwise import NeedsGeneralSplit, frontier, latent_site, site_pathwise
from ..poutine.split_distribution import SplitDistribution
from ..poutine.stick_the_landing_messenger import stick_the_landing, uses_pathwise
from ..routing import passes_product, reaches_leaf_directly
from .elbo import EXTRA, RoutedELBO, Terms, _joint_blocks, collect_blocks
from .trace_dreg_elbo import TraceDReG_ELBO
from .trace_elbo import Trace_ELBO
from .trace_stl_elbo import TraceSTL_ELBO
from .traces import scaled, site_parts

__all__ = ["TraceAdaptiveDReG_ELBO", "TraceAdaptiveSTL_ELBO"]


# ----------------------------------------------------------------------------- the policy
class _ControlVariate:
    r"""Per-element choice of the control-variate weight ``b`` from earlier steps' two parts.

    The interface to the step: ``weight(name, like)`` gives the ``b`` this step applies
    (``like``'s shape, dtype and device; ``None`` would mean 0), from earlier steps only;
    ``update(name, g_path, g_cv)`` adds this step's parts, once per step, after the step's
    gradient is formed. See :class:`TraceAdaptiveSTL_ELBO` for the rule.

    Per parameter it keeps, with the parameter's shape, exponentially weighted sums
    (factor ``decay``) of :math:`p = g_\text{path}`, :math:`c = g_\text{cv}`, :math:`pc`,
    :math:`c^2` (the weighted least-squares fit of :math:`p` on :math:`c` with an
    intercept; without ``center``, only :math:`pc` and :math:`c^2`: the intercept is 0)
    and, for the standard error, of :math:`x^2y^2`, :math:`x^3y` and :math:`x^4`, with
    :math:`x = c - \bar c` and :math:`y = p - \bar p` centred at the means of the steps
    before (so :math:`E[x^2 (y + b x)^2]`, the squared residual at any :math:`b`, is a
    quadratic in :math:`b`); and three scalars: the sums of the weights and of their
    squares (the effective number of samples :math:`n = (\sum w)^2 / \sum w^2`), and
    the residual moments' sum of weights.
    """

    _KEYS = ("sp", "sc", "spp", "spc", "scc", "xxyy", "xxxy", "xxxx")
    _CENTRED = 3  # sp, sc, spp: kept only with ``center``

    def __init__(
        self,
        decay: float = 0.9,
        clip: float | None = None,
        warmup: int = 10,
        center: bool = True,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        mix_gain: float | None = 2.0,
    ):
        if mix_gain is not None and not mix_gain >= 1.0:  # (NaN fails this too)
            raise ValueError(
                f"mix_gain must be a ratio of second moments >= 1 (inf: never mix, a measured "
                f"switch between the whole estimators; None: the mix measures on every step), "
                f"got {mix_gain}"
            )
        self.mix_gain = None if mix_gain is None else float(mix_gain)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        if clip is not None and not clip > 0:
            raise ValueError(f"clip must be positive (a bound on |b|) or None, got {clip}")
        if isinstance(warmup, bool) or not float(warmup).is_integer() or warmup < 0:
            raise ValueError(f"warmup must be an integer number of steps >= 0, got {warmup}")
        if not (math.isfinite(confidence) and confidence >= 0):
            raise ValueError(
                f"confidence must be a finite number of standard errors >= 0, got {confidence}"
            )
        if fixed_weight is not None and not math.isfinite(fixed_weight):
            raise ValueError(f"fixed_weight must be a finite number or None, got {fixed_weight}")
        self.decay, self.clip, self.warmup, self.center = float(decay), clip, int(warmup), center
        self.confidence = float(confidence)
        self.fixed_weight = None if fixed_weight is None else float(fixed_weight)
        self.state: dict[str, dict] = {}
        self.layouts: dict[str, list] = {}  # joint state -> [(parameter name, shape)]

    # -- the rule ---------------------------------------------------------------------
    def _fit(self, st: dict) -> dict:
        """``b`` and what it is chosen from: ``b_hat``, its ``se``, the ``endpoint``, ``n_eff``."""
        w1, n_eff = st["w1"], st["w1"] ** 2 / st["w2"]
        cc = st["scc"] / w1
        pc = st["spc"] / w1
        if self.center:  # least squares with an intercept
            mc = st["sc"] / w1
            pc = pc - (st["sp"] / w1) * mc
            cc = cc - mc.square()
        tiny = torch.finfo(cc.dtype).tiny
        # elements without a score part keep b = 1 (it changes nothing there)
        has = cc > 1e-6 * st["scc"] / w1 + tiny
        cc_ = torch.where(has, cc, torch.ones_like(cc))
        b_hat = torch.where(has, -pc / cc_, torch.ones_like(cc))
        if self.clip is not None:
            b_hat = b_hat.clamp(-self.clip, self.clip)
        # delta method: Var(b_hat) ~ E[x^2 r^2] / ((n - k) E[x^2]^2), k fitted coefficients
        dof = n_eff - (2.0 if self.center else 1.0)
        if st["qw"] > 0 and dof > 0:
            resid = st["xxyy"] + 2 * b_hat * st["xxxy"] + b_hat.square() * st["xxxx"]
            se = (resid.clamp_min(0) / st["qw"]).div(dof).sqrt() / cc_
        else:
            se = torch.full_like(cc, math.inf)
        se = torch.where(has, se, torch.zeros_like(se))
        zse = self.confidence * se
        # the endpoint: Trace_ELBO (1) unless STL (0) is closer to b_hat by z standard errors
        end = (b_hat + zse >= 0.5).to(b_hat.dtype)
        d = b_hat - end
        d2 = d.square()
        # positive-part James-Stein: from the endpoint towards b_hat by 1 - (z se / d)^2
        shrink = (1 - zse.square() / d2.clamp_min(tiny)).clamp_min(0)
        shrink = torch.where(d2 > 0, shrink, torch.zeros_like(shrink)).nan_to_num(0.0)
        b = end + shrink * d
        direct = self._direct(st, b) if self.center else {"direct": None, "ratio": None}
        if self.mix_gain == math.inf and direct["direct"] is not None:
            b = torch.full_like(b, direct["direct"])  # a switch: one whole estimator
        return {"b": b, "b_hat": b_hat, "se": se, "endpoint": end, "n_eff": n_eff, **direct}

    def _direct(self, st: dict, b: torch.Tensor) -> dict:
        r"""``{"direct": e, "ratio": r}``: the whole estimator (0: STL, 1: ``Trace_ELBO``) a
        direct step takes (or ``None``), and :math:`r = S(e) / S(b)` of the better endpoint.

        From the moments, the gradient's total second moment
        :math:`S(b) = \lVert \bar g \rVert^2 + \sum_e \operatorname{Var}(p_e)
        + 2 b_e \operatorname{Cov}(p_e, c_e) + b_e^2 \operatorname{Var}(c_e)` (the mean
        :math:`\bar g` of :math:`g_\text{path}` is every weight's mean) at the fitted
        weights and at both endpoints. A step of a normalized optimizer (Adam) advances by
        the mean's share of :math:`S`; a direct step is worth it when the better endpoint's
        :math:`S` is within ``mix_gain`` of the mix's: far from the optimum the mean
        dominates and the variance the mix removes buys little, near it the variance does.
        """
        if self.mix_gain is None:
            return {"direct": None, "ratio": None}
        w1 = st["w1"]
        mp, mc = st["sp"] / w1, st["sc"] / w1
        var_p = (st["spp"] / w1 - mp.square()).clamp_min(0)
        cov = st["spc"] / w1 - mp * mc
        var_c = (st["scc"] / w1 - mc.square()).clamp_min(0)
        mean2 = float(mp.square().sum())
        s_mix = mean2 + max(float((var_p + b * (2 * cov + b * var_c)).sum()), 0.0)
        s0 = mean2 + float(var_p.sum())
        s1 = mean2 + float((var_p + 2 * cov + var_c).sum())
        best, s_end = (0.0, s0) if s0 <= s1 else (1.0, s1)
        ratio = s_end / s_mix if s_mix > 0 else 1.0
        direct = best if self.mix_gain == math.inf or s_end <= self.mix_gain * s_mix else None
        return {"direct": direct, "ratio": ratio}

    def _ready(self, st: dict | None) -> bool:
        return st is not None and st["n"] > self.warmup and st["qw"] > 0

    #: after the first ``_FRESH`` steps past warm-up, the fit is recomputed every ``_REFIT``
    #: steps (the weights still come from earlier steps only; a fit costs ~35 vector ops)
    _REFIT, _FRESH = 4, 5

    def _cached_fit(self, st: dict, like: torch.Tensor) -> dict:
        fit = st.get("fit")
        if fit is None or fit["b"].device != like.device or fit["b"].dtype != like.dtype:
            self._to(st, like)
            fit = st["fit"] = self._fit(st)
            st["age"] = 0
        return fit

    def weight(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """``b`` for parameter ``name``, from earlier steps only.

        ``1`` (``Trace_ELBO``) during the first ``warmup`` steps, and for a parameter whose
        shape no longer matches ``like`` (its state is dropped: a new problem reused the
        name); ``fixed_weight`` everywhere if set.
        """
        if self.fixed_weight is not None:
            return torch.full_like(like, self.fixed_weight)
        st = self.state.get(name)
        if st is not None and st["scc"].shape != like.shape:
            del self.state[name]
            st = None
        if not self._ready(st):
            return torch.ones_like(like)
        return self._cached_fit(st, like)["b"]

    def diagnostics(self, name: str) -> dict | None:
        """``{"b", "b_hat", "se", "endpoint", "n_eff"}`` of ``name`` (``None`` during warm-up)."""
        st = self.state.get(name)
        if st is None:  # a parameter kept in a joint state (weight_many)
            for key, layout in self.layouts.items():
                if name in dict(layout) and self._ready(self.state.get(key)):
                    fit = self._fit(self.state[key])
                    return {
                        k: (self._split(key, v)[name] if torch.is_tensor(v) else v)
                        for k, v in fit.items()
                    }
            return None
        if not self._ready(st):
            return None
        return dict(self._fit(st))  # from every step so far

    def weights(self) -> dict[str, torch.Tensor]:
        """``{name: b}`` that the next step applies, for every parameter with a state."""
        out = {}
        for name, st in list(self.state.items()):
            b = self.weight(name, st["scc"])
            b = torch.zeros_like(st["scc"]) if b is None else b
            if name in self.layouts:
                out.update(self._split(name, b))
            else:
                out[name] = b
        return out

    def uniform(self, key: str) -> float | None:
        """``0.0`` / ``1.0``: the whole estimator the next step may take directly (see ``direct``).

        That value when every element's ``b`` is exactly it, or when the better endpoint's
        predicted second moment is within ``mix_gain`` of the fitted weights' (``center``
        only); ``None`` while not settled or when the mix pays for its cost.
        """
        return self.settled(key)[0]

    def settled(self, key: str) -> tuple[float | None, float]:
        """``(uniform(key), r)``: with ``r`` the better endpoint's predicted second moment over
        the fitted mix's (1 where the weights are that endpoint, or without a fit: the mix
        gains nothing)."""
        st = self.state.get(key)
        if st is None or self.fixed_weight is not None or st["n"] <= self.warmup + self._FRESH:
            return None, 1.0  # not yet settled: every step measures
        if not self._ready(st):
            return 1.0, 1.0  # b = 1 (Trace_ELBO)
        fit = self._cached_fit(st, st["scc"])
        out = fit.get("settled")
        if out is None:  # once per fit
            v = self._constant(fit)
            ratio = fit.get("ratio")
            if v is not None:
                out = v, 1.0  # the weights are the endpoint: the mix is that estimator
            else:
                out = fit.get("direct"), 1.0 if ratio is None else ratio
            fit["settled"] = out
        return out

    @staticmethod
    def _constant(fit: dict) -> float | None:
        """0.0 / 1.0 where every weight of the fit is exactly that endpoint, else ``None``."""
        if "constant" not in fit:
            b = fit["b"]
            fit["constant"] = next((v for v in (0.0, 1.0) if bool((b == v).all())), None)
        return fit["constant"]

    def constant_weight(self, key: str) -> float | None:
        """The weight every element of ``key`` takes next, where they all take the same
        (``fixed_weight``, 1 during warm-up, an endpoint the fit sits at), else ``None``."""
        if self.fixed_weight is not None:
            return self.fixed_weight
        st = self.state.get(key)
        if not self._ready(st):
            return 1.0
        return self._constant(self._cached_fit(st, st["scc"]))

    # -- all of a step's parameters as one vector: one fit and one update per step ------
    _SEP = "\x1f"

    def _split(self, key: str, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        names, shapes = zip(*self.layouts[key])
        sizes = [math.prod(s) for s in shapes]
        return {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes)}

    def _key(self, names: list[str], tensors: list[torch.Tensor]) -> str:
        key = self._SEP.join(names)
        layout = [(n, tuple(t.shape)) for n, t in zip(names, tensors)]
        if self.layouts.get(key) != layout:  # a parameter changed shape: start again
            self.state.pop(key, None)
            self.layouts[key] = layout
        return key

    def weight_many(self, names: list[str], likes: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`weight` of several parameters at once, kept as one joint state (elementwise the same rule).

        The joint state belongs to this set of parameters: a step with another set starts
        a new one (at ``Trace_ELBO``, ``b = 1``). Between two fits the same views of the
        fitted vector are returned (no per-step concatenation).
        """
        key = self._key(names, likes)
        st = self.state.get(key)
        like = likes[0]
        if self.fixed_weight is None and self._ready(st):
            fit = self._cached_fit(st, like)
            views = fit.get("views")
            if views is None:
                views = fit["views"] = list(self._split(key, fit["b"]).values())
            return views
        flat = torch.cat([t.detach().reshape(-1) for t in likes])
        return list(self._split(key, self.weight(key, flat)).values())

    def update_many(
        self, names: list[str], g_paths: list[torch.Tensor], g_cvs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`update` of several parameters at once (see :meth:`weight_many`); returns
        the two parts flattened, in the joint state's order."""
        key = self._key(names, g_cvs)
        cat = torch.cat
        p, c = cat([g.reshape(-1) for g in g_paths]), cat([g.reshape(-1) for g in g_cvs])
        self.update(key, p, c)
        return p, c

    @staticmethod
    def _to(st: dict, like: torch.Tensor) -> None:
        for k, v in list(st.items()):  # a loaded state may live on another device
            if torch.is_tensor(v) and (v.device != like.device or v.dtype != like.dtype):
                st[k] = v.to(like)
                st.pop("buf", None)  # the moved moments are no longer views of it

    def _fresh_state(self, c: torch.Tensor) -> dict:
        """Zero moments for ``c``'s shape: views into one buffer, so a step updates them at once."""
        keys = self._KEYS if self.center else self._KEYS[self._CENTRED :]
        buf = c.new_zeros((len(keys),) + c.shape)
        st = dict(zip(keys, buf.unbind(0)))
        st.update(n=0, w1=0.0, w2=0.0, qw=0.0, fit=None, buf=buf)
        return st

    def update(self, name: str, g_path: torch.Tensor, g_cv: torch.Tensor) -> None:
        """Add one step's parts (call after the step's gradient is formed from ``weight``)."""
        p, c = g_path.detach(), g_cv.detach()
        st = self.state.get(name)
        if st is None or st["scc"].shape != c.shape:
            st = self.state[name] = self._fresh_state(c)
        self._to(st, c)
        buf = st.get("buf")
        if buf is None:  # a loaded or moved state: its moments become views of one buffer again
            keys = self._KEYS if self.center else self._KEYS[self._CENTRED :]
            buf = st["buf"] = torch.stack([st[k] for k in keys])
            st.update(zip(keys, buf.unbind(0)))
        beta = self.decay
        # this step's terms, in the order of _KEYS: sp, sc, spp (centred only), spc, scc, and
        # the residual moments centred at the means of the steps before this one
        new = [p, c, p * p] if self.center else []
        new += [p * c, c * c]
        first = not st["w1"] > 0
        if not first:
            if self.center:
                x, y = c - st["sc"] / st["w1"], p - st["sp"] / st["w1"]
            else:
                x, y = c, p
            xx = x * x
            xy = x * y
            new += [xy * xy, xx * xy, xx * xx]
            st["qw"] = beta * st["qw"] + 1.0
        buf[: len(new)].mul_(beta).add_(torch.stack(new))  # the residual moments wait a step
        st["w1"] = beta * st["w1"] + 1.0
        st["w2"] = beta * beta * st["w2"] + 1.0
        st["n"] += 1
        st["age"] = st.get("age", 0) + 1
        if st["n"] <= self.warmup + self._FRESH or st["age"] >= self._REFIT:
            st["fit"] = None  # recomputed when next asked for

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "clip": self.clip,
            "warmup": self.warmup,
            "center": self.center,
            "confidence": self.confidence,
            "fixed_weight": self.fixed_weight,
            "mix_gain": self.mix_gain,
            "layouts": {k: list(v) for k, v in self.layouts.items()},
            "moments": {
                k: {
                    kk: (v.clone() if torch.is_tensor(v) else v)
                    for kk, v in st.items()
                    if kk not in ("fit", "buf")
                }
                for k, st in self.state.items()
            },
            # the fits in use (refitted every few steps): a resumed run applies the same b
            "fits": {
                k: {
                    kk: (v.clone() if torch.is_tensor(v) else v)
                    for kk, v in st["fit"].items()
                    if kk != "views"
                }
                for k, st in self.state.items()
                if st.get("fit") is not None
            },
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"confidence", "fixed_weight", "mix_gain"} - set(state)
        keys = self._KEYS if state.get("center", True) else self._KEYS[self._CENTRED :]
        for st in state.get("moments", {}).values():
            missing |= set(keys) - set(st)
        if missing:
            raise ValueError(
                f"this control-variate state lacks {sorted(missing)}: it was saved by an older "
                "version whose moments this policy cannot use; start from a fresh estimator"
            )
        self.decay, self.clip = state["decay"], state["clip"]
        self.warmup, self.center = state["warmup"], state["center"]
        self.confidence, self.fixed_weight = state["confidence"], state["fixed_weight"]
        self.mix_gain = state["mix_gain"]
        self.state = {
            k: {kk: (v.clone() if torch.is_tensor(v) else v) for kk, v in st.items()}
            for k, st in state["moments"].items()
        }
        for k, fit in state.get("fits", {}).items():
            if k in self.state:
                self.state[k]["fit"] = {
                    kk: (v.clone() if torch.is_tensor(v) else v) for kk, v in fit.items()
                }
        self.layouts = {k: [tuple(e) for e in v] for k, v in state.get("layouts", {}).items()}


class _Gate:
    r"""Whether any weights could pay for a measured step, from the gradients the steps apply.

    For every weight vector :math:`b`, :math:`S(b) = \mathbb E \lVert g(b) \rVert^2 =
    \lVert \mathbb E g \rVert^2 + \sum_e \operatorname{Var} g_e(b) \ge \lVert \mathbb E g
    \rVert^2` (the mean is every weight's mean), so against the endpoint :math:`e` that direct
    steps take, no weights (the fitted mix, the other endpoint) reduce the second moment by
    more than

    .. math::

        B = \frac{S(e)}{\lVert \mathbb E g \rVert^2}
          = \frac{\mathbb E \lVert g_t \rVert^2}{\mathbb E \langle g_t, g_{t-1} \rangle},

    where :math:`g_t = g(e)` is step :math:`t`'s gradient (a direct step's, or
    :math:`g_\text{path} + e\, g_\text{cv}` on a measured step): two steps' draws are
    independent, so :math:`\langle g_t, g_{t-1} \rangle` is an unbiased estimate of
    :math:`\lVert \mathbb E g \rVert^2` while the parameters move little between steps. The
    gate keeps exponentially weighted sums (factor ``decay``) of both scalars: no score part, no
    second backward, two dot products a step. A mean that turns along the window lowers the
    denominator, which only makes :math:`B` larger (more measuring).
    """

    #: effective number of samples (products) before the bound is read
    MIN_SAMPLES = 3.0

    def __init__(self, decay: float):
        self.decay = decay
        self.reset(1.0)

    def reset(self, e: float) -> None:
        """Forget the moments; the steps now take endpoint ``e``."""
        self.e, self.prev, self.sums, self.w1, self.w2 = e, None, None, 0.0, 0.0

    def update(self, g: torch.Tensor) -> None:
        """Add one step's applied gradient (flattened, in the order of the joint state)."""
        g = g.detach()
        prev = self.prev
        self.prev = g
        if prev is None or prev.shape != g.shape or prev.dtype != g.dtype:
            self.sums, self.w1, self.w2 = None, 0.0, 0.0  # another parameter set: start again
            return
        new = torch.stack([g.dot(g), g.dot(prev.to(g.device))])
        self.sums = new if self.sums is None else self.sums.to(g.device).mul_(self.decay).add_(new)
        self.w1, self.w2 = self.decay * self.w1 + 1.0, self.decay**2 * self.w2 + 1.0

    def known(self) -> bool:
        """Whether the bound has its ``MIN_SAMPLES`` effective samples."""
        return self.sums is not None and self.w1 * self.w1 >= self.MIN_SAMPLES * self.w2

    def bound(self) -> float:
        """:math:`B` (``inf`` until ``MIN_SAMPLES`` effective samples, or with no mean left)."""
        if not self.known():
            return math.inf
        sq, cross = self.sums.tolist()
        return sq / cross if cross > 0 else math.inf

    def state_dict(self) -> dict:
        t = {"prev": self.prev, "sums": self.sums}
        out = {k: (v.clone() if v is not None else None) for k, v in t.items()}
        return {**out, "e": self.e, "w1": self.w1, "w2": self.w2}

    def load_state_dict(self, state: dict) -> None:
        self.e, self.w1, self.w2 = state["e"], state["w1"], state["w2"]
        self.prev, self.sums = state["prev"], state["sums"]


def _trace_params(*traces) -> list[torch.Tensor]:
    """The leaf tensors of the ``param`` sites of the traces (unconstrained), in trace order."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for trace in traces:
        for site in trace.nodes.values():
            if site["type"] != "param":
                continue
            v = site["value"]
            leaf = v.unconstrained() if hasattr(v, "unconstrained") else v
            if torch.is_tensor(leaf) and leaf.requires_grad and id(leaf) not in seen:
                seen.add(id(leaf))
                out.append(leaf)
    return out


def _param_key(p: torch.Tensor) -> str:
    import pyro

    name = pyro.get_param_store().param_name(p)
    return name if name is not None else f"<unnamed parameter {id(p):x}>"


def _world(distributed) -> int:
    """World size to average the parts over (1: none)."""
    if distributed is False:
        return 1
    ok = torch_dist.is_available() and torch_dist.is_initialized()
    if not ok:
        if distributed is True:
            raise RuntimeError(
                "distributed=True needs an initialized torch.distributed process group"
            )
        return 1
    return torch_dist.get_world_size()


def _allreduce_mean(tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    if world == 1 or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    backend = torch_dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    buf = flat.to(dev) if dev is not None else flat.cpu()
    torch_dist.all_reduce(buf)
    buf = buf.to(flat.device).div_(world)
    out, i = [], 0
    for t in tensors:
        out.append(buf[i : i + t.numel()].view_as(t))
        i += t.numel()
    return out


class _AdaptiveMixin:
    """The step shared by both estimators (see :class:`TraceAdaptiveSTL_ELBO`)."""

    _cv: _ControlVariate
    _distributed: bool | None

    def _init_cv(
        self,
        decay,
        clip,
        warmup,
        center,
        distributed,
        confidence=2.0,
        fixed_weight=None,
        mix_gain=None,
    ) -> None:
        self._cv = _ControlVariate(decay, clip, warmup, center, confidence, fixed_weight, mix_gain)
        self._distributed = distributed
        self._key: str | None = None  # the joint state of the last measured step's parameters
        self._unmeasured, self._interval, self._last_end = 0, 4, None  # direct steps' schedule
        self._gate = _Gate(self._cv.decay)

    # -- public state ---------------------------------------------------------------
    @property
    def decay(self) -> float:
        return self._cv.decay

    @property
    def clip(self) -> float | None:
        return self._cv.clip

    def control_variate_weights(self) -> dict[str, torch.Tensor]:
        """``{name: b}`` (the weights the next step applies; ones during warm-up): by
        param-store name, or by guide site (``"<site>.loc"``, ``"<site>.scale"``) where measured
        steps take one pass."""
        return self._cv.weights()

    def state_dict(self) -> dict:
        """The running moments and settings, to resume the same estimator from a checkpoint
        (with the schedule of direct and measured steps)."""
        schedule = {"key": self._key, "unmeasured": self._unmeasured}
        schedule.update(interval=self._interval, last_end=self._last_end)
        schedule.update(gate=self._gate.state_dict(), gate_count=self._gate_count)
        schedule.update(one_pass=self._one_pass, gate_layout=self._gate_layout)
        return {**self._cv.state_dict(), "schedule": schedule}

    def load_state_dict(self, state: dict) -> None:
        self._cv.load_state_dict(state)
        sch = state.get("schedule", {})
        self._key, self._unmeasured = sch.get("key"), sch.get("unmeasured", 0)
        self._interval, self._last_end = sch.get("interval", 4), sch.get("last_end")
        self._gate, self._gate_count = _Gate(self._cv.decay), sch.get("gate_count", 0)
        if "gate" in sch:
            self._gate.load_state_dict(sch["gate"])
        self._one_pass, self._gate_layout = sch.get("one_pass"), sch.get("gate_layout")

    def reset(self) -> None:
        """Forget the moments (the next step is ``Trace_ELBO``'s / IWAE's, ``b = 1``)."""
        self._cv.state.clear()
        self._cv.layouts.clear()
        self._key, self._unmeasured, self._last_end = None, 0, None
        self._gate.reset(1.0)
        self._gate_count = 0
        self._one_pass, self._gate_layout = None, None

    # -- the step -------------------------------------------------------------------
    _cv_first = True  # whether the control variate's pass runs before the base backward
    _routed = False  # whether the last measured step had block_grad routes
    _gate_count = 0  # direct steps since the gate last read one's gradient
    _unnamed: str | None = None  # a joint state with a parameter outside the param store
    _one_pass: bool | None = None  # whether measured steps take one backward (None: not known)
    _gate_layout: list | None = None  # the one-pass steps' guide parameters [(name, shape)]

    def _cv_grads(self, item, params, blocks, retain: bool) -> dict:
        """``{param: g_cv}`` of one trace pair (the control variate, in loss space)."""
        raise NotImplementedError

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """Negative ELBO (or bound) as a float; accumulates :math:`g_\\text{path} + b \\odot g_\\text{cv}`."""
        loss = 0.0
        saved: dict[torch.Tensor, torch.Tensor | None] = {}  # param -> its .grad before this step
        g_cv: dict[torch.Tensor, torch.Tensor] = {}
        self._routed = False
        for elbo, terms, blocks, trainable, item in self._iter_particle_items(
            model, guide, args, kwargs
        ):
            loss -= elbo
            self._routed = self._routed or bool(blocks)
            if not (terms and trainable) or item is None:
                continue
            params = item["params"]
            for p in params:  # g_path is what the backward below accumulates from None
                if p not in saved:
                    saved[p] = p.grad
                    p.grad = None
            self._before_backward(item, blocks)
            if self._cv_first:  # the small pass first, then the base backward frees the graph
                cv = self._cv_grads(item, params, blocks, retain=True)
            retain = True if not self._cv_first else self.retain_graph
            if not blocks:
                (-sum(terms.values())).backward(retain_graph=retain)
            else:
                routing.backward(
                    {k: -v for k, v in terms.items()},
                    block=blocks,
                    retain_graph=retain,
                    strict=False,
                )
            if not self._cv_first:
                cv = self._cv_grads(item, params, blocks, retain=bool(self.retain_graph))
            for p, g in cv.items():
                g_cv[p] = g if p not in g_cv else g_cv[p] + g
            del item, terms
        names = {p: _param_key(p) for p in g_cv}
        order = sorted(g_cv, key=lambda p: names[p])  # the same order on every rank
        g_path = {p: (p.grad if p.grad is not None else torch.zeros_like(p)) for p in order}
        # this step's weights come from earlier steps only
        keys = [names[p] for p in order]
        self._key = self._cv._SEP.join(keys) if keys else None
        weights = dict(zip(order, self._cv.weight_many(keys, order))) if order else {}
        for p in order:
            b = weights[p]
            if b is not None:
                p.grad = torch.addcmul(g_path[p], b, g_cv[p])
        world = _world(self._distributed)
        flat = _allreduce_mean([g_path[p] for p in order] + [g_cv[p] for p in order], world)
        n = len(order)
        if n:
            p, c = self._cv.update_many(keys, flat[:n], flat[n:])
            if self._cv.mix_gain is not None:  # what a direct step at the gate's endpoint applies
                self._gate.update(p if self._gate.e == 0.0 else p + self._gate.e * c)
        for p, old in saved.items():  # add back what .grad held before the step
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        warn_if_nan(loss, "loss")
        return loss

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        r"""Negative ELBO (or bound) whose gradient is :math:`g_\text{path} + b \odot g_\text{cv}`.

        The path an ``ELBOModule`` (``elbo(model, guide)``), ``DistributedDataParallel``
        and Lightning take: the tensor's ``backward()`` gives the same gradient as
        :meth:`loss_and_grads` on the same draws, and the call updates the moments as
        :meth:`loss_and_grads` does (with :math:`g_\text{path}` and :math:`g_\text{cv}`
        averaged over the ranks of an initialized process group, so :math:`b` is
        identical on every rank). :math:`b` comes from earlier calls only, so the
        gradient is unbiased. The parts are computed here with ``torch.autograd.grad``
        (one extra backward of the base surrogate); the returned surrogate carries
        :math:`b \odot g_\text{cv}` as a term linear in the parameters. Call it once per
        step: every call is a step of the moments.
        """
        loss, surrogate = 0.0, None
        g_path: dict[torch.Tensor, torch.Tensor] = {}
        g_cv: dict[torch.Tensor, torch.Tensor] = {}
        for elbo, terms, blocks, trainable, item in self._iter_particle_items(
            model, guide, args, kwargs
        ):
            loss -= elbo
            gated = {k: routing.gate(v, blocks[k]) if k in blocks else v for k, v in terms.items()}
            if not gated:
                continue
            part = -sum(gated.values())
            surrogate = part if surrogate is None else surrogate + part
            if not trainable or item is None:
                continue
            params = item["params"]
            self._before_backward(item, blocks)
            if self._cv_first:
                cv = self._cv_grads(item, params, blocks, retain=True)
            raw = {k: -v for k, v in terms.items()}
            gs = routing.grad(raw, params, block=blocks, retain_graph=True, strict=False)
            if not self._cv_first:
                cv = self._cv_grads(item, params, blocks, retain=True)
            for p, g in zip(params, gs):
                g_path[p] = g if p not in g_path else g_path[p] + g
            for p, g in cv.items():
                g_cv[p] = g if p not in g_cv else g_cv[p] + g
            del item, terms, gated
        names = {p: _param_key(p) for p in g_cv}
        order = sorted(g_cv, key=lambda p: names[p])  # the same order on every rank
        paths = [g_path[p] if p in g_path else torch.zeros_like(p) for p in order]
        linear = None
        keys = [names[p] for p in order]
        bs = self._cv.weight_many(keys, order) if order else []  # from earlier calls only
        for p, b in zip(order, bs):
            if b is not None:
                term = (b * g_cv[p]).detach().mul(p).sum()
                linear = term if linear is None else linear + term
        world = _world(self._distributed)
        flat = _allreduce_mean(paths + [g_cv[p] for p in order], world)
        n = len(order)
        if n:
            self._cv.update_many(keys, flat[:n], flat[n:])
        if surrogate is None:
            return torch.tensor(loss)
        if linear is not None:
            surrogate = surrogate + (linear - linear.detach())
        warn_if_nan(surrogate, "loss")
        return loss + (surrogate - surrogate.detach())

    def _before_backward(self, item, blocks) -> None:
        pass


def _blocked(blocks, key) -> frozenset:
    entry = (blocks or {}).get(key)
    if not entry:
        return frozenset()
    vals = entry.values() if isinstance(entry, dict) else entry
    return frozenset(id(t) for t in vals if torch.is_tensor(t))


def _grads_by_route(outputs_by_route: dict, params, retain_last: bool = False) -> dict:
    """``sum over routes of d outputs / d params`` (allowed params only); ``{param: grad}``."""
    out: dict = {}
    items = [(blk, outs) for blk, outs in outputs_by_route.items() if outs[0]]
    for i, (blk, (outs, seeds)) in enumerate(items):
        inputs = [p for p in params if id(p) not in blk]
        if not inputs:
            continue
        last = i == len(items) - 1
        gs = torch.autograd.grad(
            outs,
            inputs,
            seeds,
            retain_graph=retain_last or not last,
            allow_unused=True,
        )
        for p, g in zip(inputs, gs):
            if g is not None:
                out[p] = g if p not in out else out[p] + g
    return out


class _Cut:
    """Set ``cut`` on relay groups for the duration of a ``with`` block."""

    def __init__(self, groups):
        self.groups = list(groups)

    def __enter__(self):
        for g in self.groups:
            if g is not None:
                g.cut = True

    def __exit__(self, *exc):
        for g in self.groups:
            if g is not None:
                g.cut = False


def _score_tensor(site):
    """The site's score part (log-density at the detached sample, scaled and masked) and relay group.

    ``None`` for sites without a separate score part: not split (non-reparameterized,
    ``infer={"stl": False}``, fallen back), Delta sites (their density reaches the
    parameters only through earlier draws), and distributions whose entropy term is
    not their log-density (``Rejector``: they keep STL's treatment).
    """
    fn = site["fn"]
    if not isinstance(fn, SplitDistribution):
        return _filled_score(site)
    if not fn.is_split(site["value"]):
        return None
    rec = fn.batch.records.get(site["name"])
    if rec is None or rec.parts is None:
        return None
    if is_delta(fn.base_dist) or getattr(rec, "owner", None) is not None:
        # a Delta (or a structured guide's site): its score part is what the full density
        # adds to the pathwise one (nothing for a Delta computed from earlier draws)
        full, path, _ = rec.parts
        if full.log_prob is path.log_prob or not torch.is_tensor(full.log_prob):
            return None
        # full - pathwise is the score part through every path: no cut points (which would
        # cut the full part's paths through the samples but not the pathwise part's)
        diff = full.log_prob - path.log_prob
        return (scaled(site, diff), None) if diff.requires_grad else None
    full, _, score = rec.parts
    if full.entropy_term is not full.log_prob or not torch.is_tensor(score):
        return None
    if not score.requires_grad:
        return None
    return scaled(site, score), fn.batch.group


def _one_pass_sites(guide_trace, why: list | None = None) -> list[tuple] | None:
    """``[(name, normal, event_ndims, exps)]`` of the guide sites whose score part a one-pass
    step reads at their ``Normal``'s parameters (``exps``: how many ``exp`` transforms push the
    ``Normal`` forward), or ``None`` where the guide needs the general step.

    Every latent guide site must be reparameterized, and each that takes the pathwise gradient
    (:func:`uses_pathwise`) a plain ``Normal``, or one pushed forward by ``exp``
    (:func:`~pyro_gradroute.distributions.normal.normal_pushforward`), whose ``loc`` and
    ``scale`` read no earlier sample, drawn by that ``Normal`` (its value carries the
    parameters' graph), outside a subsampled plate (an element of the moments is then the
    same parameter on every step); or a ``Delta`` whose density and value reach the
    parameters only through earlier samples (no score part). ``why`` gets the reason where
    the guide does not qualify.
    """
    why = [] if why is None else why
    out, nodes = [], {}
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample" or site["is_observed"]:
            continue
        if not latent_site(site):
            why.append(f"guide site '{name}' is enumerated or a subsample site")
            return None
        fn, value = site["fn"], site["value"]
        if delta_base(fn) is not None:
            try:  # (a Delta whose density reads parameters needs the general split)
                site_pathwise(name, fn, value, [], nodes)
            except NeedsGeneralSplit:
                why.append(f"guide site '{name}' is a Delta whose density reads parameters")
                return None
            if site["infer"].get("is_auxiliary") and torch.is_tensor(value) and value.requires_grad:
                if reaches_leaf_directly(value, stop_nodes=nodes):
                    why.append(f"guide site '{name}' is an auxiliary Delta of parameters")
                    return None
        elif not getattr(fn, "has_rsample", False):
            why.append(f"guide site '{name}' is not reparameterized")
            return None
        elif uses_pathwise(site):
            base, nd, transforms = normal_pushforward(fn)
            if base is None or any(type(t) is not ExpTransform for t in transforms):
                # (exp's pre-image, log, is exact to round-off: a log-normal site qualifies)
                why.append(f"guide site '{name}' is a {type(fn).__name__}, not a plain Normal")
                return None
            ps = [t for t in (base.loc, base.scale) if t.requires_grad]
            if ps:
                if not (torch.is_tensor(value) and value.requires_grad) or frontier(ps, nodes):
                    why.append(f"guide site '{name}' reads an earlier sample (or was replayed)")
                    return None
                if passes_product(ps, nodes):
                    # amortized: moments per network weight, as minibatches change
                    why.append(f"guide site '{name}' is amortized (a network computes it)")
                    return None
                if any(
                    f.full_size is not None and f.full_size != f.size
                    for f in site["cond_indep_stack"]
                ):
                    why.append(f"guide site '{name}' is in a subsampled plate")
                    return None
                out.append((name, base, nd, len(transforms)))
        if torch.is_tensor(value) and value.grad_fn is not None:
            nodes[value.grad_fn] = len(nodes)
    return out


def _transformed(fn) -> bool:
    """Whether ``fn`` evaluates through transforms (a detached value would miss their caches)."""
    while True:
        if isinstance(fn, TransformedDistribution):
            return True
        fn = getattr(fn, "base_dist", None)
        if fn is None:
            return False


def _filled_score(site):
    r"""The score part of a site whose ``score_parts`` the default STL path filled (no relays).

    ``log q(z; phi) - log q(z; stop(phi))``: value 0, gradient the score part
    :math:`\nabla_\phi \log q(\bot(z); \phi)` with every sample held fixed (the paths
    through the sample, and through the earlier samples a conditional site reads, cancel).
    """
    if not latent_site(site) or not uses_pathwise(site) or is_delta(site["fn"]):
        return None
    value = site["value"]
    if not (torch.is_tensor(value) and torch.is_grad_enabled()):
        return None
    if not getattr(site["score_parts"], "conditional", True) and not _transformed(site["fn"]):
        # parameters read no earlier sample: the density at the detached sample is the
        # score part (a backward that reaches the parameters only)
        score = scaled(site, site["fn"].log_prob(value.detach()))
        return (score, None) if score.requires_grad else None
    full = scaled(site, site["fn"].log_prob(value))
    if not full.requires_grad:
        return None
    return full - site["log_prob"], None


# ----------------------------------------------------------------------------- STL
class TraceAdaptiveSTL_ELBO(_AdaptiveMixin, TraceSTL_ELBO):
    r"""Trace ELBO whose score part is added back with a per-element weight chosen from past steps.

    The recommended default: it starts as ``Trace_ELBO`` and moves each parameter element
    to STL, or to the variance-optimal mix of the two, once earlier steps show that this
    has lower gradient variance. Every step is unbiased.

    **The estimator.** For a reparameterized guide :math:`z = g(\epsilon; \phi)` the
    loss gradient of :class:`Trace_ELBO` splits into two parts,

    .. math::

        \underbrace{-\nabla_\phi\big[\log p(x, z) - \log q(z; \bot(\phi))\big]}_{g_\text{path}
            \;(\text{STL})}
        \;+\; \underbrace{\nabla_\phi \log q(\bot(z); \phi)}_{g_\text{score}},

    where :math:`\bot` is stop-gradient; for a conditional guide
    :math:`\log q(\bot(z); \phi) = \sum_i \log q_i(\bot(z_i) \mid \bot(z_{<i}); \phi)` holds
    every sample fixed. The score part has mean zero for every :math:`\phi`:
    :math:`\mathbb E_q[\nabla_\phi \log q(z;\phi)] = \nabla_\phi \int q = 0`. So for
    any weight vector :math:`b` (one entry per parameter element) that does not depend
    on the current draw,

    .. math::

        g(b) = g_\text{path} + b \odot g_\text{score},\qquad
        \mathbb E[g(b)] = \mathbb E[g_\text{path}] = \nabla_\phi(-\text{ELBO}),

    with :math:`b = 0` STL and :math:`b = 1` ``Trace_ELBO``. Elementwise,
    :math:`\operatorname{Var} g(b) = \operatorname{Var} g_\text{path}
    + 2b\operatorname{Cov}(g_\text{path}, g_\text{score}) + b^2 \operatorname{Var} g_\text{score}`
    is smallest at

    .. math::

        b^\star = -\frac{\operatorname{Cov}(g_\text{path}, g_\text{score})}
                       {\operatorname{Var} g_\text{score}}
                = -\frac{\mathbb E[(g_\text{path} - \mathbb E g_\text{path})\, g_\text{score}]}
                        {\mathbb E[g_\text{score}^2]},

    where the variance is at most that of both STL and ``Trace_ELBO``. Because
    :math:`\mathbb E[g_\text{score}] = 0`, every candidate's variance relative to STL,

    .. math::

        \operatorname{Var} g(b) - \operatorname{Var} g(0)
            = 2b\,\mathbb E[g_\text{path}\, g_\text{score}] + b^2\, \mathbb E[g_\text{score}^2],
        \qquad
        \operatorname{Var} g(b) = \operatorname{Var} g(b^\star)
            + (b - b^\star)^2 \operatorname{Var} g_\text{score},

    comes from the same two parts of every step, without an estimate of the mean of
    :math:`g_\text{path}`, which drifts during training.

    **The policy: which** :math:`b`. Per element, from the parts of earlier steps with
    weights ``decay`` :math:`^{\text{age}}` (effective number of samples
    :math:`n = (\sum w)^2/\sum w^2`, 19 at the default 0.9):

    1. the fit :math:`\hat b`, minus the weighted least-squares slope of
       :math:`g_\text{path}` on :math:`g_\text{score}` with an intercept (the intercept
       only removes the mean gradient's noise). It is exact where :math:`g_\text{path}`
       is an affine function of :math:`g_\text{score}`: 0 at an exact posterior (STL's
       gradient is 0 on every draw), 1 where ``Trace_ELBO``'s gradient is deterministic;
    2. its standard error :math:`s`, by the delta method:
       :math:`s^2 = \mathbb E[x^2 (y + \hat b x)^2] / ((n - 2) \operatorname{Var}(x)^2)`,
       :math:`x, y` the two parts centred at the means of the steps before;
    3. the endpoint :math:`e`: ``Trace_ELBO`` (1) unless STL (0) is better by ``confidence``
       :math:`= z` standard errors, :math:`\hat b + z s < 1/2` (STL beats ``Trace_ELBO``
       exactly when :math:`b^\star < 1/2`);
    4. the weight, moved from :math:`e` towards :math:`\hat b` by a positive-part
       James-Stein factor: :math:`b = e + \lambda (\hat b - e)`,
       :math:`\lambda = \max\big(0,\, 1 - (z s)^2 / (\hat b - e)^2\big)`: it stays at the
       endpoint while :math:`\hat b` is within :math:`z` standard errors of it.

    The first ``warmup`` measured steps, and a parameter new to the estimator (or whose
    shape changed: its state is reset), use :math:`b = 1`: the first step is exactly
    ``Trace_ELBO``'s. Far from the posterior the score part is what cancels the noise of
    the entropy gradient (for a Normal site, :math:`\partial/\partial\log\sigma` of the
    entropy is :math:`-1` under ``Trace_ELBO``, :math:`-\epsilon^2`, variance 2, under
    STL), so training starts where ``Trace_ELBO`` is the better estimator and moves to
    STL where the model term starts cancelling that noise instead.

    **"Never worse": what holds and where it cannot.** Along a whole run:

    * *unbiased at every step*, whatever :math:`b` is (below): exact;
    * *per-step variance no larger than the better of STL and* ``Trace_ELBO`` (the
      endpoint :math:`e^\star` closer to :math:`b^\star`) holds at the current parameters
      whenever :math:`|b - b^\star| \le |e^\star - b^\star|`, by the second identity.
      With :math:`e = e^\star`, :math:`b` lies between :math:`e` and :math:`\hat b`, so it
      suffices that :math:`|\hat b - b^\star| \le |e^\star - b^\star|`; the shrinkage makes
      the expected excess :math:`\mathbb E(b - b^\star)^2 \operatorname{Var} g_\text{score}`
      small where this fails (a noisy :math:`\hat b` is not followed). When the endpoint
      is the other one (the evidence did not reach :math:`z` standard errors), the excess
      is :math:`|1 - 2b^\star| \operatorname{Var} g_\text{score} \lesssim 2 (z + 1) s
      \operatorname{Var} g_\text{score}`, and :math:`s` shrinks as :math:`1/\sqrt n`;
    * it is *not* a certainty: it is a statistical statement with error :math:`s`; it
      uses moments of earlier parameters, so it lags when :math:`b^\star` moves faster
      than the window (``decay``) follows; heavy-tailed parts make :math:`s` itself
      unreliable at small :math:`n`. And lower per-step variance is not the final ELBO:
      that is measured. ``python benchmarks/bench_adaptive.py --training`` (Pyro's
      settings and initialisations, 1000 steps, 5 paired seeds, final ELBO from 2000
      draws), paired difference to Pyro's ``Trace_ELBO`` / to STL: eight schools
      (Pyro's ``svi.py``, ``0.1 * rand`` scales) +0.04 +/- 0.02 / +3.24 +/- 0.30; the
      Bayesian-regression tutorial (``AutoDiagonalNormal``, diabetes) +1.26 +/- 0.61 /
      +0.07 +/- 0.04; a hierarchical model with ``AutoNormal`` (J=50) +6.90 +/- 0.18 /
      +15.69 +/- 0.24. At equal CPU time on real models: ``benchmarks/bench_convergence.py``.

    **Unbiasedness condition.** Step :math:`t` applies :math:`b_t` computed from steps
    :math:`< t` only (the moments are updated *after* the step's gradient is formed).
    Conditionally on the past, :math:`b_t` is then a constant and
    :math:`\mathbb E[g_t \mid \text{past}] = \mathbb E[g_\text{path}] + b_t \odot
    \mathbb E[g_\text{score}] = \nabla(-\text{ELBO})` at the current parameters: every
    step is unbiased, whatever the moments hold. This needs (i) :math:`z` drawn from
    :math:`q(\cdot;\phi)` itself, so that the score has mean zero (true for every
    reparameterized site; the support must not depend on :math:`\phi`), and (ii)
    :math:`b_t` independent of step :math:`t`'s draws (never reuse the same draw for
    the moments and the step). With ``num_particles`` the moments are those of the
    step's averaged gradient, whose :math:`b^\star` equals a single particle's.

    **Cost: measured and direct steps.** A *measured* step forms both parts: one model
    and one guide pass (the default STL path: no relays for plain families), the base
    backward, and one small backward of the score parts
    :math:`\log q(z;\phi) - \log q(z;\bot(\phi))` (it reaches the guide's parameters only;
    for an amortized guide, one backward of the encoder), plus eight buffers (five without
    ``center``) of each guide parameter's size, kept as one joint state for the step's
    parameters (one fit and one update per step; the fit recomputed every 4 steps after
    the first 5 past warm-up). It costs about 1.3-1.45 ``Trace_ELBO`` steps on small
    models. **One pass where the guide allows it:** where every guide site with a score
    part is a plain ``Normal`` (``Independent`` and ``expand`` of one, or a ``LogNormal``: its
    score part read at the ``Normal``'s draw ``log z``) whose ``loc`` and
    ``scale`` read no earlier sample, lie in no subsampled plate and come from no matrix
    product (``AutoNormal``, ``AutoDiagonalNormal``, hand-written mean-field guides; not an
    amortized encoder), measured steps after the first are Pyro's ``Trace_ELBO`` step with
    hooks at each site's ``loc`` and ``scale`` (:meth:`_one_pass_step`): the score part there
    is closed-form, so the second backward is not needed, and the moments are kept per
    element of those tensors, named ``"<site>.loc"`` and ``"<site>.scale"``. Such a step costs
    about 1.1-1.2 ``Trace_ELBO`` steps on small models (the moments' own arithmetic). A
    *direct* step takes one endpoint's gradient with one backward and no score
    part: ``Trace_ELBO``'s is Pyro's own :class:`pyro.infer.Trace_ELBO` step (its cost
    exactly; this package's routed :class:`Trace_ELBO` where the last measured step had
    ``block_grad`` routes), STL's is :class:`TraceSTL_ELBO`'s. In one process,
    ``loss_and_grads`` (SVI's path) chooses, from earlier steps only:

    1. **the gate** (:class:`_Gate`): for every :math:`b`,
       :math:`S(b) = \lVert \mathbb E g \rVert^2 + \sum_e \operatorname{Var} g_e(b)
       \ge \lVert \mathbb E g \rVert^2`, so no weights can reduce the second moment of the
       endpoint :math:`e` the steps take by more than
       :math:`B = S(e) / \lVert \mathbb E g \rVert^2`, which the applied gradients alone
       estimate (:math:`\mathbb E \lVert g_t \rVert^2 / \mathbb E \langle g_t, g_{t-1}
       \rangle`, two dot products a step). While :math:`B \le` ``mix_gain`` no step
       measures: far from the optimum, where the mean gradient dominates (Pyro's narrow
       initial scales), the estimator runs at ``Trace_ELBO``'s cost. The first step measures
       (it names the parameters); until the gate has 3 effective samples, warm-up steps
       (:math:`b = 1`) are ``Trace_ELBO``'s own steps, each feeding the gate;
    2. otherwise, until the policy settles (``warmup`` plus 5 measured steps), every step
       measures;
    3. once settled, while every weight is exactly 0 or 1, or the better endpoint's
       predicted total second moment :math:`S(e)` is within ``mix_gain`` of the fitted
       weights' :math:`S(b)` (both from the moments, by the first identity above), steps
       take that endpoint directly, measuring one step in 4, then one in 8, 16 and 32 while
       the policy keeps the choice and predicts that the mix would gain little
       (:math:`S(e)` within 5% of :math:`S(b)`; otherwise one in 4, and back to one in 4
       when the choice changes); where the mix pays more than ``mix_gain``, every step
       measures and applies it.

    A normalized optimizer's step advances by the mean's share of :math:`S`: far from the
    optimum removing variance buys little, so the cheaper step wins there, while near it the
    variance dominates. ``mix_gain`` (default 2) is above what a measured step costs
    (1.3-1.45 direct steps on small models) because a smaller second moment shortens the
    noise of Adam's steps less than proportionally. ``differentiable_loss`` and distributed runs measure every step. Every choice comes from
    earlier steps, so a direct step is unbiased too: it is the estimator with
    :math:`b \equiv e`.

    **Sites.** Sites without a score part (``Delta``, non-reparameterized sites,
    ``infer={"stl": False}``, flows that cannot be split, ``Rejector``-like families with
    their own ``score_parts``) contribute nothing to :math:`g_\text{score}`: they behave
    as under :class:`TraceSTL_ELBO`. ``block_grad`` routes apply to both parts: a guide
    site blocked from a parameter sends it neither its pathwise nor its score part.
    Parameters are identified by their param-store name (``control_variate_weights()``,
    ``state_dict()``); on the one-pass path, the weights belong to the guide sites' ``Normal``
    parameters (``"<site>.loc"``, ``"<site>.scale"``): for a guide whose ``loc`` and ``scale``
    are elementwise functions of its parameters (``AutoNormal``: the location itself and a
    softplus of the scale parameter) that is the same weight, element by element.

    **Distributed.** With an initialized ``torch.distributed`` group of more than one
    process (``distributed=None``: detected; ``True``: required; ``False``: never), the
    step's :math:`g_\text{path}` and :math:`g_\text{score}` are averaged over the ranks
    (one ``all_reduce``) before the moments are updated, so :math:`b` is identical on
    every rank and :class:`~pyro_gradroute.distributed.DistributedOptimizer`'s average of
    the ranks' ``.grad`` is :math:`\bar g_\text{path} + b \odot \bar g_\text{score}`.
    Every rank must then call ``loss_and_grads`` at every step.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro.infer import SVI
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceAdaptiveSTL_ELBO
        >>> def model(x):
        ...     mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("x", dist.Normal(mu, 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> elbo = TraceAdaptiveSTL_ELBO(num_particles=4, vectorize_particles=True, decay=0.9)
        >>> svi = SVI(model, AutoNormal(model), pyro.optim.Adam({"lr": 0.05}), elbo)
        >>> x = torch.randn(10)
        >>> for _ in range(20):
        ...     loss = svi.step(x)
        >>> sorted(elbo.control_variate_weights())
        ['AutoNormal.locs.mu', 'AutoNormal.scales.mu']
        >>> state = elbo.state_dict()  # resume later with elbo.load_state_dict(state)

    :param decay: weight of the previous steps' moments (the effective number of samples
        tends to ``(1 + decay) / (1 - decay)``: 19 steps at 0.9). The window must be
        short beside the optimizer's timescale, as :math:`b^\star` moves with the
        parameters; the shrinkage keeps a short window's noise from costing variance.
    :param clip: optional bound on :math:`|\hat b|`.
    :param warmup: measured steps at :math:`b = 1` (``Trace_ELBO``) before the policy may
        move (steps the gate takes directly do not count).
    :param confidence: :math:`z`, in standard errors of :math:`\hat b`: STL is chosen
        over ``Trace_ELBO`` only when it is better by :math:`z` standard errors, and the
        weight leaves that endpoint only by as much as the evidence allows.
    :param fixed_weight: a fixed :math:`b` for every element instead of the policy
        (0: STL, 1: ``Trace_ELBO``; unbiased for any value).
    :param center: fit with an intercept (the default); ``False`` sets it to 0, which
        relies on :math:`\mathbb E[g_\text{score}] = 0` alone and is noisier far from the
        optimum, where :math:`\mathbb E[g_\text{path}]` is large (five buffers instead of
        eight; no direct steps while the weights are mixed).
    :param distributed: average the parts over ``torch.distributed`` ranks (see above).
    :param mix_gain: the smallest predicted reduction of the gradient's second moment,
        better endpoint over the fitted mix, for which every step measures; below it most
        steps take the endpoint directly, and while the gate's bound on any weights' gain
        stays below it no step measures (see **Cost**). ``None``: no gate, and every step
        measures while the weights are mixed. ``math.inf``: never mix: a *measured switch*
        between the whole estimators, ``Trace_ELBO`` first and STL once its predicted second
        moment :math:`S(0)` is the lower (each step one endpoint's gradient at that
        endpoint's cost, plus the measured steps; the gate measures once :math:`B > 2`).

    Other arguments are :class:`pyro.infer.Trace_ELBO`'s.
    """

    def __init__(
        self,
        num_particles: int = 1,
        max_plate_nesting: float = math.inf,
        *args,
        decay: float = 0.9,
        clip: float | None = None,
        warmup: int = 5,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        center: bool = True,
        distributed: bool | None = None,
        mix_gain: float | None = 2.0,
        **kwargs,
    ):
        super().__init__(num_particles, max_plate_nesting, *args, **kwargs)
        self._init_cv(decay, clip, warmup, center, distributed, confidence, fixed_weight, mix_gain)
        kwargs.pop("trace_steps", None)
        # a direct Trace_ELBO step is Pyro's own; where the last measured step had block_grad
        # routes, the routed Trace_ELBO's (Pyro's gates cannot route REINFORCE terms)
        self._trace = self._PYRO(num_particles, max_plate_nesting, *args, **kwargs)
        self._routed_trace = Trace_ELBO(num_particles, max_plate_nesting, *args, **kwargs)

    _PYRO = _PyroTrace_ELBO  # Pyro's estimator whose steps the direct and one-pass steps are

    #: while the policy keeps choosing the same endpoint, the parts are measured on one step
    #: in ``_MEASURE_EVERY``, then in twice as many after each measurement that confirms the
    #: choice, up to one in ``_MEASURE_MAX``
    _MEASURE_EVERY, _MEASURE_MAX = 4, 32
    #: the waits grow only while the better endpoint's predicted second moment is within this
    #: factor of the mix's (the mix would gain little); closer to ``mix_gain``, one in 4
    _CALM = 1.05

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        """As :meth:`_AdaptiveMixin.loss_and_grads`, with direct steps (one backward, no score
        parts, no moments of the parts), chosen from earlier steps only, so every step stays
        unbiased:

        * while the gradients the steps apply bound the gain of any weights within
          ``mix_gain`` (:class:`_Gate`), no step measures: each takes the gate's endpoint
          (``Trace_ELBO`` first) directly;
        * while the policy says a whole estimator would do (``mix_gain``), a measured step
          every 4, then 8, 16 and 32 steps while the choice holds."""
        end, ratio = self._cv.settled(self._key) if self._key is not None else (None, 1.0)
        if end is None or end != self._last_end:
            self._unmeasured, self._interval = 0, self._MEASURE_EVERY
        self._last_end = end
        if _world(self._distributed) > 1:
            return super().loss_and_grads(model, guide, *args, **kwargs)
        if self._cv.fixed_weight is not None:
            return self._measured_step(model, guide, args, kwargs)
        gate, gain = self._gate, self._cv.mix_gain
        if end is not None and end != gate.e:
            gate.reset(end)
        if gain is not None and self._key is not None and self._unnamed != self._key:
            if gate.bound() <= (self._SWITCH_GATE if gain == math.inf else gain):
                return self._direct_step(gate.e, model, guide, args, kwargs)
            st = self._cv.state.get(self._key)
            if not gate.known() and (st is None or st["n"] <= self._cv.warmup):
                # in warm-up b = 1: Trace_ELBO's own step is that step, and it feeds the gate
                return self._direct_step(1.0, model, guide, args, kwargs, every=1)
        if end is not None:
            self._unmeasured += 1
            if self._unmeasured < self._interval:
                return self._direct_step(end, model, guide, args, kwargs)
            # this step measures; while the mix would gain little the next wait is longer
            self._unmeasured = 0
            calm = ratio <= self._CALM
            self._interval = (
                min(2 * self._interval, self._MEASURE_MAX) if calm else self._MEASURE_EVERY
            )
        return self._measured_step(model, guide, args, kwargs)

    def _measured_step(self, model, guide, args, kwargs) -> float:
        """A step that forms both parts: in one pass where an earlier measured step found the
        guide allows it (:meth:`_one_pass_step`), else with the parts' second backward (which
        also finds whether the guide allows one pass)."""
        if self._one_pass and not self.vectorize_particles:
            return self._one_pass_step(model, guide, args, kwargs)
        self._gate_layout, self._qualifies = None, True
        loss = super().loss_and_grads(model, guide, *args, **kwargs)
        if self._one_pass is None and self._key is not None:
            self._one_pass = self._qualifies and not self._routed
        return loss

    #: the gate's threshold with ``mix_gain=inf`` (a switch between the whole estimators: the
    #: parts are measured once the other endpoint could gain this much)
    _SWITCH_GATE = 2.0

    #: a direct step's gradient goes into the gate's moments on one direct step in this many
    #: (two draws ``k`` steps apart are as independent as neighbours: the bound stays unbiased)
    _GATE_EVERY = 4

    def _direct_step(self, end: float, model, guide, args, kwargs, every: int = 0) -> float:
        """One step of the endpoint ``end`` (1: Pyro's ``Trace_ELBO``, 0: STL); on one in
        ``_GATE_EVERY``, its gradient on the parameters of the last measured step goes into the
        gate's moments."""
        self._gate_count = (self._gate_count + 1) % (every or self._GATE_EVERY)
        params = []
        if self._gate_count == 0:
            store = dict(pyro.get_param_store().named_parameters())
            layout = self._gate_layout or self._cv.layouts.get(self._key, ())
            params = [store.get(n) for n, _ in layout]
            if not params or any(p is None for p in params):
                # a parameter outside the param store (or no longer in it): direct steps cannot
                # feed the gate, so it stays open for these parameters (steps measure)
                self._unnamed, params = self._key, []
                self._gate.reset(end)
            elif any(tuple(p.shape) != shape for p, (_, shape) in zip(params, layout)):
                # a new problem reusing the names: the policy starts again (the next step measures)
                self._cv.state.pop(self._key, None)
                self._cv.layouts.pop(self._key, None)
                self._key, params = None, []
                self._gate.reset(1.0)
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        loss = self._endpoint_step(end, model, guide, args, kwargs)
        if params:
            zero = torch.zeros_like
            self._gate.update(
                torch.cat([(zero(p) if p.grad is None else p.grad).reshape(-1) for p in params])
            )
        for p, old in zip(params, saved):  # add back what .grad held before the step
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        return loss

    def _endpoint_step(self, end: float, model, guide, args, kwargs) -> float:
        """The whole estimator ``end``'s step (1: Pyro's ``Trace_ELBO``, 0: STL)."""
        if end == 1.0:
            trace = self._routed_trace if self._routed else self._trace
            trace.max_plate_nesting = self.max_plate_nesting
            return trace.loss_and_grads(model, guide, *args, **kwargs)
        self._scores = False
        try:
            return RoutedELBO.loss_and_grads(self, model, guide, *args, **kwargs)
        finally:
            self._scores = True

    def _particles(self, model, guide, args, kwargs):
        """``(model_trace, guide_trace, loss, surrogate)`` per particle of Pyro's estimator."""
        self._trace.max_plate_nesting = self.max_plate_nesting
        return trace_elbo_particles(self._trace, model, guide, args, kwargs)

    def _not_one_pass(self, why: list) -> None:
        """A trace the one-pass step cannot take (``why``: the reason, if known); here the
        step falls back to ``Trace_ELBO``'s."""

    _scores = True  # False during a direct step: no score parts are formed

    def _one_pass_step(self, model, guide, args, kwargs) -> float:
        r"""A measured step in one backward: Pyro's ``Trace_ELBO`` step, with both parts read and
        the weights applied at the guide sites' ``Normal`` parameters.

        Where every guide site with a score part is a plain ``Normal`` whose ``loc`` and
        ``scale`` read no earlier sample (:func:`_one_pass_sites`), the backward of
        ``Trace_ELBO``'s surrogate reaches each site's :math:`\theta = (\mu, \sigma)` with
        :math:`t = p + c`: :math:`c` the score part there, in closed form
        (:func:`~pyro_gradroute.distributions.normal.normal_score`), :math:`p` the pathwise
        part. A hook (:class:`~pyro_gradroute.routing.taps`) sends :math:`t + (b - 1) c = p + b
        c` on to the parameters, and records :math:`t`: the step's gradient is
        :math:`g_\text{path} + J^\top (b \odot c)`, :math:`J` the Jacobian of
        :math:`\theta` in the parameters, which reads no sample. So :math:`b` weighs each
        element of :math:`\theta`; with :math:`b` from earlier steps, :math:`\mathbb E[c] = 0`
        keeps the step unbiased, :math:`b = 1` is ``Trace_ELBO``'s step and :math:`b = 0`
        STL's. The moments are kept per element of :math:`\theta`, under the names
        ``"<site>.loc"`` and ``"<site>.scale"``. Where the guide does not qualify (found on
        this step's trace), the step is ``Trace_ELBO``'s (:math:`b = 1`, nothing measured)
        and later measured steps take the general path."""
        trace = self._trace
        n = self.num_particles
        loss, ok, keys, bs, feed, routed, const = 0.0, True, None, None, False, False, 1.0
        key = ""  # the joint state's name (set with keys)
        acc: dict[str, list] = {}
        params: dict[str, torch.Tensor] = {}
        saved: dict[torch.Tensor, torch.Tensor | None] = {}
        for model_trace, guide_trace, loss_p, surrogate in self._particles(
            model, guide, args, kwargs
        ):
            self._refuse_enumeration(model_trace, guide_trace)
            loss += loss_p / n
            blocks = collect_blocks(model_trace, guide_trace)
            routed = routed or bool(blocks)
            why = ["block_grad routes"] if blocks else []
            sites = _one_pass_sites(guide_trace, why) if ok and not blocks else None
            if ok and sites is None:
                self._not_one_pass(why)
            ok = sites is not None
            entries, parts = [], []
            if ok:
                for name, base, nd, exps in sites:
                    site = guide_trace.nodes[name]
                    value = site["value"].detach()
                    for _ in range(exps):  # the Normal's own draw under exp transforms
                        value = value.log()
                    for part, t, c in normal_score(base, nd, value, site["scale"], site["mask"]):
                        parts.append((f"{name}.{part}", t, c / n if n > 1 else c))
                parts.sort(key=lambda x: x[0])
                names = [k for k, _, _ in parts]
                if keys is None:
                    keys, key = names, self._cv._SEP.join(names)
                    # a step at the gate's endpoint: its gradient feeds the gate
                    const = self._cv.constant_weight(key)
                    feed = self._cv.mix_gain is not None and const == self._gate.e
                    if const != 1.0:
                        bs = self._cv.weight_many(keys, [c for _, _, c in parts]) if keys else []
                ok = names == keys
            if ok:
                if const == 1.0:  # Trace_ELBO's step: the hooks only read the gradient
                    entries = [(t, None) for _, t, _ in parts]
                else:
                    entries = [(t, (b - 1) * c) for (_, t, c), b in zip(parts, bs)]
                for p in _trace_params(guide_trace):
                    if p not in saved:
                        params[_param_key(p)], saved[p] = p, p.grad  # the step's own gradient,
                        p.grad = None  # for the gate
            if not getattr(surrogate, "requires_grad", False) or not any(
                site["type"] == "param"
                for tr in (model_trace, guide_trace)
                for site in tr.nodes.values()
            ):
                continue
            if blocks:  # this package's routed Trace_ELBO on these traces
                _, terms = self._routed_trace._particle_terms(model_trace, guide_trace, blocks)
                blocks = _joint_blocks(terms, blocks)
                terms = {
                    k: -v / n for k, v in terms.items() if torch.is_tensor(v) and v.requires_grad
                }
                routing.backward(terms, block=blocks, retain_graph=trace.retain_graph, strict=False)
                continue
            with routing.taps(entries) as seen:
                (surrogate / n).backward(retain_graph=trace.retain_graph)
            if ok and entries:
                if any(g is None for g in seen):
                    ok = False
                    continue
                for (k, _, c), g in zip(parts, seen):
                    a = acc.get(k)
                    if a is None:
                        acc[k] = [g - c, c]
                    else:
                        a[0], a[1] = a[0] + (g - c), a[1] + c
        self._routed = routed
        measured = ok and keys and len(acc) == len(keys)
        if measured:
            if self._key is not None and self._key != key:
                self._cv.state.pop(self._key, None)  # the general path's state (a first step)
                self._cv.layouts.pop(self._key, None)
            self._cv.update_many(keys, [acc[k][0] for k in keys], [acc[k][1] for k in keys])
            self._key = key
            self._gate_layout = [(k, tuple(params[k].shape)) for k in sorted(params)]
            if feed and params:  # the step's own gradient, in the gate layout's order
                ps = [params[k] for k in sorted(params)]
                gs = [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in ps]
                self._gate.update(torch.cat(gs))
        for p, old in saved.items():  # add back what .grad held before the step
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        if not ok:
            self._one_pass = False  # later measured steps: the general path
        elif measured:
            self._one_pass = True
        return loss

    def _refuse_enumeration(self, model_trace, guide_trace) -> None:
        for name, site in model_trace.nodes.items():
            if (
                site["type"] == "sample"
                and site["infer"].get("enumerate")
                and not site["is_observed"]
                and name not in guide_trace.nodes
            ):
                raise ValueError(
                    f"model site {name!r} is marked for enumeration, which "
                    f"{type(self).__name__} does not do (it would be sampled from its prior, "
                    "a different objective): use pyro_gradroute.infer.TraceEnumAdaptiveSTL_ELBO "
                    "(this estimator over pyro.infer.TraceEnum_ELBO), or pyro.infer.TraceEnum_ELBO "
                    "with the guide under pyro_gradroute.poutine.stick_the_landing, or remove the "
                    "enumeration mark"
                )

    _qualifies = False  # whether the general step's traces allow one-pass steps

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        self._refuse_enumeration(model_trace, guide_trace)
        if self._qualifies and (blocks or _one_pass_sites(guide_trace) is None):
            self._qualifies = False
        elbo, terms = super()._particle_terms(model_trace, guide_trace, blocks)
        if self._scores and torch.is_grad_enabled():
            scores = []
            for name, site in guide_trace.nodes.items():
                if site["type"] != "sample" or site["is_observed"]:
                    continue
                s = _score_tensor(site)
                if s is not None:
                    scores.append((("guide", name), s[0].sum(), s[1]))
            terms[EXTRA] = {"params": _trace_params(model_trace, guide_trace), "scores": scores}
        return elbo, terms

    def _cv_grads(self, item, params, blocks, retain: bool) -> dict:
        scores = item["scores"]
        if not scores:
            return {}
        n = self._particle_divisor()
        out: dict = {}
        # scores taken with the relays cut, and those that need every path (group None)
        cut = [x for x in scores if x[2] is not None]
        uncut = [x for x in scores if x[2] is None]
        for i, part in enumerate(p for p in (cut, uncut) if p):
            by_route: dict = {}
            for key, s, _ in part:
                outs, seeds = by_route.setdefault(_blocked(blocks, key), ([], []))
                outs.append(s / n if n > 1 else s)
                seeds.append(torch.ones_like(s))
            last = i == (1 if cut and uncut else 0)
            with _Cut(g for _, _, g in part):
                gs = _grads_by_route(by_route, params, retain_last=retain or not last)
            for p, g in gs.items():
                out[p] = g if p not in out else out[p] + g
        return out


class TraceEnumAdaptiveSTL_ELBO(TraceAdaptiveSTL_ELBO):
    r""":class:`TraceAdaptiveSTL_ELBO` for models with enumerated discrete sites: Pyro's
    :class:`pyro.infer.TraceEnum_ELBO` with the guide's score part added back with a weight
    chosen from earlier steps.

    The enumerated sites are summed out exactly as ``TraceEnum_ELBO`` does; the continuous
    guide's gradient is :math:`g_\text{path} + b \odot g_\text{score}` as in
    :class:`TraceAdaptiveSTL_ELBO` (unbiased for any :math:`b` from earlier steps), with
    :math:`b = 1` ``TraceEnum_ELBO``'s gradient and :math:`b = 0` ``TraceEnum_ELBO``'s with the
    guide under :func:`~pyro_gradroute.poutine.stick_the_landing`. Its direct steps are exactly
    those two (Pyro's ``TraceEnum_ELBO.loss_and_grads``, the second on
    ``stick_the_landing(guide)``); its measured steps take one backward, with the parts read at
    the guide sites' ``Normal`` parameters (:meth:`TraceAdaptiveSTL_ELBO._one_pass_step`), so
    every guide site with a score part must be a plain ``Normal`` whose ``loc`` and ``scale``
    read no earlier sample (``AutoNormal``, ``AutoDiagonalNormal`` and mean-field guides of
    the continuous sites): other guides raise a ``ValueError`` naming the site. Gate, policy
    and arguments are :class:`TraceAdaptiveSTL_ELBO`'s; ``max_plate_nesting`` is best given
    (``TraceEnum_ELBO`` guesses it otherwise, once). ``block_grad`` routes, vectorized particles, distributed runs
    and ``differentiable_loss`` are not supported (each raises, saying what to use).

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro import poutine
        >>> from pyro.infer import SVI, config_enumerate
        >>> from pyro.infer.autoguide import AutoNormal
        >>> from pyro_gradroute.infer import TraceEnumAdaptiveSTL_ELBO
        >>> @config_enumerate
        ... def model(x):
        ...     locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([2]).to_event(1))
        ...     with pyro.plate("data", len(x)):
        ...         k = pyro.sample("k", dist.Categorical(torch.ones(2) / 2))
        ...         pyro.sample("x", dist.Normal(locs[k], 1.0), obs=x)
        >>> pyro.clear_param_store()
        >>> guide = AutoNormal(poutine.block(model, hide=["k"]))
        >>> elbo = TraceEnumAdaptiveSTL_ELBO(max_plate_nesting=1)
        >>> svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), elbo)
        >>> x = torch.cat([torch.randn(10) - 2, torch.randn(10) + 2])
        >>> for _ in range(10):
        ...     loss = svi.step(x)
        >>> sorted(elbo.control_variate_weights())
        ['locs_unconstrained.loc', 'locs_unconstrained.scale']
    """

    def __init__(
        self, num_particles: int = 1, max_plate_nesting: float = math.inf, *args, **kwargs
    ):
        super().__init__(num_particles, max_plate_nesting, *args, **kwargs)
        if self.vectorize_particles:
            raise NotImplementedError(
                f"{type(self).__name__}: vectorize_particles is not supported; use "
                "num_particles without vectorize_particles (a loop over particles)"
            )
        self._trace.retain_graph = True  # as TraceEnum_ELBO's own backward

    _PYRO = _PyroTraceEnum_ELBO

    def _refuse_enumeration(self, model_trace, guide_trace) -> None:
        pass  # enumeration is what this estimator is for

    def loss_and_grads(self, model, guide, *args, **kwargs) -> float:
        if _world(self._distributed) > 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not average its parts over ranks; use "
                "pyro.infer.TraceEnum_ELBO with the guide under stick_the_landing, or one process"
            )
        return super().loss_and_grads(model, guide, *args, **kwargs)

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} forms its gradient with hooks in loss_and_grads (SVI's "
            "path); for a loss tensor use pyro.infer.TraceEnum_ELBO(...).differentiable_loss "
            "with the guide under pyro_gradroute.poutine.stick_the_landing"
        )

    def _measured_step(self, model, guide, args, kwargs) -> float:
        return self._one_pass_step(model, guide, args, kwargs)

    def _not_one_pass(self, why: list) -> None:
        raise ValueError(
            f"{type(self).__name__}: {why[0] if why else 'this guide is not supported'}; it "
            "needs every guide site with a score part to be a plain Normal whose loc and "
            "scale read no earlier sample (AutoNormal, AutoDiagonalNormal, mean-field guides). "
            "Use pyro.infer.TraceEnum_ELBO with the guide under "
            "pyro_gradroute.poutine.stick_the_landing (trace_steps=N to start at TraceEnum_ELBO)"
        )

    def _sync(self) -> None:
        if self.max_plate_nesting != math.inf:  # (else TraceEnum_ELBO keeps the one it guessed)
            self._trace.max_plate_nesting = self.max_plate_nesting

    def _particles(self, model, guide, args, kwargs):
        self._sync()
        return trace_enum_elbo_particles(self._trace, model, guide, args, kwargs)

    def _endpoint_step(self, end: float, model, guide, args, kwargs) -> float:
        self._sync()
        if end != 1.0:
            guide = stick_the_landing(guide)
        return self._trace.loss_and_grads(model, guide, *args, **kwargs)


# ----------------------------------------------------------------------------- DReG
class TraceAdaptiveDReG_ELBO(_AdaptiveMixin, TraceDReG_ELBO):
    r"""The IWAE bound whose guide gradient mixes IWAE's and DReG's with a learned weight.

    With normalized weights :math:`\tilde w_k` and :math:`a_k = \partial_{z_k} \log w_k
    \cdot \partial z_k / \partial\phi` (the path through the sample, other samples held
    fixed along each link), the guide gradients of the IWAE bound (ascent direction) are

    .. math::

        g_\text{IWAE} = \sum_k \tilde w_k \big(a_k - \nabla_\phi \log q(\bot(z_k);\phi)\big),
        \qquad
        g_\text{DReG} = \sum_k \tilde w_k^2\, a_k,

    and both have the same expectation (Tucker et al. 2019, eq. 5), so their
    difference

    .. math::

        g_\text{cv} = g_\text{IWAE} - g_\text{DReG}
            = \sum_k (\tilde w_k - \tilde w_k^2)\, a_k - \sum_k \tilde w_k
              \nabla_\phi \log q(\bot(z_k);\phi)

    has mean zero (per site with scale :math:`c` the path factor is
    :math:`1 - (1 - c + c\tilde w_k)`). The step's guide gradient is
    :math:`g_\text{DReG} + b \odot g_\text{cv}` with :math:`b` from earlier steps, chosen
    by the policy of :class:`TraceAdaptiveSTL_ELBO` (``b = 0``: DReG, ``b = 1``: IWAE; it
    starts at IWAE and moves to DReG, or to the fitted mix, on evidence); the same
    unbiasedness condition holds. Model parameters get the IWAE gradient, as in
    :class:`TraceDReG_ELBO` (a parameter shared by model and guide gets IWAE's model
    part plus the mixed guide part).

    **Cost.** One model and one guide pass; the base backward keeps the graph, and
    :math:`g_\text{cv}` is one backward of the *guide* graph only: the gradient the
    model sent to each sample is captured during the base backward and re-seeded with
    the factor :math:`1 - f_k`, so the model is not differentiated twice. Then a small
    pass of the score parts with the relays cut. ``block_grad`` routes are not
    supported (the captured model gradient mixes the routes): a clear error.

    Example::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.infer import TraceAdaptiveDReG_ELBO
        >>> def model(x):
        ...     with pyro.plate("data", len(x)):
        ...         z = pyro.sample("z", dist.Normal(0.0, 1.0))
        ...         pyro.sample("x", dist.Normal(z, 0.5), obs=x)
        >>> def guide(x):
        ...     w = pyro.param("w", torch.tensor(0.5))
        ...     with pyro.plate("data", len(x)):
        ...         pyro.sample("z", dist.Normal(w * x, 0.6))
        >>> pyro.clear_param_store()
        >>> elbo = TraceAdaptiveDReG_ELBO(num_particles=8, warmup=2)
        >>> x = torch.randn(10)
        >>> for _ in range(3):
        ...     loss = elbo.loss_and_grads(model, guide, x)
        >>> list(elbo.control_variate_weights())
        ['w']

    Arguments are :class:`TraceDReG_ELBO`'s plus ``decay``, ``clip``, ``warmup``,
    ``confidence``, ``fixed_weight``, ``center`` and ``distributed`` (see
    :class:`TraceAdaptiveSTL_ELBO`). ``clip``
    defaults to 2 here: far from the posterior the importance weights are nearly
    one-hot, the products are heavy-tailed, and unclipped estimates of :math:`b` reach
    the thousands (measured at 8 posterior sds: 22x IWAE's variance unclipped, 1.0x
    clipped at 2).
    """

    def __init__(
        self,
        num_particles: int = 2,
        vectorize_particles: bool = True,
        *,
        decay: float = 0.9,
        clip: float | None = 2.0,
        warmup: int = 10,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        center: bool = True,
        distributed: bool | None = None,
        **kwargs,
    ):
        super().__init__(
            num_particles=num_particles, vectorize_particles=vectorize_particles, **kwargs
        )
        self._init_cv(decay, clip, warmup, center, distributed, confidence, fixed_weight)

    def _particle_terms(self, model_trace, guide_trace, blocks=None) -> tuple[float, Terms]:
        elbo, terms = super()._particle_terms(model_trace, guide_trace, blocks)
        record = terms.pop(EXTRA)  # the base estimator's weights and per-site factors
        if not torch.is_grad_enabled():
            return elbo, terms
        w, factors = record["weights"].detach(), record["factors"]
        seeds, paths, scores = [], [], []  # (guide value, model value, 1 - f, event dim)
        for name, site in guide_trace.nodes.items():
            if site["type"] != "sample" or site["is_observed"]:
                continue
            f = factors.get(name, 1.0)
            one_minus_f = 1 - f
            if torch.is_tensor(one_minus_f) or one_minus_f != 0:
                z = site["value"]
                msite = model_trace.nodes.get(name)
                v = msite["value"] if msite is not None else None
                if torch.is_tensor(v) and v is not z and v.requires_grad:
                    event_dim = getattr(site["fn"], "event_dim", 0)
                    seeds.append(_Capture(z, v, one_minus_f, event_dim))
                path = site_parts(site)[1].log_prob
                if torch.is_tensor(path) and path.requires_grad:
                    paths.append((w * one_minus_f * path).sum())
            s = _score_tensor(site)
            if s is not None:
                scores.append(((w * s[0]).sum(), s[1]))
        terms[EXTRA] = {
            "params": _trace_params(model_trace, guide_trace),
            "seeds": seeds,
            "paths": paths,
            "scores": scores,
        }
        return elbo, terms

    def _before_backward(self, item, blocks) -> None:
        if blocks and (item["seeds"] or item["paths"] or item["scores"]):
            raise NotImplementedError(
                "TraceAdaptiveDReG_ELBO does not support block_grad routes: its control "
                "variate re-seeds the gradient the model sent to each sample, which mixes "
                "the routes. Use TraceDReG_ELBO (routes supported) or remove the marks."
            )
        for c in item["seeds"]:
            c.register()

    _cv_first = False  # it needs the model's gradients, captured during the base backward

    def _cv_grads(self, item, params, blocks, retain: bool) -> dict:
        outs, grads = [], []
        for c in item["seeds"]:
            if c.grad is not None:
                outs.append(c.z)
                grads.append(c.seed())
        for p in item["paths"]:
            outs.append(p)
            grads.append(torch.ones_like(p))
        scores = item["scores"]
        out: dict = {}
        if outs:
            out = _grads_by_route({frozenset(): (outs, grads)}, params, retain_last=True)
        if scores:
            with _Cut(g for _, g in scores):
                sg = _grads_by_route(
                    {
                        frozenset(): (
                            [s for s, _ in scores],
                            [torch.ones_like(s) for s, _ in scores],
                        )
                    },
                    params,
                    retain_last=retain,
                )
            for p, g in sg.items():
                out[p] = g if p not in out else out[p] + g
        return out


class _Capture:
    """The loss gradient the model sends to one sample (captured by a hook on its replayed value)."""

    def __init__(self, z, v, factor, event_dim):
        self.z, self.v, self.factor, self.event_dim = z, v, factor, event_dim
        self.grad = None

    def register(self) -> None:
        def hook(g):
            self.grad = g if self.grad is None else self.grad + g

        self.v.register_hook(hook)

    def seed(self) -> torch.Tensor:
        f = self.factor
        if torch.is_tensor(f):
            f = f.reshape(f.shape + (1,) * self.event_dim)
        return self.grad * f
