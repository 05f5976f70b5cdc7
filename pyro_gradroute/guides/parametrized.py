"""A distribution family whose arguments are constrained module parameters (in Pyro's param store),
re-read through ``pyro.param`` at every call."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import pyro.distributions as dist
import torch
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.nn import PyroModule, PyroParam
from torch.distributions import Distribution, constraints, transform_to

from .._compat import pyro_context, pyro_name
from .._validation import check_int, check_mapping, check_str

__all__ = ["ParametrizedDistribution", "as_pyro_family"]


def as_pyro_family(family: Any) -> type:
    """The Pyro wrapper of a torch distribution class (``.to_event``, ``.expand`` for plates).

    ``torch.distributions.Gamma`` becomes ``pyro.distributions.Gamma`` (a subclass,
    so instances are still ``torch.distributions.Gamma``); Pyro classes and
    classes Pyro does not wrap are returned unchanged.

    :raises TypeError: if ``family`` is not a distribution class.
    """
    if not (isinstance(family, type) and issubclass(family, Distribution)):
        raise TypeError(
            f"expected a distribution class such as pyro.distributions.Gamma, got {family!r}"
        )
    if issubclass(family, TorchDistributionMixin):
        return family
    wrapper = getattr(dist, family.__name__, None)
    if isinstance(wrapper, type) and issubclass(wrapper, family):
        return wrapper
    return family


def _as_tensor(value: Any) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach().clone()
    return torch.as_tensor(value, dtype=torch.get_default_dtype())


class ParametrizedDistribution(PyroModule):
    r"""A distribution family with its arguments held as constrained module parameters.

    For each argument ``a`` of ``family.arg_constraints`` that is learned, the module has a
    :class:`~pyro.nn.PyroParam` attribute ``a`` with that argument's constraint :math:`C_a`
    (state-dict key ``f"{a}_unconstrained"``), registered in Pyro's param store as
    ``f"{name}.{a}"``: the module keeps an unconstrained :math:`u_a` and every call returns

    .. math::

        q = \text{family}\big(a = T_{C_a}(u_a) \text{ for learned } a,\;
            a = \text{value for fixed } a\big),
        \qquad T_C = \texttt{transform\_to}(C),

    so gradients of anything computed from ``q`` reach :math:`u_a` at every step. As a
    :class:`~pyro.nn.PyroModule` it works with ``parameters()``, ``state_dict()``, ``torch.save``
    and ``pyro.settings.set(module_local_params=True)``. Swapping ``dist.Normal`` for
    ``dist.Gamma`` or ``dist.LogNormal`` changes one line.

    Which arguments are learned:

    * every continuous argument you pass in ``**init`` (its initial value);
    * arguments you do not pass but whose signature default is a number (e.g.
      ``StudentT``'s ``loc=0.``, ``scale=1.``) start from that default;
    * arguments with a ``None`` default are *alternative parametrizations*
      (``Bernoulli``'s ``probs``/``logits``, ``MultivariateNormal``'s
      ``covariance_matrix``/``precision_matrix``/``scale_tril``): only the ones you
      pass are learned, and passing two of a group is an error;
    * ``fixed={...}`` arguments and discrete arguments (``Binomial``'s
      ``total_count``) are passed as they are, never learned.

    Example (fit ``q`` to a target by Monte Carlo KL; the loop is the same for every
    family)::

        >>> import torch, pyro, pyro.distributions as dist
        >>> from pyro_gradroute.guides import ParametrizedDistribution
        >>> pyro.clear_param_store()
        >>> target = dist.Normal(5.0, 5.0)
        >>> q = ParametrizedDistribution("q", dist.Gamma, concentration=2.0, rate=0.5)
        >>> opt = torch.optim.Adam(q.parameters(), lr=0.05)
        >>> for step in range(50):
        ...     d = q()                        # fresh graph from the store every step
        ...     z = d.rsample((32,))
        ...     kl = (d.log_prob(z) - target.log_prob(z)).mean()
        ...     opt.zero_grad(); kl.backward(); opt.step()
        >>> sorted(pyro.get_param_store().keys())
        ['q.concentration', 'q.rate']
        >>> bool(q.params()["rate"] > 0)
        True
        >>> sorted(q.state_dict())
        ['concentration_unconstrained', 'rate_unconstrained']

    :param name: prefix of the param-store names (the module's Pyro name; as an attribute of
        another PyroModule it becomes that attribute's full name, as for any PyroModule).
    :param family: a distribution class (torch classes are mapped to Pyro's wrapper).
    :param fixed: arguments passed unchanged (not learned).
    :param event_dim: reinterpret this many rightmost batch dims as event dims
        (``.to_event(event_dim)``); also tells ``pyro.plate`` subsampling which
        dims of each parameter are batch dims (``pyro.param(..., event_dim=...)``).
    :param init: initial (constrained) values of learned arguments.
    :raises TypeError: for an unknown argument, an argument given both in ``init``
        and ``fixed``, or a family whose ``arg_constraints`` depend on its parameters.
    :raises ValueError: for a learned argument with a dependent or unsupported
        constraint, an initial value outside its constraint, a missing required
        argument, or a family that cannot be built from the initial values.
    """

    def __init__(
        self,
        name: str,
        family: type[Distribution],
        *,
        fixed: Mapping[str, Any] | None = None,
        event_dim: int = 0,
        **init: Any,
    ) -> None:
        check_str(name, "name", "ParametrizedDistribution")
        super().__init__(name=name)
        self.family = as_pyro_family(family)
        where = f"ParametrizedDistribution({name!r}, {self.family.__name__})"
        self.event_dim = check_int(event_dim, "event_dim", where, minimum=0)
        check_mapping(fixed, "fixed", where, allow_none=True)
        arg_constraints = self.family.arg_constraints
        if not isinstance(arg_constraints, dict):
            raise TypeError(
                f"{where}: the family's arg_constraints depend on its parameters, so they cannot "
                "be read from the class; learn its arguments with pyro.param yourself."
            )
        fixed = dict(fixed or {})
        for label, given in (("init", init), ("fixed", fixed)):
            unknown = sorted(set(given) - set(arg_constraints))
            if unknown:
                raise TypeError(
                    f"{where}: unknown {label} argument(s) {unknown}; the family's arguments "
                    f"are {sorted(arg_constraints)}"
                )
        both = sorted(set(init) & set(fixed))
        if both:
            raise TypeError(f"{where}: {both} given both as learned init and in fixed=")

        signature = inspect.signature(self.family.__init__).parameters
        alternatives = [
            a for a in arg_constraints if a in signature and signature[a].default is None
        ]
        chosen = [a for a in alternatives if a in init or a in fixed]
        if len(chosen) > 1:
            raise ValueError(
                f"{where}: {chosen} are alternative parametrizations of the same quantity; "
                "pass exactly one of them"
            )

        self.constraints: dict[str, constraints.Constraint] = {}
        self.init: dict[str, torch.Tensor] = {}
        self.fixed: dict[str, Any] = fixed
        for arg, constraint in arg_constraints.items():
            if arg in fixed or arg in alternatives and arg not in init:
                continue
            default = signature[arg].default if arg in signature else inspect.Parameter.empty
            if not constraints.is_dependent(constraint) and constraint.is_discrete:
                if arg in init:
                    self.fixed[arg] = init[arg]
                continue
            if arg in init:
                value = _as_tensor(init[arg])
            elif default is not inspect.Parameter.empty:
                value = _as_tensor(default)
            else:
                raise ValueError(
                    f"{where}: argument {arg!r} needs a value: pass {arg}=<initial value> to "
                    f"learn it, or fixed={{{arg!r}: value}} to keep it constant"
                )
            self._check_learnable(where, arg, constraint, value)
            self.constraints[arg] = constraint
            self.init[arg] = value
        try:
            built = self.family(**self.fixed, **self.init)
        except (ValueError, TypeError, RuntimeError) as e:
            hint = f"; pass exactly one of {alternatives}" if alternatives and not chosen else ""
            raise ValueError(
                f"{where}: cannot build the family from {self._describe()}{hint}: {e}"
            ) from e
        #: whether the family has a reparameterized sampler (``rsample``).
        self.has_rsample: bool = bool(built.has_rsample)
        for arg, value in self.init.items():
            if hasattr(type(self), arg) or arg in self.__dict__:
                raise TypeError(f"{where}: argument name {arg!r} clashes with an attribute of "
                                "ParametrizedDistribution")  # fmt: skip
            constraint = self.constraints[arg]
            event = constraint.event_dim + self.event_dim
            setattr(self, arg, PyroParam(value, constraint=constraint, event_dim=event))

    @property
    def name(self) -> str:
        """Prefix of the param-store names: the module's Pyro name."""
        return pyro_name(self)

    @staticmethod
    def _check_learnable(where, arg, constraint, value) -> None:
        if constraints.is_dependent(constraint):
            raise ValueError(
                f"{where}: argument {arg!r} has a parameter-dependent constraint ({constraint!r}) "
                f"and cannot be learned; pass fixed={{{arg!r}: value}}"
            )
        try:
            transform_to(constraint)
        except NotImplementedError:
            raise ValueError(
                f"{where}: argument {arg!r} has constraint {constraint!r}, for which torch has no "
                f"transform from the reals, so it cannot be learned; pass fixed={{{arg!r}: value}}"
            ) from None
        if value.dim() < constraint.event_dim:
            raise ValueError(
                f"{where}: argument {arg!r} needs at least {constraint.event_dim} dims "
                f"({constraint!r}); got shape {tuple(value.shape)}"
            )
        if not bool(constraint.check(value).all()):
            raise ValueError(
                f"{where}: initial value of {arg!r} violates its constraint {constraint!r}: {value}"
            )

    def _describe(self) -> str:
        learned = ", ".join(self.init) or "nothing"
        fixed = ", ".join(self.fixed) or "nothing"
        return f"learned [{learned}], fixed [{fixed}]"

    def params(self) -> dict[str, torch.Tensor]:
        """Current constrained values of the learned arguments (``pyro.param`` statements).

        Registers them in the param store on first use (unless
        ``module_local_params``), and takes the store's values when it holds them (e.g.
        after ``pyro.get_param_store().load(...)``). Inside a subsampled ``pyro.plate`` the
        values are indexed by the subsample.
        """
        with pyro_context(self):
            return {arg: getattr(self, arg) for arg in self.init}

    def parameters(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The unconstrained leaf tensors (for a plain ``torch.optim`` optimizer).

        These are the tensors ``pyro.optim`` updates too. After
        ``pyro.get_param_store().load(...)`` the store holds new leaves, which the module
        takes at its next read: build the optimizer again.
        """
        self.params()  # take the param store's leaves, if it has newer ones
        return super().parameters(recurse)

    def distribution(self) -> Distribution:
        """``family(**current values)`` without the ``event_dim`` reinterpretation."""
        return self.family(**self.fixed, **self.params())

    def forward(self) -> Distribution:
        """A fresh ``family(...)`` built from the current parameter values."""
        d = self.distribution()
        if self.event_dim:
            d = dist.Independent(d, self.event_dim)
        return d

    def extra_repr(self) -> str:
        return f"{self.name!r}, {self.family.__name__}: {self._describe()}"
