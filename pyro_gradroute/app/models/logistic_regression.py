r"""Bayesian logistic regression on scikit-learn's bundled breast-cancer data (no download).

.. math::

    w \sim N(0, I_{30}),\quad b \sim N(0, 5^2),\quad
    y_i \mid x_i \sim \text{Bernoulli}(\sigma(x_i^\top w + b)),

with standardized features (training statistics) and a seeded 80/20 train/held-out split.

Example::

    >>> import pyro
    >>> from pyro_gradroute.app.models.logistic_regression import problem
    >>> p = problem()
    >>> X, y = p.args
    >>> tuple(X.shape), tuple(p.heldout_args[0].shape)
    ((455, 30), (114, 30))
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.autoguide import AutoNormal

from .problem import Problem


def load_breast_cancer_split(test_fraction: float = 0.2, seed: int = 0):
    """``(X_train, y_train, X_test, y_test, feature_names)``, features standardized."""
    try:
        from sklearn.datasets import load_breast_cancer
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "The breast-cancer data set comes with scikit-learn: pip install -e '.[examples]'"
        ) from e
    data = load_breast_cancer()
    X = torch.as_tensor(data.data, dtype=torch.get_default_dtype())
    y = torch.as_tensor(data.target, dtype=torch.get_default_dtype())
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(X) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    mean, std = X[train].mean(0), X[train].std(0)
    X = (X - mean) / std
    return X[train], y[train], X[test], y[test], [str(n) for n in data.feature_names]


def model(X: torch.Tensor, y: torch.Tensor | None = None) -> None:
    """Logistic regression; vectorizes over outer plates (``w`` broadcasts against ``X``)."""
    w = pyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 5.0))
    with pyro.plate("data", X.shape[0]):
        logits = (X * w).sum(-1) + b
        pyro.sample("y", dist.Bernoulli(logits=logits), obs=y)


def problem() -> Problem:
    """The bundled problem: AutoNormal guide, 20% held out, 600 steps at lr 0.05."""
    X, y, X_test, y_test, names = load_breast_cancer_split()
    return Problem(
        model=model,
        guide=AutoNormal(model),
        args=(X, y),
        heldout_args=(X_test, y_test),
        dims={"w": ["feature"]},
        coords={"feature": names},
        var_names=["b", "w"],
        steps=600,
        lr=0.05,
    )
