"""The ``pyro-gradroute`` app: the command, estimator comparison, plots and bundled problems.

It is built on the library (:mod:`pyro_gradroute.infer`, :mod:`pyro_gradroute.guides`,
:mod:`pyro_gradroute.diagnostics`, ...), which never imports it.

* :mod:`.cli` -- the ``pyro-gradroute`` command (also ``python -m pyro_gradroute``);
* :mod:`.compare` -- fit several estimators from one initialisation and tabulate them;
* :mod:`.plots` -- the comparison's PNG plots;
* :mod:`.estimators` -- estimators by name;
* :mod:`.models` -- bundled problems (:data:`~pyro_gradroute.app.models.MODELS`) and the
  :class:`~pyro_gradroute.app.models.Problem` a user's own ``module:function`` returns.
"""
