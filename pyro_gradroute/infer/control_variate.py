r"""The control variate's weight :math:`b`, fitted from moments of earlier steps (plain
tensors, no Pyro): :class:`ControlVariate`."""

from __future__ import annotations

import math

import torch

from .._validation import check_float, check_int

__all__ = ["ControlVariate"]

#: the moments, one row each of a state's buffer: sums of p, c, p^2, pc, c^2 and the residual
#: moments x^2 y^2, x^3 y, x^4 (x, y: c and p centred at the means of the steps before)
_KEYS = ("sp", "sc", "spp", "spc", "scc", "xxyy", "xxxy", "xxxx")
_SEP = "\x1f"


class ControlVariate:
    r"""Exponentially weighted moments of :math:`(p, c)` per key, and the fitted weight :math:`b`.

    Per key it keeps one buffer of the sums in ``_KEYS`` (factor ``decay``), the sums of the
    weights :math:`w_1 = \sum w`, :math:`w_2 = \sum w^2` (effective number of samples
    :math:`n = w_1^2 / w_2`) and the residual moments' weight. The fit (:meth:`fit`):

    1. :math:`\hat b`: minus the weighted least-squares slope of :math:`p` on :math:`c` (with
       an intercept where ``center``; else through 0, relying on :math:`\mathbb E c = 0`);
       elements with no :math:`c` keep 1;
    2. its standard error :math:`s` by the delta method,
       :math:`s^2 = \mathbb E[x^2 (y + \hat b x)^2] / ((n - k) \operatorname{Var}(x)^2)`;
    3. the endpoint :math:`e`: 1 unless :math:`\hat b + z s < 1/2` (0 is then closer to
       :math:`b^\star` by :math:`z =` ``confidence`` standard errors);
    4. :math:`b = e + \lambda(\hat b - e)`, :math:`\lambda = \max(0, 1 - (zs)^2/(\hat b - e)^2)`
       (positive-part James-Stein: :math:`b` stays at :math:`e` while :math:`\hat b` is within
       :math:`z` standard errors of it);
    5. with ``gain`` :math:`G`, per parameter tensor :math:`k` (predicted second moments
       :math:`S_k(b) = \sum_{e \in k} \mathbb E g_e(b)^2 \ge M_k = \lVert \mathbb E
       g_k\rVert^2` for every :math:`b`): every element of :math:`k` takes 1 (``Trace_ELBO``'s
       gradient) where :math:`S_k(1) \le G M_k` (no weights can gain more than :math:`G`
       there), else the better endpoint :math:`e` where :math:`S_k(e) \le G\, S_k(b)`, else
       keeps the fit. Each tensor decides on its own moments: summed over all tensors, the
       tensors with the largest mean gradient would decide for every other. A tensor takes 1
       where 1 is the closer endpoint along its mean gradient :math:`u_k` by :math:`z` SEs (the
       slope of :math:`\langle p_k, u_k\rangle` on :math:`\langle c_k, u_k\rangle`, steps
       1-3): per-element sums cannot see STL's noise along the direction the tensor moves.

    :math:`b = 1` during the first ``warmup`` updates of a key; ``fixed_weight`` replaces the
    fit everywhere. The fit is recomputed on every update for the first ``fresh`` updates past
    warm-up, then every ``refit`` updates (the weights still come from earlier steps only).

    Example::

        >>> import torch
        >>> cv = ControlVariate(warmup=0)
        >>> g = torch.Generator().manual_seed(0)
        >>> for _ in range(50):  # p = 1 - 0.3 c + noise: b* = 0.3
        ...     c = torch.randn(100, generator=g)
        ...     _ = cv.update(["w"], [1 - 0.3 * c + 0.1 * torch.randn(100, generator=g)], [c])
        >>> round(float(cv.fit("w")["b_hat"].mean()), 1)
        0.3
    """

    def __init__(
        self,
        decay: float = 0.9,
        clip: float | None = None,
        warmup: int = 10,
        center: bool = True,
        confidence: float = 2.0,
        fixed_weight: float | None = None,
        *,
        gain: float | None = None,
        refit: int = 4,
        fresh: int = 5,
        no_score: float = 1e-6,
        where: str = "ControlVariate",
    ):
        self.decay = check_float(decay, "decay", where, low=0.0, high=1.0, high_open=True)
        self.clip = check_float(clip, "clip", where, low=0.0, low_open=True, allow_none=True)
        self.warmup = check_int(warmup, "warmup", where, minimum=0)
        if not isinstance(center, bool):
            raise TypeError(f"{where}: center must be True or False; got {center!r}")
        self.center = center
        self.confidence = check_float(confidence, "confidence", where, low=0.0)
        self.fixed_weight = check_float(fixed_weight, "fixed_weight", where, allow_none=True)
        self.gain = check_float(gain, "gain", where, low=1.0, allow_none=True)
        self.refit, self.fresh, self.no_score = refit, fresh, no_score
        self.state: dict[str, dict] = {}
        self.layouts: dict[str, list[tuple[str, tuple]]] = {}

    # -- moments -----------------------------------------------------------------------
    def key(self, names: list[str], likes: list[torch.Tensor]) -> str:
        """The joint state of ``names`` (shaped as ``likes``); a changed layout starts it again."""
        key = _SEP.join(names)
        layout = [(n, tuple(t.shape)) for n, t in zip(names, likes)]
        if self.layouts.get(key) != layout:
            self.state.pop(key, None)
            self.layouts[key] = layout
        return key

    def forget(self, key: str | None) -> None:
        """Drop ``key``'s moments (its next steps are at ``b = 1``)."""
        self.state.pop(key, None)
        self.layouts.pop(key, None)

    def update(
        self, names: list[str], ps: list[torch.Tensor], cs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add one step's parts (after its gradient is formed); returns them flattened."""
        key = self.key(names, cs)
        p, c = (torch.cat([t.reshape(-1) for t in ts]).detach() for ts in (ps, cs))
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = {"buf": c.new_zeros((len(_KEYS),) + c.shape)}
            st.update(n=0, w1=0.0, w2=0.0, qw=0.0, age=0, fit=None)
        if st["buf"].device != c.device or st["buf"].dtype != c.dtype:
            st["buf"] = st["buf"].to(c)  # a state loaded elsewhere
        buf, beta = st["buf"], self.decay
        if self.gain is not None and st["w1"] > 0:  # (p, c) along each tensor's mean gradient
            m = buf[0] + buf[1]  # (from the steps before)
            x = self._per_tensor(key, torch.stack((p, c, m)) * m)
            a = x[:2] / x[2].sqrt().clamp_min(torch.finfo(x.dtype).tiny)  # <p, u>, <c, u>
            along = st["along"] = st["along"].to(c) if "along" in st else c.new_zeros(5, x.shape[1])
            along.mul_(beta).add_(torch.cat((a, a[:1] * a, a[1:] * a[1:])))
        new = [p, c, p * p, p * c, c * c]
        if st["w1"] > 0:  # the residual moments, centred at the means of the steps before
            x, y = (c - buf[1] / st["w1"], p - buf[0] / st["w1"]) if self.center else (c, p)
            xx, xy = x * x, x * y
            new += [xy * xy, xx * xy, xx * xx]
            st["qw"] = beta * st["qw"] + 1.0
        buf[: len(new)].mul_(beta).add_(torch.stack(new))
        st["w1"], st["w2"] = beta * st["w1"] + 1.0, beta * beta * st["w2"] + 1.0
        st["n"], st["age"] = st["n"] + 1, st["age"] + 1
        if st["n"] <= self.warmup + self.fresh or st["age"] >= self.refit:
            st["fit"] = None  # recomputed when next asked for
        return p, c

    # -- the fit -----------------------------------------------------------------------
    def moments(self, key: str) -> dict[str, torch.Tensor]:
        """``key``'s running sums by name (``sp``, ``sc``, ``spp``, ``spc``, ``scc``, ...)."""
        return dict(zip(_KEYS, self.state[key]["buf"].unbind(0)))

    def count(self, key: str | None) -> int:
        """How many updates ``key`` has had."""
        st = self.state.get(key)
        return 0 if st is None else st["n"]

    def settled(self, key: str | None) -> bool:
        """Whether ``key`` has its first ``fresh`` fits past warm-up (the schedule may rely on it)."""
        st = self.state.get(key)
        return st is not None and st["n"] > self.warmup + self.fresh

    def fit(self, key: str) -> dict | None:
        """``{"b", "b_mix", "b_hat", "se", "endpoint", "n_eff"}`` (joint vectors; ``b_mix`` the
        weights before step 5), ``constant`` (the value every ``b`` takes, else ``None``),
        ``ends`` (where step 5 leaves every tensor at one endpoint: the names of those at 1,
        a ``frozenset``; else ``None``) and ``moments`` (predicted :math:`S(b_{mix}), S(0),
        S(1)`); ``None`` in warm-up."""
        st = self.state.get(key)
        if st is None or st["n"] <= self.warmup or st["qw"] <= 0:  # in warm-up
            return None
        if st["fit"] is None:
            st["fit"], st["age"] = self._fit(st, key), 0
        return st["fit"]

    def _fit(self, st: dict, key: str) -> dict:
        m = dict(zip(_KEYS, st["buf"].unbind(0)))
        w1, n_eff = st["w1"], st["w1"] ** 2 / st["w2"]
        cc, pc = m["scc"] / w1, m["spc"] / w1
        if self.center:  # least squares with an intercept
            mc = m["sc"] / w1
            pc, cc = pc - (m["sp"] / w1) * mc, cc - mc.square()
        tiny = torch.finfo(cc.dtype).tiny
        has = cc > self.no_score * m["scc"] / w1 + tiny  # elements with a score part
        one = torch.ones_like(cc)
        cc_ = torch.where(has, cc, one)
        b_hat = torch.where(has, -pc / cc_, one)
        if self.clip is not None:
            b_hat = b_hat.clamp(-self.clip, self.clip)
        dof = n_eff - (2.0 if self.center else 1.0)
        if st["qw"] > 0 and dof > 0:
            resid = m["xxyy"] + 2 * b_hat * m["xxxy"] + b_hat.square() * m["xxxx"]
            se = (resid.clamp_min(0) / st["qw"]).div(dof).sqrt() / cc_
        else:
            se = torch.full_like(cc, math.inf)
        se = torch.where(has, se, torch.zeros_like(se))
        zse = self.confidence * se
        end = (b_hat + zse >= 0.5).to(b_hat.dtype)
        d2 = (b_hat - end).square()
        shrink = (1 - zse.square() / d2.clamp_min(tiny)).clamp_min(0)
        shrink = torch.where(d2 > 0, shrink, torch.zeros_like(shrink)).nan_to_num(0.0)
        b = end + shrink * (b_hat - end)
        # the predicted second moments S(b), S(0), S(1) per element: mean_e^2 + Var p_e
        # + 2 b_e Cov(p_e, c_e) + b_e^2 Var c_e
        mp, mc = m["sp"] / w1, m["sc"] / w1
        s0 = mp.square() + (m["spp"] / w1 - mp.square()).clamp_min(0)
        cov = m["spc"] / w1 - mp * mc
        var_c = (m["scc"] / w1 - mc.square()).clamp_min(0)
        s1 = s0 + 2 * cov + var_c
        s_b = (s0 + b * (2 * cov + b * var_c)).clamp_min(0)
        totals = tuple(torch.stack([t.sum() for t in (s_b, s0, s1)]).tolist())  # (one sync)
        b_mix, ends = b, None
        if self.gain is not None:  # step 5: per tensor, an endpoint unless the fit gains more
            sizes = [math.prod(shape) for _, shape in self.layouts[key]]
            tb, t0, t1, tm = self._per_tensor(key, torch.stack((s_b, s0, s1, mp.square())))
            best, t_best = (t1 < t0).to(tb.dtype), torch.minimum(t0, t1)
            e = torch.where(t_best <= self.gain * tb, best, -1.0)
            e = torch.where(t1 <= self.gain * tm, 1.0, e)
            if "along" in st and dof > 0:  # along the mean gradient: the slope (steps 1-3)
                a0, a1, a00, a01, a11 = st["along"] / st["qw"]
                var_a, cov_a = (a11 - a1 * a1).clamp_min(tiny), a01 - a0 * a1
                s2 = (a00 - a0 * a0 - cov_a * cov_a / var_a).clamp_min(0) / (dof * var_a)
                e = torch.where(-cov_a / var_a - self.confidence * s2.sqrt() > 0.5, 1.0, e)
            e = e.repeat_interleave(torch.as_tensor(sizes, device=e.device))
            b = torch.where(e >= 0, e.to(b.dtype), b)
            # every tensor at one endpoint: the names of those at 1 (the others are at 0)
            ones, zeros = self._per_tensor(key, torch.stack((b == 1, b == 0))).tolist()
            if all(n in (o, z) for o, z, n in zip(ones, zeros, sizes)):
                names = (name for name, _ in self.layouts[key])
                ends = frozenset(name for name, o, n in zip(names, ones, sizes) if o == n)
        return {
            "b": b,
            "b_mix": b_mix,
            "b_hat": b_hat,
            "se": se,
            "endpoint": end,
            "n_eff": n_eff,
            "constant": next((v for v in (0.0, 1.0) if bool((b == v).all())), None),
            "ends": ends,
            "moments": totals,
        }

    def _per_tensor(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """The sums of ``x``'s rows (each a joint vector of ``key``) over each parameter tensor."""
        sizes = [math.prod(shape) for _, shape in self.layouts[key]]
        return torch.stack([t.sum(1) for t in x.split(sizes, 1)], 1)

    def weights(self, names: list[str], likes: list[torch.Tensor]) -> list[torch.Tensor]:
        """The ``b`` of each parameter this step applies (from earlier steps only): ones in
        warm-up and for a new layout, ``fixed_weight`` everywhere if set."""
        if self.fixed_weight is not None:
            return [torch.full_like(t, self.fixed_weight) for t in likes]
        key = self.key(names, likes)
        fit = self.fit(key)
        if fit is None:
            return [torch.ones_like(t) for t in likes]
        if fit.get("views") is None or fit["b"].device != likes[0].device:
            fit["views"] = list(self.split(key, fit["b"].to(likes[0])).values())
        return fit["views"]

    def split(self, key: str, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: slice}`` of a joint vector of ``key``, shaped as each parameter."""
        names, shapes = zip(*self.layouts[key])
        sizes = [math.prod(s) for s in shapes]
        return {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes)}

    # -- state ---------------------------------------------------------------------------
    _SETTINGS = ("decay", "clip", "warmup", "center", "confidence", "fixed_weight")

    def state_dict(self) -> dict:
        """Settings, moments (one tensor each, copies) and the fits in use: a resumed run
        applies the same ``b``."""
        moments, fits = {}, {}
        for key, st in self.state.items():
            moments[key] = {k: v.clone() for k, v in zip(_KEYS, st["buf"].unbind(0))}
            moments[key].update(_copy({k: v for k, v in st.items() if k not in ("buf", "fit")}))
            if st["fit"] is not None:
                fits[key] = _copy(st["fit"])
        layouts = {k: list(v) for k, v in self.layouts.items()}
        settings = {k: getattr(self, k) for k in self._SETTINGS}
        return {**settings, "layouts": layouts, "moments": moments, "fits": fits}

    def load_state_dict(self, state: dict) -> None:
        missing = {k for k in (*self._SETTINGS, "layouts", "moments") if k not in state}
        for st in state.get("moments", {}).values():
            missing |= {k for k in _KEYS if k not in st}
        if missing:
            raise ValueError(
                f"this control-variate state lacks {sorted(missing)}: it was saved by an older "
                "version whose moments this policy cannot use; start from a fresh estimator"
            )
        for k in self._SETTINGS:
            setattr(self, k, state[k])
        self.state = {}
        for key, st in state["moments"].items():
            new = _copy({k: v for k, v in st.items() if k not in _KEYS})
            new["buf"] = torch.stack([st[k] for k in _KEYS])  # one buffer, owned here
            new["fit"] = _copy(state["fits"][key]) if key in state.get("fits", {}) else None
            self.state[key] = new
        self.layouts = {k: [(n, tuple(s)) for n, s in v] for k, v in state["layouts"].items()}

    # pickle and deepcopy go through the same copies (no views shared between entries)
    def __getstate__(self) -> dict:
        return {
            "state": self.state_dict(),
            "tuning": (self.refit, self.fresh, self.no_score, self.gain),
        }

    def __setstate__(self, d: dict) -> None:
        self.refit, self.fresh, self.no_score, self.gain = d["tuning"]
        self.state, self.layouts = {}, {}
        self.load_state_dict(d["state"])


def _copy(d: dict) -> dict:
    """A copy of a state (its fit's cached views left out)."""
    copy = {k: v for k, v in d.items() if k != "views"}
    for k, v in copy.items():
        copy[k] = v.clone() if torch.is_tensor(v) else _copy(v) if isinstance(v, dict) else v
    return copy
