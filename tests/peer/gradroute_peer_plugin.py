"""Pytest plugin: run Pyro's own tests with pyro_gradroute's ELBOs in place of Pyro's.

Loaded by ``run_pyro_tests.py`` as ``-p gradroute_peer_plugin`` (this folder on
``PYTHONPATH``) inside a Pyro source checkout. Configured by environment variables:

``GRADROUTE_PEER_ELBO``
    ``trace``     package ``Trace_ELBO`` replaces ``pyro.infer.Trace_ELBO``;
    ``stl``       package ``TraceSTL_ELBO`` replaces ``pyro.infer.Trace_ELBO``;
    ``adaptive``  package ``TraceAdaptiveSTL_ELBO`` replaces ``pyro.infer.Trace_ELBO``;
    ``dreg``      package ``TraceDReG_ELBO(alpha)`` replaces ``pyro.infer.RenyiELBO(alpha)``
                  (every alpha);
    ``dreg-trace`` package ``TraceDReG_ELBO(num_particles)`` replaces
                  ``pyro.infer.Trace_ELBO(num_particles)`` (the K-particle bound: loss values
                  differ from the ELBO's for K > 1; equal to STL at K = 1);
    ``handler``   Pyro's own ELBOs (every ``pyro.infer`` ELBO class) with the guide wrapped
                  in ``pyro_gradroute.poutine.stick_the_landing``;
    ``pyro-trace`` / ``pyro-renyi`` / ``pyro-elbos``  Pyro's own classes, instrumented the
                  same way (the baseline: which tests fail in this environment anyway).
``GRADROUTE_PEER_OUT``
    JSON file written at the end: for every test that built the substituted ELBO, its
    outcome and, on failure, the exception and the innermost ``pyro_gradroute`` frame.

The replacement is installed in ``pytest_configure``, i.e. before any test module is
imported, so ``from pyro.infer import Trace_ELBO`` in a test file (and parametrize lists
built at import time) get it. The replacement is a subclass that keeps the replaced
name (``Trace_ELBO`` / ``RenyiELBO``), so test ids are the same in every mode.

A test counts as *building* the ELBO if it constructs one (in setup, call or teardown),
receives one as a parametrize value, or calls ``loss``/``loss_and_grads``/
``differentiable_loss`` on one.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import sys
import traceback

import pytest

MODE = os.environ.get("GRADROUTE_PEER_ELBO", "trace")
OUT = os.environ.get("GRADROUTE_PEER_OUT")
STRICT = bool(os.environ.get("GRADROUTE_PEER_STRICT"))

_current: list[str | None] = [None]
_built: dict[str, set[str]] = {}  # nodeid -> how ("init", "param", "used")
_results: dict[str, dict] = {}
_Instrumented: type | None = None
_REPLACED = ""  # the Pyro name replaced
_NAMES: set[str] = set()  # the Pyro names a test's source must mention to build it
_OURS: tuple = ()  # the replacement class (and the instrumented target)
_WRAPPED: dict[int, tuple] = {}  # id(guide) -> (guide, stick_the_landing(guide))
_WRAPPERS: set[int] = set()  # ids of the wrapped guides
_deselected = [0]
_coerced: set[str] = set()  # tests where DReG's vectorize_particles was forced on


def _record(how: str) -> None:
    nodeid = _current[0]
    if nodeid is not None:
        _built.setdefault(nodeid, set()).add(how)


def _instrument(base: type, name: str) -> type:
    def __init__(self, *args, **kwargs):
        _record("init")
        base.__init__(self, *args, **kwargs)

    def wrap(meth_name):
        meth = getattr(base, meth_name)

        def method(self, *args, **kwargs):
            _record("used")
            return meth(self, *args, **kwargs)

        method.__name__ = meth_name
        return method

    ns = {"__init__": __init__, "__module__": base.__module__, "_peer_base": base}
    for m in ("loss", "loss_and_grads", "differentiable_loss"):
        if hasattr(base, m):
            ns[m] = wrap(m)
    cls = type(name, (base,), ns)
    cls.__qualname__ = name
    return cls


#: Pyro's ELBO classes whose guide the ``handler`` mode wraps (refusals are reported as such)
HANDLER_ELBOS = (
    "Trace_ELBO",
    "JitTrace_ELBO",
    "TraceMeanField_ELBO",
    "JitTraceMeanField_ELBO",
    "TraceGraph_ELBO",
    "JitTraceGraph_ELBO",
    "TraceEnum_ELBO",
    "JitTraceEnum_ELBO",
    "TraceTMC_ELBO",
    "RenyiELBO",
    "TraceTailAdaptive_ELBO",
    "ReweightedWakeSleep",
)


def _wrapped_guide(guide):
    """``stick_the_landing(guide)``, one wrapper per guide (reused across steps)."""
    from pyro_gradroute.poutine import stick_the_landing

    if guide is None or id(guide) in _WRAPPERS:
        return guide
    hit = _WRAPPED.get(id(guide))
    if hit is None or hit[0] is not guide:
        hit = _WRAPPED[id(guide)] = (guide, stick_the_landing(guide))
        _WRAPPERS.add(id(hit[1]))
    return hit[1]


def _install_handler(wrap: bool) -> None:
    """Instrument Pyro's ELBO classes in place; with ``wrap``, wrap the guide in every call."""
    import pyro.infer

    classes = tuple(getattr(pyro.infer, n) for n in HANDLER_ELBOS if hasattr(pyro.infer, n))
    for cls in classes:
        for name in ("loss", "loss_and_grads", "differentiable_loss"):
            meth = cls.__dict__.get(name)
            if meth is None or getattr(meth, "_peer", False):
                continue

            def method(self, model, guide, *args, _meth=meth, **kwargs):
                _record("used")
                if wrap:
                    guide = _wrapped_guide(guide)
                return _meth(self, model, guide, *args, **kwargs)

            method.__name__, method._peer = name, True
            setattr(cls, name, method)

        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_peer", False):

            def __init__(self, *args, _init=init, **kwargs):
                _record("init")
                _init(self, *args, **kwargs)

            __init__._peer = True
            cls.__init__ = __init__
    global _OURS
    _OURS = classes
    _NAMES.update(c.__name__ for c in classes)


def _install() -> None:
    global _Instrumented, _REPLACED
    import pyro.infer
    import pyro.infer.renyi_elbo
    import pyro.infer.trace_elbo

    if MODE in ("handler", "pyro-elbos"):
        _REPLACED = "ELBOs"
        _install_handler(wrap=MODE == "handler")
        return
    if MODE in ("trace", "stl", "adaptive", "pyro-trace"):
        import pyro_gradroute.infer as gi

        base = {
            "trace": gi.Trace_ELBO,
            "stl": gi.TraceSTL_ELBO,
            "adaptive": gi.TraceAdaptiveSTL_ELBO,
            "pyro-trace": pyro.infer.trace_elbo.Trace_ELBO,
        }[MODE]
        _REPLACED = "Trace_ELBO"
        original = pyro.infer.trace_elbo.Trace_ELBO
        replacement = _Instrumented = _instrument(base, "Trace_ELBO")
        modules = [pyro.infer, pyro.infer.trace_elbo]
    elif MODE == "dreg-trace":
        from pyro_gradroute.infer import TraceDReG_ELBO

        _REPLACED = "Trace_ELBO"
        original = pyro.infer.trace_elbo.Trace_ELBO
        Target = _instrument(TraceDReG_ELBO, "Trace_ELBO")

        def __init__(self, num_particles=1, max_plate_nesting=math.inf, *args, **kwargs):
            if args:
                raise TypeError("Trace_ELBO (dreg-trace mode): pass arguments by keyword")
            for k in ("max_iarange_nesting", "ignore_jit_warnings", "jit_options"):
                kwargs.pop(k, None)
            for k in ("retain_graph", "tail_adaptive_beta"):
                kwargs.pop(k, None)
            vectorize = kwargs.pop("vectorize_particles", False)
            if num_particles > 1 and not vectorize and not STRICT:
                vectorize = True  # DReG draws coupled particles in one vectorized pass
                if _current[0] is not None:
                    _coerced.add(_current[0])
            Target.__init__(
                self,
                num_particles=num_particles,
                max_plate_nesting=max_plate_nesting,
                vectorize_particles=vectorize,
                **kwargs,
            )

        replacement = _Instrumented = type(
            "Trace_ELBO", (Target,), {"__init__": __init__, "__module__": Target.__module__}
        )
        modules = [pyro.infer, pyro.infer.trace_elbo]
    elif MODE in ("dreg", "pyro-renyi"):
        from pyro_gradroute.infer import TraceDReG_ELBO

        _REPLACED = "RenyiELBO"
        original = PyroRenyi = pyro.infer.renyi_elbo.RenyiELBO
        target = TraceDReG_ELBO if MODE == "dreg" else PyroRenyi
        _Instrumented = Target = _instrument(target, "RenyiELBO")

        class RenyiELBO(PyroRenyi):
            """``RenyiELBO(alpha)``: an instance of the instrumented target, at every alpha."""

            def __new__(
                cls,
                alpha=0,
                num_particles=2,
                max_plate_nesting=math.inf,
                max_iarange_nesting=None,
                vectorize_particles=False,
                strict_enumeration_warning=True,
            ):
                kw = dict(
                    num_particles=num_particles,
                    max_plate_nesting=max_plate_nesting,
                    max_iarange_nesting=max_iarange_nesting,
                    vectorize_particles=vectorize_particles,
                    strict_enumeration_warning=strict_enumeration_warning,
                )
                if num_particles > 1 and not vectorize_particles and not STRICT:
                    # DReG draws coupled particles in one vectorized pass only; the
                    # pyro-renyi baseline is coerced alike, to compare like with like
                    kw["vectorize_particles"] = True
                    if _current[0] is not None:
                        _coerced.add(_current[0])
                if MODE == "dreg":
                    kw.pop("max_iarange_nesting")
                return Target(alpha=alpha, **kw)

        RenyiELBO.__module__ = PyroRenyi.__module__
        replacement = RenyiELBO
        modules = [pyro.infer, pyro.infer.renyi_elbo]
    else:
        raise pytest.UsageError(f"GRADROUTE_PEER_ELBO={MODE!r}: unknown mode")

    global _OURS
    _OURS = (replacement, _Instrumented)
    _NAMES.add(_REPLACED)
    for mod in modules:
        setattr(mod, _REPLACED, replacement)
    # test helper modules imported already (none normally: the plugin runs first)
    for name, mod in list(sys.modules.items()):
        if name.startswith("tests") and getattr(mod, _REPLACED, None) is original:
            setattr(mod, _REPLACED, replacement)


def _elbo_kind(value, depth=0) -> set[str]:
    """``{"ours"}`` / ``{"other"}`` for ELBO classes or instances in a parametrize value."""
    from pyro.infer.elbo import ELBO

    if isinstance(value, type):
        if any(value is c or issubclass(value, c) for c in _OURS):
            return {"ours"}
        return {"other"} if issubclass(value, ELBO) else set()
    if isinstance(value, _OURS):
        return {"ours", "instance"}
    if isinstance(value, ELBO):
        return {"other"}
    kinds: set[str] = set()
    if depth < 2 and isinstance(value, list | tuple | dict):
        for v in value.values() if isinstance(value, dict) else value:
            kinds |= _elbo_kind(v, depth + 1)
    return kinds


def pytest_configure(config):
    _install()
    if MODE == "handler":
        # Pyro's tests turn warnings into errors; the handler's note that a guide without a
        # reparameterized draw (AutoDelta) is left as it is is not a failure of the test
        config.addinivalue_line(
            "filterwarnings",
            "ignore:stick_the_landing. the guide has no reparameterized site:UserWarning",
        )


_source_cache: dict = {}


def _source(obj) -> str:
    key = id(obj)
    if key not in _source_cache:
        try:
            _source_cache[key] = inspect.getsource(obj)
        except (OSError, TypeError):
            _source_cache[key] = ""
    return _source_cache[key]


_builders_cache: dict[str, set[str]] = {}


def _builders(module) -> set[str]:
    """Names in a test module that (transitively) mention the substituted ELBO.

    Functions and methods whose source names it or another builder, and module globals
    holding it (lists of ELBO classes or instances, aliases).
    """
    name = getattr(module, "__name__", "")
    if name in _builders_cache:
        return _builders_cache[name]
    srcs: dict[str, str] = {}
    found: set[str] = set(_NAMES)
    for attr, obj in list(vars(module).items()):
        if inspect.isfunction(obj) and obj.__module__ == name:
            srcs[attr] = _source(obj)
        elif inspect.isclass(obj) and obj.__module__ == name:
            srcs[attr] = _source(obj)
            for m_name, m in vars(obj).items():
                if inspect.isfunction(m):
                    srcs[m_name] = srcs.get(m_name, "") + _source(m)
        elif "ours" in _elbo_kind(obj):
            found.add(attr)
    changed = True
    while changed:
        changed = False
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(found))) + r")\b")
        for attr, src in srcs.items():
            if attr not in found and pattern.search(src):
                found.add(attr)
                changed = True
    _builders_cache[name] = found
    return found


def _may_build(item, kinds: set[str]) -> bool:
    if "ours" in kinds:
        return True
    module = getattr(item, "module", None)
    if module is None:
        return True
    src = _source(getattr(item, "function", None))
    src = src[max(0, src.find("def ")) :]  # without the decorators (parametrize lists)
    if "other" in kinds:  # a case of a test run for several ELBOs, ours not among them
        names = "|".join(map(re.escape, sorted(_NAMES)))
        return re.search(rf"\b({names})\b", src) is not None
    found = _builders(module)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(found))) + r")\b")
    if pattern.search(src):
        return True
    if any(f in found for f in getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    for v in callspec.params.values() if callspec is not None else ():
        if callable(v) and not isinstance(v, type) and pattern.search(_source(v)):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    """Count tests given an instance; deselect tests that cannot build the ELBO.

    Kept: tests parametrized by the substituted class or an instance of it; tests
    parametrized by other ELBOs only if their own source names it; other tests if their
    source names it or a function, method or global of their module that does
    (transitively), or they use such a fixture. Deselected (to save time; everything
    runs with ``GRADROUTE_PEER_ALL=1``): the rest, e.g. the ``TraceGraph_ELBO`` cases of
    a test parametrized over several ELBOs. Whatever runs, only tests that really build
    the ELBO are counted.
    """
    keep, drop = [], []
    run_all = bool(os.environ.get("GRADROUTE_PEER_ALL"))
    for item in items:
        callspec = getattr(item, "callspec", None)
        kinds: set[str] = set()
        if callspec is not None:
            for v in callspec.params.values():
                kinds |= _elbo_kind(v)
        if "instance" in kinds:
            _built.setdefault(item.nodeid, set()).add("param")
        if run_all or _may_build(item, kinds):
            keep.append(item)
        else:
            drop.append(item)
    _deselected[0] += len(drop)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.nodeid
    yield
    _current[0] = None


def _package_frame(excinfo) -> str | None:
    frame = None
    for entry in traceback.extract_tb(excinfo.tb):
        if f"{os.sep}pyro_gradroute{os.sep}" in entry.filename:
            path = entry.filename.split(f"{os.sep}pyro_gradroute{os.sep}", 1)[1]
            frame = f"pyro_gradroute/{path}:{entry.lineno} in {entry.name}"
    return frame


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    res = _results.setdefault(item.nodeid, {"outcome": "passed"})
    if report.when == "call" and hasattr(report, "wasxfail"):
        res["outcome"] = "xfailed" if report.skipped else "xpassed"
        return
    if report.skipped and res["outcome"] == "passed":
        res["outcome"] = "skipped"
        return
    if report.failed:
        res["outcome"] = "failed" if report.when == "call" else "error"
        if call.excinfo is not None and "exc_type" not in res:
            exc = call.excinfo.value
            msg = str(exc).strip().splitlines()
            res["when"] = report.when
            res["exc_type"] = type(exc).__name__
            first = msg[0] if msg else ""
            if first.endswith(":") and len(msg) > 1:  # a wrapper's header: add the cause
                first = f"{first} {msg[1]}"
            res["message"] = first[:300]
            res["full_message"] = "\n".join(msg)[:2000]
            res["package_frame"] = _package_frame(call.excinfo)
            last = traceback.extract_tb(call.excinfo.tb)[-1]
            res["raised_at"] = f"{os.path.basename(last.filename)}:{last.lineno} in {last.name}"


_collected = [0]


def pytest_collection_finish(session):
    _collected[0] = len(session.items)


def pytest_runtest_logfinish(nodeid, location):
    _results.setdefault(nodeid, {"outcome": "passed"})["done"] = True
    if nodeid in _built:
        _dump()  # incrementally: a run killed at a time limit keeps what it did


def _dump() -> None:
    if not OUT:
        return
    tests = {}
    for nodeid, how in _built.items():
        res = dict(_results.get(nodeid, {}))
        if not res.pop("done", False):
            res["outcome"] = "unfinished"
        res["built_by"] = sorted(how)
        if nodeid in _coerced:
            res["coerced_vectorize"] = True
        tests[nodeid] = res
    data = {
        "mode": MODE,
        "replaced": _REPLACED,
        "collected": _collected[0],
        "deselected": _deselected[0],
        "tests": tests,
    }
    tmp = OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, OUT)


def pytest_sessionfinish(session, exitstatus):
    _dump()
