"""Skip profiles: which attention / MLP sub-layers the draft pass skips, for one model checkpoint.

A profile is a small JSON file (``schema_version`` 1)::

    {
      "schema_version": 1,
      "model": {"name": "meta-llama/Llama-2-13b-hf", "architecture": "LlamaForCausalLM",
                "num_hidden_layers": 40, "hidden_size": 5120, "vocab_size": 32000},
      "skip_attention": [3, 5, 6],
      "skip_mlp": [6, 9],
      "draft": {"num_speculative_tokens": 6},
      "provenance": {"method": "...", "source": "...", "acceptance": null, "date": null}
    }

Layer indices are 0-based. ``model`` is the fingerprint of the checkpoint the profile was searched
on (``model.name`` is informative and optional; the other four fields are compared with the served
model). ``draft`` (optional) holds default draft settings (keys in :data:`DRAFT_KEYS`) that apply
when the user does not set them; ``provenance`` (optional) is free-form metadata. The profile's
name is the file's stem.

Profiles shipped with the package live in the top-level ``profiles/*.json`` (installed as the data
package ``vllm_selfspec.profiles``) and are addressed by
that stem, e.g. ``load_profile("llama-2-13b.draft-verify")``.

Pure Python plus pydantic (a vLLM dependency): importable without vLLM or torch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictStr, field_validator

from vllm_selfspec.control.controller import DEFAULT_EXIT_THRESHOLD, DEFAULT_TARGET_ACCEPTANCE
from vllm_selfspec.errors import (
    ProfileError,
    SelfSpecConfigError,
    check_known_keys,
    check_required_keys,
    did_you_mean,
    is_int,
)
from vllm_selfspec.schema import PositiveInt, Schema, fraction, json_type

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "DRAFT_KEYS",
    "SCHEMA_VERSION",
    "ModelFingerprint",
    "Profile",
    "ProfileError",
    "SelfSpecConfigError",
    "check_layer_indices",
    "find_shipped_profile",
    "load_profile",
    "shipped_profile_names",
    "shipped_profiles",
]

logger = logging.getLogger("vllm.selfspec.profiles")

_ExitThreshold = fraction(low_open=False, high_open=True)  # [0, 1)
_TargetAcceptance = fraction(low_open=True, high_open=False)  # (0, 1]

SCHEMA_VERSION = 1
"""The profile file format version this module reads and writes."""

DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_ADAPTIVE = True
DEFAULT_DRAFT_SAMPLING = "probabilistic"
DRAFT_SAMPLING_MODES = ("probabilistic", "argmax")


class DraftKnobs(Schema):
    """The draft settings, declared once: selfspec keys of a speculative config (the fields of
    :class:`~vllm_selfspec.config.SelfSpecSettings`, which extends this model) and what a
    profile's ``draft`` object may default."""

    ERROR = SelfSpecConfigError

    num_speculative_tokens: PositiveInt
    adaptive: StrictBool = DEFAULT_ADAPTIVE
    draft_confidence_threshold: _ExitThreshold = DEFAULT_EXIT_THRESHOLD
    target_acceptance: _TargetAcceptance = DEFAULT_TARGET_ACCEPTANCE
    draft_sampling: Literal[DRAFT_SAMPLING_MODES] = DEFAULT_DRAFT_SAMPLING


DRAFT_KEYS = frozenset(DraftKnobs.model_fields)
"""Keys allowed in a profile's ``draft`` defaults (same meaning as the selfspec config keys)."""

_COMPARED_FIELDS = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size")
_REQUIRED_KEYS = ("schema_version", "model", "skip_attention", "skip_mlp")
_OPTIONAL_KEYS = ("draft", "provenance")


# --------------------------------------------------------------------------------------- helpers


def check_layer_indices(
    value: object,
    *,
    key: str,
    num_hidden_layers: int,
    owner: str = "the model",
    prefix: str = "",
    error: type[SelfSpecConfigError] = SelfSpecConfigError,
) -> tuple[int, ...]:
    """Validate a list of 0-based layer indices and return it as a sorted tuple.

    ``value`` must be a list (or tuple) of ints (``bool`` is rejected), each in
    ``0 .. num_hidden_layers - 1``, without duplicates; an empty list is fine. Errors are raised as
    ``error(prefix + message)``; the message names ``key`` and the allowed range.
    """
    last = num_hidden_layers - 1
    valid = f"valid layer indices are 0..{last} ({owner} has {num_hidden_layers} layers)"
    if not isinstance(value, (list, tuple)):
        raise error(
            f"{prefix}{key} must be a list of layer indices ({valid}), "
            f"got {json_type(value)} {value!r}"
        )
    seen: set[int] = set()
    duplicates: list[int] = []
    for i, item in enumerate(value):
        if not is_int(item):
            raise error(
                f"{prefix}{key}[{i}] = {item!r} ({json_type(item)}) is not an integer layer "
                f"index; {valid}"
            )
        if item < 0:
            raise error(f"{prefix}{key}[{i}] = {item} is negative; {valid}")
        if item > last:
            raise error(f"{prefix}{key}[{i}] = {item} is out of range; {valid}")
        if item in seen and item not in duplicates:
            duplicates.append(item)
        seen.add(item)
    if duplicates:
        listed = ", ".join(str(d) for d in duplicates)
        raise error(f"{prefix}{key} lists layer(s) {listed} more than once; list each layer once")
    return tuple(sorted(seen))


def _checkpoint_key(name: str | None) -> str | None:
    """Normalise a model name / path to the checkpoint's own name, lower-cased.

    ``"meta-llama/Llama-2-13b-chat-hf"`` and ``"/models/Llama-2-13b-chat-hf/"`` both give
    ``"llama-2-13b-chat-hf"``; a Hugging Face cache path
    ``".../models--meta-llama--Llama-2-13b-chat-hf/snapshots/<hash>"`` gives the same.
    """
    if not name:
        return None
    parts = [p for p in re.split(r"[\\/]+", name.strip()) if p]
    if not parts:
        return None
    for part in reversed(parts):
        if part.startswith("models--") and part.count("--") >= 2:
            return part.split("--")[-1].lower()
    return parts[-1].lower()


# ------------------------------------------------------------------------------- fingerprint


_Size = Annotated[PositiveInt, Field(description="a positive integer")]


class ModelFingerprint(Schema):
    """The shape of a checkpoint that a skip profile depends on.

    Two fingerprints match when ``architecture``, ``num_hidden_layers``, ``hidden_size`` and
    ``vocab_size`` are equal. ``name`` is informative only: it is not compared (nor part of
    ``==``), though :func:`find_shipped_profile` uses it to tell same-shaped checkpoints apart.
    """

    ERROR = SelfSpecConfigError
    POSITIONAL = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size", "name")
    JSON_TYPES = True

    architecture: Annotated[
        StrictStr,
        Field(min_length=1, description="a non-empty string such as 'LlamaForCausalLM'"),
    ]
    num_hidden_layers: _Size
    hidden_size: _Size
    vocab_size: _Size
    name: Annotated[StrictStr | None, Field(description="a string or null")] = None

    @field_validator("name")
    @classmethod
    def _empty_name(cls, value: str | None) -> str | None:
        return value or None

    def _compared(self) -> tuple[Any, ...]:
        return tuple(getattr(self, key) for key in _COMPARED_FIELDS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelFingerprint):
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self) -> int:
        return hash(self._compared())

    @classmethod
    def from_hf_config(cls, hf_config: Any, name: str | None = None) -> ModelFingerprint:
        """Fingerprint of a Hugging Face style config (duck-typed).

        ``hf_config`` needs ``architectures`` (the first entry is used), ``num_hidden_layers``,
        ``hidden_size`` and ``vocab_size``; the three sizes are also looked up in
        ``hf_config.get_text_config()`` when missing on the top-level config. ``name`` defaults to
        ``hf_config.name_or_path`` (what vLLM sets to the served model's name or path).
        """
        archs = getattr(hf_config, "architectures", None)
        if isinstance(archs, str):
            archs = [archs]
        if not archs or not isinstance(archs[0], str):
            raise SelfSpecConfigError(
                f"model config: 'architectures' must be a non-empty list of class names, "
                f"got {archs!r}; cannot tell which decoder class the model uses"
            )
        get_text_config = getattr(hf_config, "get_text_config", None)
        sizes: dict[str, Any] = {}
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            value = getattr(hf_config, key, None)
            if value is None and callable(get_text_config):
                value = getattr(get_text_config(), key, None)
            if value is None:
                raise SelfSpecConfigError(f"model config has no '{key}' attribute")
            sizes[key] = value
        if name is None:
            for attr in ("name_or_path", "_name_or_path"):
                candidate = getattr(hf_config, attr, None)
                if isinstance(candidate, str) and candidate:
                    name = candidate
                    break
        try:
            return cls(architecture=archs[0], name=name, **sizes)
        except SelfSpecConfigError as e:
            raise SelfSpecConfigError(f"model config: {e}") from None

    @classmethod
    def from_model_dir(
        cls, path: str | os.PathLike[str], name: str | None = None
    ) -> ModelFingerprint:
        """Fingerprint of a local checkpoint directory, read from ``path/config.json``.

        ``path`` may also be the ``config.json`` file itself. ``name`` defaults to ``path`` (the
        directory's name is what :func:`find_shipped_profile` compares), not to the
        ``_name_or_path`` stored in the file, which fine-tunes often inherit from their base.
        """
        p = Path(path).expanduser()
        config_file = p if p.is_file() else p / "config.json"
        try:
            text = config_file.read_text(encoding="utf-8")
        except OSError as e:
            raise SelfSpecConfigError(f"cannot read model config {config_file}: {e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SelfSpecConfigError(
                f"model config {config_file}: malformed JSON at line {e.lineno}, column {e.colno} "
                f"(char {e.pos}): {e.msg}"
            ) from None
        if not isinstance(data, dict):
            raise SelfSpecConfigError(f"model config {config_file}: the top level is not an object")
        text_config = data.get("text_config")
        sizes: dict[str, Any] = {}
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            value = data.get(key)
            if value is None and isinstance(text_config, dict):
                value = text_config.get(key)
            if value is None:
                raise SelfSpecConfigError(f"model config {config_file} has no '{key}'")
            sizes[key] = value
        archs = data.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise SelfSpecConfigError(
                f"model config {config_file}: 'architectures' must be a non-empty list of class "
                f"names, got {archs!r}"
            )
        try:
            return cls(architecture=archs[0], name=name or str(path), **sizes)
        except SelfSpecConfigError as e:
            raise SelfSpecConfigError(f"model config {config_file}: {e}") from None

    def mismatches(self, other: ModelFingerprint) -> list[str]:
        """Human-readable differences, ``self`` being the profile's side and ``other`` the model's.

        E.g. ``["num_hidden_layers: profile 40, model 30"]``; ``[]`` when they match (``name`` is
        ignored).
        """
        out = []
        for key in _COMPARED_FIELDS:
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                out.append(f"{key}: profile {mine}, model {theirs}")
        return out

    def describe(self) -> str:
        """One line, e.g. ``'meta-llama/Llama-2-13b-hf' (LlamaForCausalLM, 40 layers, ...)``."""
        label = repr(self.name) if self.name else "unnamed model"
        return (
            f"{label} ({self.architecture}, {self.num_hidden_layers} layers, "
            f"hidden {self.hidden_size}, vocab {self.vocab_size})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, where: str = "model") -> ModelFingerprint:
        """Inverse of :meth:`to_dict`; ``name`` may be missing. Raises :class:`ProfileError`
        prefixed with ``where``."""
        if not isinstance(d, Mapping):
            raise ProfileError(
                f"{where} must be an object with keys {', '.join(('name',) + _COMPARED_FIELDS)}, "
                f"got {json_type(d)}"
            )
        allowed = ("name",) + _COMPARED_FIELDS
        check_known_keys(d, allowed, where, ProfileError)
        check_required_keys(d, _COMPARED_FIELDS, where, ProfileError,
                            f"; required: {', '.join(_COMPARED_FIELDS)}")
        try:
            return cls(
                architecture=d["architecture"],
                num_hidden_layers=d["num_hidden_layers"],
                hidden_size=d["hidden_size"],
                vocab_size=d["vocab_size"],
                name=d.get("name"),
            )
        except SelfSpecConfigError as e:
            raise ProfileError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class Profile:
    """A validated skip profile. Construction validates and normalises (sorted tuples).

    ``path`` (where it was loaded from) is not part of ``==``.
    """

    name: str
    model: ModelFingerprint
    skip_attention: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    draft: dict[str, Any] = field(default_factory=dict, hash=False)
    provenance: dict[str, Any] = field(default_factory=dict, hash=False)
    path: str | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """``"profile 'NAME' (PATH)"``, for messages."""
        where = f" ({self.path})" if self.path else ""
        return f"profile '{self.name}'{where}"

    def __post_init__(self) -> None:
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        if not isinstance(self.name, str) or not self.name:
            raise ProfileError(f"profile name must be a non-empty string, got {self.name!r}")
        prefix = f"{self.label}: "
        if not isinstance(self.model, ModelFingerprint):
            raise ProfileError(f"{prefix}model must be a ModelFingerprint, got {self.model!r}")
        n = self.model.num_hidden_layers
        for key in ("skip_attention", "skip_mlp"):
            indices = check_layer_indices(
                getattr(self, key),
                key=key,
                num_hidden_layers=n,
                owner="the profile's model",
                prefix=prefix,
                error=ProfileError,
            )
            object.__setattr__(self, key, indices)
        if not isinstance(self.draft, Mapping):
            raise ProfileError(
                f"{prefix}draft must be an object of default draft settings "
                f"(keys: {', '.join(sorted(DRAFT_KEYS))}), got {json_type(self.draft)}"
            )
        check_known_keys(self.draft, sorted(DRAFT_KEYS), f"{prefix}draft", ProfileError)
        # the draft length is checked here (a profile is useless with a bad one); the other
        # knobs where they are used (config.resolve_settings), against the same declarations
        if "num_speculative_tokens" in self.draft:
            key = "num_speculative_tokens"
            try:
                DraftKnobs.check_value(key, self.draft[key], f"{prefix}draft.{key}")
            except SelfSpecConfigError as exc:
                raise ProfileError(str(exc)) from None
        if not isinstance(self.provenance, Mapping):
            raise ProfileError(
                f"{prefix}provenance must be an object, got {json_type(self.provenance)}"
            )
        for key in self.provenance:
            if not isinstance(key, str):
                raise ProfileError(f"{prefix}provenance keys must be strings, got {key!r}")
        object.__setattr__(self, "draft", dict(self.draft))
        object.__setattr__(self, "provenance", copy.deepcopy(dict(self.provenance)))

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (schema_version 1) of this profile."""
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model.to_dict(),
            "skip_attention": list(self.skip_attention),
            "skip_mlp": list(self.skip_mlp),
            "draft": dict(self.draft),
            "provenance": copy.deepcopy(self.provenance),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (atomically: a temporary file, then rename).

        The name of a loaded profile is the file's stem, so save to ``<name>.json`` to keep it.
        """
        target = Path(path).expanduser()
        try:
            text = _dumps(self.to_dict()) + "\n"
        except (TypeError, ValueError) as e:
            raise ProfileError(f"{self.label}: cannot be written as JSON: {e}") from None
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def check_model(self, fp: ModelFingerprint) -> None:
        """Raise :class:`ProfileError` unless this profile was made for a model shaped like ``fp``.

        The message names the profile, its path, both models, and every mismatch.
        """
        diffs = self.model.mismatches(fp)
        if diffs:
            raise ProfileError(
                f"{self.label} was made for {self.model.describe()} and does not fit the served "
                f"model {fp.describe()}: {'; '.join(diffs)}. Use a profile searched for this "
                f"model, or give skip_attention / skip_mlp explicitly"
            )


def _dumps(obj: Any, level: int = 0) -> str:
    """JSON with 2-space indentation, but lists of scalars on one line (readable layer lists)."""
    pad, end = "  " * (level + 1), "  " * level
    if isinstance(obj, Mapping):
        if not obj:
            return "{}"
        items = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"object keys must be strings, got {key!r}")
            items.append(f"{pad}{json.dumps(key, ensure_ascii=False)}: {_dumps(value, level + 1)}")
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (Mapping, list, tuple)) for x in obj):
            return "[" + ", ".join(_dumps(x, level + 1) for x in obj) + "]"
        return "[\n" + ",\n".join(pad + _dumps(x, level + 1) for x in obj) + "\n" + end + "]"
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


# ------------------------------------------------------------------------------------ loading


class _DuplicateKeyError(Exception):
    pass


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_json(text: str, label: str) -> Any:
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant
        )
    except json.JSONDecodeError as e:
        raise ProfileError(
            f"{label}: malformed JSON at line {e.lineno}, column {e.colno} (char {e.pos}): {e.msg}"
        ) from None
    except _DuplicateKeyError as e:
        raise ProfileError(f"{label}: malformed JSON: key {e.args[0]!r} appears twice") from None
    except ValueError as e:
        raise ProfileError(f"{label}: malformed JSON: {e}") from None


def _profile_from_data(data: Any, name: str, path: str) -> Profile:
    label = f"profile '{name}' ({path})"
    if not isinstance(data, dict):
        raise ProfileError(f"{label}: the top level must be a JSON object, got {json_type(data)}")
    allowed = _REQUIRED_KEYS + _OPTIONAL_KEYS
    check_known_keys(data, allowed, label, ProfileError)
    check_required_keys(data, _REQUIRED_KEYS, label, ProfileError,
                        f"; a profile needs {', '.join(_REQUIRED_KEYS)} (and optionally "
                        f"{', '.join(_OPTIONAL_KEYS)})")
    version = data["schema_version"]
    if not is_int(version) or version != SCHEMA_VERSION:
        raise ProfileError(
            f"{label}: unsupported schema_version {version!r}; this version of vllm-selfspec "
            f"reads schema_version {SCHEMA_VERSION}"
        )
    model = ModelFingerprint.from_dict(data["model"], where=f"{label}: model")
    return Profile(
        name=name,
        model=model,
        skip_attention=data["skip_attention"],
        skip_mlp=data["skip_mlp"],
        draft=data.get("draft", {}),
        provenance=data.get("provenance", {}),
        path=path,
    )


def _shipped_dir() -> Traversable:
    return resources.files("vllm_selfspec.profiles")


def _shipped_entries() -> list[Traversable]:
    try:
        entries = [e for e in _shipped_dir().iterdir() if e.name.endswith(".json") and e.is_file()]
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError):
        logger.warning("the shipped profiles (vllm_selfspec.profiles) are not installed")
        return []
    return sorted(entries, key=lambda e: e.name)


def shipped_profile_names() -> list[str]:
    """Names (file stems) of the profiles shipped in ``profiles/``, sorted."""
    return [e.name[: -len(".json")] for e in _shipped_entries()]


def _load_entry(entry: Traversable, name: str) -> Profile:
    path = str(entry)
    try:
        text = entry.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile '{name}' ({path}): cannot read the file: {e}") from None
    return _profile_from_data(_parse_json(text, f"profile '{name}' ({path})"), name, path)


def _not_found_hint() -> str:
    names = shipped_profile_names()
    shipped = ", ".join(names) if names else "(none)"
    return f"shipped profiles: {shipped}; or give the path of a profile .json file"


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile:
    """Load and validate a profile from a ``.json`` path or a shipped profile's name.

    A value ending in ``.json`` or containing a path separator is a path; anything else is the
    name of a shipped profile (``profiles/<name>.json``), or failing that an
    existing file. Every problem raises :class:`ProfileError` naming the profile and its path:
    not found (listing the shipped names), unreadable, malformed JSON (with line and column),
    unsupported ``schema_version``, missing or unknown keys, wrong types, layer indices that are
    not ints, negative, ``>= model.num_hidden_layers`` or duplicated.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ProfileError(
            f"profile must be a shipped profile name or a path, got {json_type(name_or_path)} "
            f"{name_or_path!r}"
        )
    raw = os.fspath(name_or_path)
    if not isinstance(raw, str) or not raw.strip():
        raise ProfileError(f"profile must be a non-empty name or path, got {raw!r}")
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    looks_like_path = raw.endswith(".json") or any(s in raw for s in seps)
    if not looks_like_path:
        entry = _shipped_dir() / f"{raw}.json"
        if entry.is_file():
            return _load_entry(entry, raw)
        if not Path(raw).expanduser().is_file():
            names = shipped_profile_names()
            raise ProfileError(
                f"no shipped profile named {raw!r}{did_you_mean(raw, names)}; {_not_found_hint()}"
            )
    path = Path(raw).expanduser()
    if not path.is_file():
        where = "is a directory" if path.is_dir() else "not found"
        raise ProfileError(f"profile file {raw!r} {where}; {_not_found_hint()}")
    name = path.name[: -len(".json")] if path.name.endswith(".json") else path.name
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile '{name}' ({path}): cannot read the file: {e}") from None
    return _profile_from_data(_parse_json(text, f"profile '{name}' ({path})"), name, str(path))


@functools.lru_cache(maxsize=1)
def _shipped() -> tuple[Profile, ...]:
    return tuple(_load_entry(e, e.name[: -len(".json")]) for e in _shipped_entries())


def shipped_profiles() -> list[Profile]:
    """All profiles shipped with the package, sorted by name (loaded once, then cached)."""
    return list(_shipped())


def find_shipped_profile(fp: ModelFingerprint) -> Profile | None:
    """The shipped profile to use for a model with fingerprint ``fp``, or ``None``.

    Candidates are the shipped profiles whose fingerprint matches ``fp`` (architecture, layer
    count, hidden size, vocabulary size), in name order. Different checkpoints can share a shape
    (Llama-2-13b and Llama-2-13b-chat do), and a profile is only valid for the checkpoint it was
    searched on, so:

    1. if ``fp.name`` names the same checkpoint as a candidate's ``model.name`` (compared
       case-insensitively on the last path component, so ``"meta-llama/Llama-2-13b-chat-hf"``,
       ``"/models/Llama-2-13b-chat-hf"`` and ``"llama-2-13b-chat-hf"`` are the same checkpoint),
       the first such candidate is returned;
    2. otherwise, if all candidates were made for one single checkpoint, the first is returned
       (e.g. a fine-tune of Llama-2-70B gets the Llama-2-70B profile);
    3. otherwise the match is ambiguous and ``None`` is returned: we never guess between two
       different checkpoints.

    Among several profiles of one checkpoint the first in name order wins (for the shipped ones:
    ``*.draft-verify``, searched on end-to-end speed, before ``*.swift-*``).
    """
    candidates = [p for p in _shipped() if not p.model.mismatches(fp)]
    if not candidates:
        return None
    wanted = _checkpoint_key(fp.name)
    if wanted is not None:
        for profile in candidates:
            if _checkpoint_key(profile.model.name) == wanted:
                return profile
    checkpoints = {_checkpoint_key(p.model.name) or f"<unnamed {p.name}>" for p in candidates}
    if len(checkpoints) == 1:
        profile = candidates[0]
        if wanted is not None:
            logger.info(
                "Using shipped profile '%s' (made for %s) for %s: same shape, different name",
                profile.name,
                profile.model.name,
                fp.name,
            )
        return profile
    logger.info(
        "No shipped profile chosen for %s: its shape matches profiles of several checkpoints (%s) "
        "and its name matches none of them",
        fp.describe(),
        ", ".join(sorted(checkpoints)),
    )
    return None
