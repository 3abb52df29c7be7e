"""torchreplay.checks: the one integer-argument check every module uses (issue 27 item 7)."""

import pytest
import torch

from torchreplay.checks import check_int, is_int


@pytest.mark.parametrize("value", [True, False, 4.0, "4", None, torch.tensor(4), [4]])
def test_anything_but_an_int_is_a_type_error_naming_the_argument(value):
    """Mutation: dropping the bool exclusion from is_int accepts True/False here (seen failing)."""
    with pytest.raises(TypeError, match=r"^batch_size must be an int, got .* \(" + type(value).__name__ + r"\)$"):
        check_int(value, "batch_size")
    assert not is_int(value)


def test_ints_are_returned_unchanged_including_past_int64():
    assert check_int(0, "n") == 0 and check_int(-5, "n") == -5
    assert check_int(2**64, "per_group", low=1) == 2**64  # no bound given, none applied
    assert is_int(0) and is_int(2**70)


def test_bounds_are_inclusive_and_named_in_the_value_error():
    """Mutation: `value < low` as `value <= low` (or `value > high` as `>=`) refuses the bounds
    themselves here (seen failing)."""
    assert check_int(1, "capacity", low=1) == 1
    assert check_int(2**62 - 1, "version", low=0, high=2**62 - 1) == 2**62 - 1
    assert check_int(0, "version", low=0, high=2**62 - 1) == 0
    with pytest.raises(ValueError, match=r"^capacity must be an int >= 1, got 0$"):
        check_int(0, "capacity", low=1)
    with pytest.raises(ValueError, match=r"^version must be an int in \[0, 2\*\*62 - 1\], got 4611686018427387904$"):
        check_int(2**62, "version", low=0, high=2**62 - 1)
    with pytest.raises(ValueError, match=r"^version must be an int in \[0, 2\*\*62 - 1\], got -1$"):
        check_int(-1, "version", low=0, high=2**62 - 1)
    with pytest.raises(ValueError, match=r"^offset must be an int <= 7, got 8$"):
        check_int(8, "offset", high=7)
    with pytest.raises(ValueError, match=r"in \[-2\*\*63, 2\*\*63 - 1\]"):
        check_int(2**63, "value", low=-(2**63), high=2**63 - 1)


def test_none_only_where_allowed():
    assert check_int(None, "version", allow_none=True) is None
    assert check_int(3, "version", low=0, allow_none=True) == 3
    with pytest.raises(TypeError, match=r"^version must be an int, got None \(NoneType\)$"):
        check_int(None, "version")
    with pytest.raises(ValueError, match=r"^version must be None or an int >= 0, got -1$"):
        check_int(-1, "version", low=0, allow_none=True)
    with pytest.raises(TypeError, match=r"must be None or an int >= 0, got True \(bool\)"):
        check_int(True, "version", low=0, allow_none=True)


def test_error_overrides_both_kinds_for_document_fields():
    """A loaded document's field: a wrong type is a malformed value too, one exception type."""
    with pytest.raises(ValueError, match=r"^state 't_ref' must be an int >= 0, got '5' \(str\)$") as wrong_type:
        check_int("5", "state 't_ref'", low=0, error=ValueError)
    assert type(wrong_type.value) is ValueError
    with pytest.raises(KeyError, match="t_ref"):
        check_int(-1, "state 't_ref'", low=0, error=KeyError)


def test_a_long_value_is_quoted_shortly():
    with pytest.raises(TypeError) as info:
        check_int("x" * 10_000, "name")
    assert len(str(info.value)) < 200 and "..." in str(info.value)
