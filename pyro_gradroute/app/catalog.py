"""Names and one-line descriptions of the bundled problems and estimators, importable without
torch (``pyro-gradroute list`` and ``--help`` read them).

:data:`pyro_gradroute.app.models.MODELS` holds the problem functions under the same names (a
test checks that the two agree).

Example::

    >>> from pyro_gradroute.app.catalog import MODEL_DESCRIPTIONS
    >>> "gaussian_means" in MODEL_DESCRIPTIONS
    True
"""

#: bundled problem name -> one-line description
MODEL_DESCRIPTIONS: dict[str, str] = {
    "logistic_regression": (
        "Bayesian logistic regression, breast-cancer data (30 features), 20% held out"
    ),
    "eight_schools": "Eight schools, non-centred; AutoMeanField guide with a Gamma factor for tau",
    "digits_vae": "VAE on binarized 8x8 digits (scikit-learn), 20% held out",
    "gaussian_means": (
        "Gaussian means; the guide family contains the posterior (STL's zero-variance case)"
    ),
    "gamma_to_normal": "a Gamma guide fitted to a Normal(5, 5) target it cannot cover",
    "nested_aux_loss": "y = B(A(x)); an auxiliary loss kept from B with block_grad",
}

#: estimator name -> (module, class, fixed keyword arguments, one-line description)
ESTIMATORS: dict[str, tuple[str, str, dict, str]] = {
    "trace": ("pyro_gradroute.infer", "Trace_ELBO", {}, "ELBO, reparameterized gradient"),
    "stl": ("pyro_gradroute.infer", "TraceSTL_ELBO", {}, "ELBO, sticking the landing"),
    "iwae": ("pyro.infer", "RenyiELBO", {"alpha": 0.0}, "IWAE bound (Pyro's RenyiELBO(alpha=0))"),
    "dreg": ("pyro_gradroute.infer", "TraceDReG_ELBO", {}, "IWAE bound, doubly reparameterized"),
    "renyi": ("pyro.infer", "RenyiELBO", {"alpha": None}, "Renyi bound of order --alpha (Pyro's)"),
    "renyi-dreg": (
        "pyro_gradroute.infer",
        "TraceDReG_ELBO",
        {"alpha": None},
        "Renyi bound of order --alpha, doubly reparameterized",
    ),
    "adaptive": (
        "pyro_gradroute.infer",
        "TraceAdaptiveSTL_ELBO",
        {},
        "ELBO, STL plus a learned control variate on the score part",
    ),
    "adaptive-dreg": (
        "pyro_gradroute.infer",
        "TraceAdaptiveDReG_ELBO",
        {},
        "IWAE bound, DReG/IWAE guide gradients mixed by a learned weight",
    ),
    "enum": ("pyro.infer", "TraceEnum_ELBO", {}, "ELBO, enumerated discrete sites (Pyro's)"),
    "enum-stl": (
        "pyro.infer",
        "TraceEnum_ELBO",
        {"stick_the_landing": True},
        "TraceEnum_ELBO with poutine.stick_the_landing(guide)",
    ),
}

DEFAULT_MODEL = "logistic_regression"
#: the comparison's default: the README's recommendation (``adaptive``,
#: ``TraceAdaptiveSTL_ELBO()``) against the estimators it chooses between, and the IWAE pair
DEFAULT_ESTIMATORS = ("trace", "stl", "adaptive", "iwae", "dreg")

#: estimators that take ``--alpha`` (the order of the Renyi bound)
RENYI_ESTIMATORS = tuple(name for name, spec in ESTIMATORS.items() if "alpha" in spec[2]
                         and spec[2]["alpha"] is None)  # fmt: skip

#: what "diverged at step N" means in the comparison (also in ``compare --help``)
DIVERGED = (
    "A fit diverged at step N when step N's loss is not finite (NaN or inf); or a parameter "
    "(unconstrained, or its constrained value) is not finite after step N; or step N > 1 "
    "fails on an invalid value (a distribution's parameter outside its support, such as a "
    "scale that underflowed to 0, or a NaN log-density), as a first step did not; or the "
    "median loss of the last 10 steps exceeds the first step's loss L1 by more than "
    "10 x max(|L1|, 1). A diverged estimator is stopped, not measured and never called "
    "best; the others go on."
)
