"""Bad input to the flow settings and the rule registry is a clear error, raised early."""

import pytest
from torch.distributions import constraints
from torch.distributions.transforms import Transform

from pyro_gradroute.distributions import flows


@pytest.mark.parametrize("max_iter", [0, -3, 2.5, True])
def test_solve_settings_max_iter_must_be_a_positive_integer(max_iter):
    with pytest.raises(ValueError, match="solve_settings: max_iter must be an integer"):
        with flows.solve_settings(max_iter=max_iter):
            pass
    assert flows._SETTINGS.max_iter is None  # nothing was changed


@pytest.mark.parametrize("rtol", [-1e-3, 1.0, "1e-6"])
def test_solve_settings_rtol_must_be_in_unit_interval(rtol):
    with pytest.raises(ValueError, match=r"solve_settings: rtol must be (a number|>= 0\.0|< 1\.0)"):
        with flows.solve_settings(rtol=rtol):
            pass
    assert flows._SETTINGS.rtol is None


def test_solve_settings_accepts_valid_values():
    with flows.solve_settings(rtol=0.0, max_iter=1):
        assert (flows._SETTINGS.rtol, flows._SETTINGS.max_iter) == (0.0, 1)
    assert (flows._SETTINGS.rtol, flows._SETTINGS.max_iter) == (None, None)


class _Shift(Transform):
    domain = codomain = constraints.real
    bijective = True

    def _call(self, x):
        return x + 1


def test_register_flow_rule_needs_transform_classes():
    with pytest.raises(TypeError, match="at least one transform class"):
        flows.register_flow_rule()
    with pytest.raises(TypeError, match="expects torch Transform classes, got 'x'"):
        flows.register_flow_rule("x")
    with pytest.raises(TypeError, match="expects torch Transform classes"):
        flows.register_flow_rule(_Shift())  # an instance, not the class
    with pytest.raises(TypeError, match="the rule must be a function"):
        flows.register_flow_rule(_Shift)(None)
    assert flows.flow_rule(_Shift()) is None
