"""rope_lie/encodings/_checks.py: the shared hyper-parameter checks name the value and the rule."""

import numpy as np
import pytest

from rope_lie.encodings import _checks


@pytest.mark.parametrize("value", [0, 0.5, 3, np.float32(2.0)])
def test_check_real_accepts_finite_non_negative_numbers(value):
    assert _checks.check_real(value, "init_std", "fam") == float(value)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), "0.1", True, None])
def test_check_real_names_the_bad_value(value):
    with pytest.raises(ValueError, match=r"^fam: init_std=.* must be a non-negative finite"):
        _checks.check_real(value, "init_std", "fam")


def test_check_real_positive_rejects_zero():
    with pytest.raises(ValueError, match=r"base=0 must be a positive finite number"):
        _checks.check_real(0, "base", "fam", positive=True)


@pytest.mark.parametrize("value", [-1, 1.0, True, "2"])
def test_check_nonnegative_int_names_the_bad_value(value):
    with pytest.raises(ValueError, match=r"^num_prefix=.* must be a non-negative integer"):
        _checks.check_nonnegative_int(value, "num_prefix", None)
    assert _checks.check_nonnegative_int(0, "num_prefix", "fam") == 0
