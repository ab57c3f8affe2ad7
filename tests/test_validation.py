import math

import numpy as np
import pytest

from backfill.errors import NodeConfigError, ServerConfigError, WorkloadError
from backfill.validation import check_int, check_non_negative, check_positive, is_finite_number, is_int


@pytest.mark.parametrize("value", [0, 7, np.int64(3), 65535])
def test_integers_in_range_pass(value):
    check_int(ServerConfigError, "port", value, 0, 65535)


@pytest.mark.parametrize("value", [True, 1.0, "8", None, -1, 65536, np.float64(2.0)])
def test_check_int_raises_the_callers_error_naming_the_field(value):
    with pytest.raises(ServerConfigError, match=r"port must be an integer in \[0, 65535\], got"):
        check_int(ServerConfigError, "port", value, 0, 65535)


def test_check_int_without_upper_bound_says_so():
    with pytest.raises(NodeConfigError, match="num_handles must be an integer >= 1, got 0"):
        check_int(NodeConfigError, "num_handles", 0, 1)
    check_int(NodeConfigError, "num_handles", 10**9, 1)


@pytest.mark.parametrize("value", [0, -0.5, math.inf, math.nan, True, "1", None])
def test_check_positive_rejects(value):
    with pytest.raises(WorkloadError, match="rate must be a positive number"):
        check_positive(WorkloadError, "rate", value)


@pytest.mark.parametrize("value", [1e-9, 3, np.float32(0.5)])
def test_check_positive_accepts(value):
    check_positive(WorkloadError, "rate", value)


def test_check_non_negative_takes_zero_and_rejects_below():
    check_non_negative(ServerConfigError, "drain_timeout_s", 0)
    with pytest.raises(ServerConfigError, match="drain_timeout_s must be a non-negative number"):
        check_non_negative(ServerConfigError, "drain_timeout_s", -1)


def test_predicates_exclude_bools_and_non_finite():
    assert is_int(np.int32(2)) and not is_int(True) and not is_int(2.0)
    assert is_finite_number(np.float64(1.5)) and not is_finite_number(False) and not is_finite_number(math.inf)
