"""Private Pyro API is used in ``pyro_gradroute/_compat.py`` only.

``PENDING`` lists the files that still use it directly, to be switched to ``_compat``; each must
really still do so, so that the list only shrinks."""

import re
from pathlib import Path

import pytest
import torch

PACKAGE = Path(__file__).resolve().parents[1] / "pyro_gradroute"
PRIVATE = re.compile(
    r"param_store\(\)\._params|\._params\[|_Subsample|_compute_log_r|[\"']_deterministic[\"']"
    r"|\._pyro_name|\._pyro_context|_pyro_set_supermodule"
    r"|_will_engine_execute_node|\._backward_hooks|[\"']_backward_hooks[\"']|sys\._getframe"
    r"|_cache_size|_cached_x_y|_cached_log_scale|_cache_log_detJ|_cached_logDetJ"
    r"|_cached_log_df_inv_dx|_cached_A\b|_cached_W_pre|_cached_C\b|_cached_T_C|\._params\b"
    r"|_sum_rightmost|[\"']_parameters[\"']\]|_PYRO_STACK|_engine_run_backward"
)
PENDING: set[str] = set()


def uses():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        hits = PRIVATE.findall(path.read_text())
        if hits and rel != "_compat.py":
            found[rel] = sorted(set(hits))
    return found


def test_private_pyro_api_only_in_compat():
    found = uses()
    assert set(found) <= PENDING, {k: v for k, v in found.items() if k not in PENDING}
    assert set(found) == PENDING, f"switched to _compat, drop from PENDING: {PENDING - set(found)}"


def test_compat_functions_work_on_the_installed_versions():
    """Each private reach in ``_compat`` does what it stands for on this torch and Pyro."""
    import pyro
    import torch
    from pyro.infer import Trace_ELBO

    from pyro_gradroute import _compat

    x = torch.ones(2, requires_grad=True)
    m = x * 2
    other = (x * 5).sum()  # a graph the backward below does not run
    y = m.sum()
    seen = []

    def pre(grad_outputs):
        seen.append(_compat.will_engine_execute(m.grad_fn))
        seen.append(_compat.will_engine_execute(other.grad_fn))

    y.grad_fn.register_prehook(pre)
    y.backward()
    assert seen == [True, False]
    t = x * 3
    t.register_hook(lambda g: g)
    assert len(_compat.tensor_backward_hooks(t)) == 1

    found = []

    def guide():
        found.append(_compat.calling_elbo(depth=60))

    def model():
        pass

    elbo = Trace_ELBO()
    elbo.loss(model, guide)
    assert found and found[0] is elbo

    outer, inner = pyro.poutine.scale(scale=2.0), pyro.poutine.mask(mask=True)
    assert _compat.handler_stack() == []
    with outer, inner:
        assert _compat.handler_stack() == [inner, outer]

    def inner():
        return _compat.find_frame({outer.__code__: "outer"})

    def outer():
        return inner()

    frame, hit = outer()
    assert hit == "outer" and frame.f_code is outer.__code__
    assert pyro.__version__.startswith("1.9"), pyro.__version__


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _log_diag(t, x):
    """log of the diagonal of the Jacobian of ``t`` at ``x`` (one sample), from autograd."""
    J = torch.autograd.functional.jacobian(t._call, x)
    return J.diagonal().abs().log()


def test_transform_cache_accessors():
    """``(x, y)`` of the last call; setting it makes the inverse at ``y`` return ``x``."""
    from torch.distributions.transforms import ExpTransform

    from pyro_gradroute._compat import set_transform_cache, transform_cache

    t, x = ExpTransform(cache_size=1), _x(3)
    assert transform_cache(t) == (None, None)
    y = t(x)
    cx, cy = transform_cache(t)
    assert cx is x and cy is y
    x2, y2 = _x(3), _x(3)
    set_transform_cache(t, x2, y2)
    assert t.inv(y2) is x2
    assert transform_cache(ExpTransform()) is None  # uncached


def test_cached_log_scale_is_the_log_diagonal():
    import pyro.distributions.transforms as T

    from pyro_gradroute._compat import cached_log_scale

    torch.manual_seed(0)
    for t, part in [
        (T.affine_autoregressive(4, hidden_dims=[8]).double(), slice(None)),
        (T.affine_coupling(4, hidden_dims=[8]).double(), slice(2, None)),
    ]:
        for p in t.parameters():
            p.data.normal_()
        x = _x(4)
        t(x)
        torch.testing.assert_close(cached_log_scale(t), _log_diag(t, x)[part])


def test_spline_log_derivative_is_the_log_diagonal():
    import pyro.distributions.transforms as T

    from pyro_gradroute._compat import spline_log_derivative

    torch.manual_seed(0)
    t = T.spline_autoregressive(4).double()
    x = _x(4)
    t(x)
    torch.testing.assert_close(spline_log_derivative(t), _log_diag(t, x))
    c = T.spline_coupling(4, split_dim=1).double()
    c(x)
    cache = spline_log_derivative(c)  # [the transformed part (x2) ..., the spline of x1]
    torch.testing.assert_close(torch.cat([cache[3:], cache[:3]]), _log_diag(c, x))


def test_cached_log_det_jacobian_of_bnaf_is_the_log_diagonal():
    import pyro.distributions.transforms as T

    from pyro_gradroute._compat import cached_log_det_jacobian

    torch.manual_seed(0)
    t = T.block_autoregressive(3).double()
    x = _x(3)
    t(x)
    # Pyro's term carries an epsilon of ~1e-8
    torch.testing.assert_close(cached_log_det_jacobian(t), _log_diag(t, x), rtol=0, atol=1e-6)


def test_naf_cache_gives_the_log_diagonal():
    import pyro.distributions.transforms as T

    from pyro_gradroute._compat import naf_cache
    from pyro_gradroute.distributions.flows.triangular import naf_log_diag

    torch.manual_seed(0)
    t = T.neural_autoregressive(3, width=8).double()
    x = _x(3)
    t(x)
    assert len(naf_cache(t)) == 5 and all(torch.is_tensor(v) for v in naf_cache(t))
    torch.testing.assert_close(naf_log_diag(t), _log_diag(t, x))


def test_conditioned_params_and_module_attr_give_the_map():
    """A Planar layer's parameters, read either way, reproduce its forward map."""
    import pyro.distributions.transforms as T

    from pyro_gradroute._compat import conditioned_params, module_attr

    torch.manual_seed(0)
    ctx = _x(2)
    cond = T.conditional_planar(3, 2).double().condition(ctx)
    plain = T.planar(3).double()
    assert module_attr(plain, "w") is plain.w
    x = _x(3)
    for t, (bias, u, w) in [
        (cond, conditioned_params(cond)),
        (plain, tuple(module_attr(plain, n) for n in ("bias", "u", "w"))),
    ]:
        y = x + t.u_hat(u, w) * torch.tanh((w * x).sum(-1, keepdim=True) + bias)
        torch.testing.assert_close(t(x), y)


def test_sum_rightmost():
    from pyro_gradroute._compat import sum_rightmost

    x = _x(2, 3, 4)
    torch.testing.assert_close(sum_rightmost(x, 2), x.sum((-1, -2)))
    assert sum_rightmost(x, 0) is x


def test_vjp_is_torch_autograd_grad():
    """The engine call gives torch's gradients, raises torch's errors, and falls back to
    ``torch.autograd.grad`` for a seed left to torch (None) and for tensor subclasses."""
    from pyro.ops.provenance import track_provenance

    from pyro_gradroute._compat import vjp

    x, w = torch.randn(3, requires_grad=True), torch.randn(2, requires_grad=True)
    y, s = (x * 2).sin(), x.sum() * 3
    seeds = [torch.randn(3), torch.tensor(0.5)]
    ref = torch.autograd.grad([y, s], [x, w], seeds, retain_graph=True, allow_unused=True)
    got = vjp([y, s], [x, w], seeds)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    assert got[1] is None and ref[1] is None  # unused input
    torch.testing.assert_close(vjp([s], [x], [None])[0], torch.full((3,), 3.0))
    tracked = track_provenance(x * 2, frozenset({"z"}))
    torch.testing.assert_close(
        vjp([tracked.sum()], [x], [torch.tensor(1.0)])[0], torch.full((3,), 2.0)
    )
    with pytest.raises(RuntimeError, match="invalid gradient at index 0"):
        vjp([y], [x], [torch.ones(2)])
    with pytest.raises(RuntimeError, match="does not require grad"):
        vjp([y.detach()], [x], [torch.ones(3)])
