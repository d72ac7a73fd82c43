"""The declared schemas' error wording (vllm_selfspec.schema): no vLLM, milliseconds."""

from __future__ import annotations

from typing import Annotated, Literal

import pytest
from pydantic import Field, StrictBool

from vllm_selfspec.errors import SelfSpecConfigError
from vllm_selfspec.schema import NonNegativeInt, PositiveInt, Schema, fraction


class _Knobs(Schema):
    WHERE = "knobs."
    ERROR = SelfSpecConfigError
    POSITIONAL = ("count",)

    count: PositiveInt = 1
    offset: NonNegativeInt = 0
    share: fraction(low_open=True, high_open=False) = 0.5  # type: ignore[valid-type]
    threshold: fraction(low_open=False, high_open=True) = 0.5  # type: ignore[valid-type]
    flag: StrictBool = True
    mode: Literal["a", "b"] = "a"
    kind: Literal["x", "y", "z"] = "x"
    budget: Annotated[PositiveInt | None, Field(description="null or an integer >= 1")] = None


@pytest.mark.parametrize(("given", "message"), [
    ({"count": 0}, "knobs.count must be an integer >= 1, got 0"),
    ({"count": True}, "knobs.count must be an integer >= 1, got True"),  # bool is no integer
    ({"offset": -1}, "knobs.offset must be an integer >= 0, got -1"),
    ({"share": 0}, "knobs.share must be a number in (0, 1], got 0"),
    ({"threshold": 1.0}, "knobs.threshold must be a number in [0, 1), got 1.0"),
    ({"threshold": float("nan")}, "knobs.threshold must be a number in [0, 1), got nan"),
    ({"flag": 1}, "knobs.flag must be true or false, got 1"),
    ({"mode": "c"}, "knobs.mode must be 'a' or 'b', got 'c'"),
    ({"kind": "w"}, "knobs.kind must be one of 'x', 'y', 'z', got 'w'"),
    ({"budget": 0}, "knobs.budget must be null or an integer >= 1, got 0"),
])
def test_messages_are_worded_from_the_declarations(given: dict, message: str) -> None:
    with pytest.raises(SelfSpecConfigError) as info:
        _Knobs(**given)
    assert str(info.value) == message


def test_unknown_keys_positional_values_and_single_fields() -> None:
    with pytest.raises(SelfSpecConfigError, match=r"knobs: unknown key 'cuont' \(did you mean "
                                                  r"'count'\?\); allowed keys: count, offset"):
        _Knobs.validated({"cuont": 2}, label="knobs")
    assert _Knobs(3).count == 3 and _Knobs(3) == _Knobs(count=3)
    with pytest.raises(TypeError, match="at most 1 positional"):
        _Knobs(3, 4)
    share = _Knobs.check_value("share", 1)
    assert share == 1.0 and isinstance(share, float)
    with pytest.raises(SelfSpecConfigError, match=r"^where: share must be a number in \(0, 1\]"):
        _Knobs.check_value("share", 2, "where: share")
    assert _Knobs().threshold == 0.5  # defaults are not re-validated
