"""Declared schemas for the plugin's settings, worded with the project's error messages.

The selfspec settings (:class:`~vllm_selfspec.config.SelfSpecSettings`), a profile's ``draft``
defaults (:class:`~vllm_selfspec.layers.profiles.DraftDefaults`) and the ``online_search`` knobs
(:class:`~vllm_selfspec.layers.online_search.OnlineSearchConfig`) are pydantic models (pydantic is
a vLLM dependency). Each field declares its type, range and default once, with the field types
below, and users read errors worded from those declarations::

    <where><key> must be <what>, got <value>

where ``<what>`` comes from the field (``an integer >= 1``, ``a number in [0, 1)``, ``true or
false``, ``'host' or 'device'``, or the field's ``description``). An unknown key gets the closest
valid key and the allowed keys (:func:`~vllm_selfspec.errors.check_known_keys`). Rules across
fields stay validators of their model and raise the project's errors themselves.

Pure Python plus pydantic: importable without vLLM or torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from vllm_selfspec.errors import check_known_keys

__all__ = [
    "NonNegativeInt",
    "json_type",
    "PositiveInt",
    "Schema",
    "fraction",
]

PositiveInt = Annotated[int, Field(ge=1, strict=True)]
"""An integer >= 1 (``bool`` is not an integer here)."""
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
"""An integer >= 0."""


def fraction(*, low_open: bool, high_open: bool) -> Any:
    """A finite number in ``[0, 1]``, either end open; ints are taken as floats, bools are not."""
    low = Field(gt=0) if low_open else Field(ge=0)
    high = Field(lt=1) if high_open else Field(le=1)
    return Annotated[float, Field(strict=True, allow_inf_nan=False), low, high]


def json_type(value: object) -> str:
    """The JSON name of a value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _bounds(metadata: list[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in metadata:
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(item, getattr(annotated_types, name.capitalize())):
                out[name] = getattr(item, name)
    return out


def describe(field: FieldInfo) -> str:
    """What a value of ``field`` must be, in the words of the project's messages."""
    if field.description:
        return field.description
    annotation = field.annotation
    if get_origin(annotation) is Literal:
        values = [repr(v) for v in get_args(annotation)]
        return " or ".join(values) if len(values) <= 2 else f"one of {', '.join(values)}"
    bounds = _bounds(field.metadata)
    if annotation is bool:
        return "true or false"
    if annotation is int:
        if "ge" in bounds:
            return f"an integer >= {bounds['ge']:g}"
        return "an integer"
    if annotation is float:
        if ("ge" in bounds or "gt" in bounds) and ("le" in bounds or "lt" in bounds):
            low = f"[{bounds['ge']:g}" if "ge" in bounds else f"({bounds['gt']:g}"
            high = f"{bounds['le']:g}]" if "le" in bounds else f"{bounds['lt']:g})"
            return f"a number in {low}, {high}"
        return "a number"
    return f"a {getattr(annotation, '__name__', annotation)}"


def _error(model: type[Schema], exc: ValidationError, where: str,
           error: type[ValueError]) -> ValueError:
    """The project's error for the first problem pydantic found."""
    first = exc.errors(include_url=False)[0]
    cause = (first.get("ctx") or {}).get("error")
    if first["type"] == "value_error" and isinstance(cause, ValueError):
        return cause  # a rule across fields: already worded (and of its own error class)
    loc = [str(part) for part in first["loc"]]
    field = model.model_fields.get(loc[0]) if loc else None
    if field is None or first["type"] in ("missing", "extra_forbidden"):
        return error(f"{where}{'.'.join(loc)}: {first['msg']}")
    return error(f"{where}{'.'.join(loc)} must be {describe(field)}, got "
                 f"{model.shown(first['input'])}")


@contextlib.contextmanager
def worded(model: type[Schema], where: str, error: type[ValueError]) -> Iterator[None]:
    """Turn a pydantic ``ValidationError`` of ``model`` into ``error`` worded as above."""
    try:
        yield
    except ValidationError as exc:
        raise _error(model, exc, where, error) from None


class Schema(BaseModel):
    """A frozen settings model whose errors are the project's (see the module docstring).

    Subclasses set :attr:`WHERE` (the prefix of their keys in messages, e.g. ``"online_search."``),
    :attr:`ERROR` (the exception class raised for them), :attr:`POSITIONAL` (fields that may be
    given by position, in order) and :attr:`JSON_TYPES` (name the bad value's JSON type too)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    WHERE: ClassVar[str] = ""
    ERROR: ClassVar[type[ValueError]] = ValueError
    POSITIONAL: ClassVar[tuple[str, ...]] = ()
    JSON_TYPES: ClassVar[bool] = False

    def __init__(self, *args: Any, **data: Any) -> None:
        cls = type(self)
        if len(args) > len(cls.POSITIONAL):
            raise TypeError(f"{cls.__name__} takes at most {len(cls.POSITIONAL)} positional "
                            f"arguments ({', '.join(cls.POSITIONAL)})")
        data.update(zip(cls.POSITIONAL, args, strict=False))
        with worded(cls, cls.WHERE, cls.ERROR):
            super().__init__(**data)

    @classmethod
    def shown(cls, value: object) -> str:
        """A bad value as messages show it."""
        return f"{json_type(value)} {value!r}" if cls.JSON_TYPES else repr(value)

    @classmethod
    def validated(cls, data: Mapping[str, Any], *, label: str, where: str | None = None) -> Any:
        """A model from a mapping of its keys; an unknown key is an error naming ``label`` (the
        mapping), a close match and the allowed keys. ``where`` overrides :attr:`WHERE`."""
        check_known_keys(data, list(cls.model_fields), label, cls.ERROR)
        with worded(cls, cls.WHERE if where is None else where, cls.ERROR):
            return cls.model_validate(dict(data))

    @classmethod
    def check_value(cls, key: str, value: Any, where: str | None = None) -> Any:
        """One field's value validated on its own (``where``: its name in the message, default
        :attr:`WHERE` + ``key``); returns it as the model would hold it."""
        field = cls.model_fields[key]
        annotation = field.annotation
        if field.metadata:
            annotation = Annotated[(annotation, *field.metadata)]
        adapter = TypeAdapter(annotation, config=ConfigDict(strict=True))
        try:
            return adapter.validate_python(value)
        except ValidationError:
            label = f"{cls.WHERE}{key}" if where is None else where
            raise cls.ERROR(f"{label} must be {describe(field)}, got {cls.shown(value)}") from None
