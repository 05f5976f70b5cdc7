r"""Eight schools (Rubin 1981), non-centred:

.. math::

    \mu \sim N(0, 5^2),\quad \tau \sim \text{HalfCauchy}(5),\quad
    \tilde\theta_j \sim N(0, 1),\quad y_j \sim N(\mu + \tau \tilde\theta_j, \sigma_j^2).

Example::

    >>> import pyro
    >>> from pyro_gradroute.app.models.eight_schools import model, SIGMA, Y
    >>> tr = pyro.poutine.trace(model).get_trace(SIGMA, Y)
    >>> tr.nodes["theta_tilde"]["value"].shape
    torch.Size([8])
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch

from .problem import Problem

SCHOOLS = ["Choate", "Deerfield", "Phillips Andover", "Phillips Exeter", "Hotchkiss",
           "Lawrenceville", "St. Paul's", "Mt. Hermon"]  # fmt: skip
Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def model(sigma: torch.Tensor, y: torch.Tensor | None = None) -> None:
    """The non-centred eight-schools model; ``theta`` is recorded with ``pyro.deterministic``."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(sigma)):
        theta_tilde = pyro.sample("theta_tilde", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * theta_tilde)
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def problem() -> Problem:
    """The bundled problem: a mean-field guide with a Gamma factor for ``tau`` (AutoNormal's
    treatment for the other sites, all started at ``init_scale=0.5``), no held-out data."""
    from ...guides import AutoMeanField

    return Problem(
        model=model,
        # a Gamma factor that starts narrow (concentration ~100 at init_scale=0.1) is
        # ill-conditioned in its own coordinates and learns slowly: start wider
        guide=AutoMeanField(model, family={"tau": dist.Gamma}, init_scale=0.5),
        args=(SIGMA, Y),
        coords={"school": SCHOOLS},
        var_names=["mu", "tau", "theta"],
        steps=1000,
        lr=0.02,
    )
