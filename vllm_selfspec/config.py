"""Selfspec settings: validate the user's selfspec keys and choose the skip set for a model.

:func:`resolve_settings` turns the selfspec-specific keys of a speculative config (see
:data:`SELFSPEC_KEYS`) plus the served model's
:class:`~vllm_selfspec.layers.profiles.ModelFingerprint`
into a :class:`SelfSpecSettings`, raising :class:`~vllm_selfspec.errors.SelfSpecConfigError` with
a message that names the key, the value and what is allowed. The skip set comes from, in order:

1. explicit ``skip_attention`` / ``skip_mlp`` lists;
2. a ``profile`` (a shipped profile's name or the path of a profile ``.json`` file);
3. the shipped profile matching the model's fingerprint (:func:`find_shipped_profile`);
4. :func:`default_skip_set`, a conservative choice from the depth alone.

``layer_selection="online"`` makes that set the starting point of the on-the-fly search (see
:mod:`vllm_selfspec.layers.online_search`); it is the default in case 4 (nothing chose the set).

Pure Python plus pydantic (a vLLM dependency): importable without vLLM or torch.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, StrictStr, field_validator, model_validator

from vllm_selfspec.control.controller import DEFAULT_EXIT_THRESHOLD, DEFAULT_TARGET_ACCEPTANCE
from vllm_selfspec.control.source_choice import (
    DEFAULT_DRAFTS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DRAFT_SOURCES,
)
from vllm_selfspec.errors import (
    SelfSpecConfigError,
    check_known_keys,
    check_required_keys,
    did_you_mean,
    is_int,
)
from vllm_selfspec.layers.profiles import (
    DEFAULT_ADAPTIVE,
    DEFAULT_DRAFT_SAMPLING,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DRAFT_SAMPLING_MODES,
    DraftKnobs,
    ModelFingerprint,
    Profile,
    check_layer_indices,
    find_shipped_profile,
    load_profile,
)
from vllm_selfspec.schema import PositiveInt

__all__ = [
    "DEFAULT_ADAPTIVE",
    "DEFAULT_DRAFT_CONFIDENCE_THRESHOLD",
    "DEFAULT_DRAFT_SAMPLING",
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "DEFAULT_TARGET_ACCEPTANCE",
    "DRAFT_SAMPLING_MODES",
    "SELFSPEC_KEYS",
    "SUPPORTED_ARCHITECTURES",
    "SelfSpecConfigError",
    "SelfSpecSettings",
    "default_skip_set",
    "resolve_settings",
]

logger = logging.getLogger("vllm.selfspec.config")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
DEFAULT_DRAFT_CONFIDENCE_THRESHOLD = DEFAULT_EXIT_THRESHOLD
LAYER_SELECTION_MODES = ("static", "online")
REMOVED_DRAFTER_KEY = "drafter"
"""Removed: selfspec has one drafter (:mod:`vllm_selfspec.drafting.device_drafter`). ``"device"``,
which names it, is accepted with a warning; any other value is an error that says so."""

SELFSPEC_KEYS = frozenset(
    {
        "skip_attention",
        "skip_mlp",
        "profile",
        "adaptive",
        "draft_confidence_threshold",
        "target_acceptance",
        "draft_sampling",
        "layer_selection",
        "online_search",
        "online_profile_out",
        REMOVED_DRAFTER_KEY,
        "drafts",
        "prompt_lookup_min",
        "prompt_lookup_max",
    }
)
"""The selfspec-specific keys of a speculative config (``num_speculative_tokens`` is vLLM's)."""


# ------------------------------------------------------------------------------ validators


def _check(key: str, value: object, where: str | None = None) -> Any:
    """``value`` validated as the settings' field ``key`` (``where``: its name in messages)."""
    return SelfSpecSettings.check_value(key, value, where)


def _prompt_lookup_sizes(given: Mapping[str, Any]) -> tuple[int, int]:
    """The n-gram sizes of prompt lookup: the defaults, or around the one size given (checked by
    :class:`SelfSpecSettings`: a bad value is passed on as it is)."""
    low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    if low is None:
        low = min(DEFAULT_PROMPT_LOOKUP_MIN, high) if is_int(high) else DEFAULT_PROMPT_LOOKUP_MIN
    if high is None:
        high = max(DEFAULT_PROMPT_LOOKUP_MAX, low) if is_int(low) else DEFAULT_PROMPT_LOOKUP_MAX
    return low, high


def _check_profile_out(value: object, where: str) -> str | None:
    import os

    if value is None:
        return None
    if not isinstance(value, str) or not value.strip().endswith(".json"):
        raise SelfSpecConfigError(
            f"{where} must be the path of a .json file to write the profile to, got {value!r}"
        )
    parent = os.path.dirname(os.path.abspath(os.path.expanduser(value))) or "."
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise SelfSpecConfigError(
            f"{where}: cannot write {value!r}: folder {parent!r} does not exist or is not "
            f"writable"
        )
    return value


def _check_online_fits(online: Mapping[str, Any] | None, n_layers: int) -> None:
    from vllm_selfspec.layers.online_search import OnlineSearchConfig

    try:
        cfg = OnlineSearchConfig.from_dict(online)
    except (TypeError, ValueError) as exc:
        raise SelfSpecConfigError(str(exc)) from None
    free = n_layers - cfg.protect_first - cfg.protect_last
    if free < 1:
        raise SelfSpecConfigError(
            f"online layer selection: a {n_layers}-layer model leaves no layer to skip with "
            f"online_search.protect_first={cfg.protect_first} and protect_last="
            f"{cfg.protect_last}"
        )
    if cfg.budget is not None and cfg.budget > 2 * free:
        raise SelfSpecConfigError(
            f"online_search.budget={cfg.budget} exceeds the {2 * free} sub-layers the search "
            f"may skip in a {n_layers}-layer model"
        )


# ------------------------------------------------------------------------------- settings


_REQUIRED = ("num_speculative_tokens", "skip_attention", "skip_mlp", "source", "num_hidden_layers")


_POSITIONAL = (
    "num_speculative_tokens", "skip_attention", "skip_mlp", "source", "num_hidden_layers"
)


class SelfSpecSettings(DraftKnobs):
    """Resolved, validated selfspec settings (what the proposer in each worker runs with).

    Each field is declared once, with its type, range and default (see
    :mod:`vllm_selfspec.schema`): the draft knobs in
    :class:`~vllm_selfspec.layers.profiles.DraftKnobs` (a profile's ``draft`` defaults are
    checked against the same fields), the rest here. Construction validates every field and sorts
    the skip lists; :meth:`to_dict` / :meth:`from_dict` round-trip through JSON. The first five
    fields may be given by position (``SelfSpecSettings(4, (5, 2), (), "test", 8)``).
    """

    POSITIONAL = _POSITIONAL

    skip_attention: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    source: Annotated[StrictStr, Field(description="a string")]
    num_hidden_layers: PositiveInt
    layer_selection: Literal[LAYER_SELECTION_MODES] = "static"
    online_search: dict[str, Any] | None = None
    online_profile_out: str | None = None
    drafts: Literal[DRAFT_SOURCES] = DEFAULT_DRAFTS
    prompt_lookup_min: PositiveInt = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: PositiveInt = DEFAULT_PROMPT_LOOKUP_MAX

    @model_validator(mode="before")
    @classmethod
    def _layers(cls, data: Any) -> Any:
        """The skip lists need the depth: checked (and sorted) first, with their own messages."""
        if not isinstance(data, Mapping) or "num_hidden_layers" not in data:
            return data  # pydantic reports the missing field
        n = cls.check_value("num_hidden_layers", data["num_hidden_layers"])
        data = dict(data)
        for key in ("skip_attention", "skip_mlp"):
            if key in data:
                data[key] = check_layer_indices(data[key], key=key, num_hidden_layers=n)
        if len(data.get("skip_attention", ())) == n and len(data.get("skip_mlp", ())) == n:
            raise SelfSpecConfigError(
                f"skip_attention and skip_mlp together skip every sub-layer of all {n} layers, "
                f"so the draft would not run the model at all; keep at least one attention or "
                f"MLP sub-layer (valid layer indices are 0..{n - 1})"
            )
        return data

    @field_validator("online_search", mode="before")
    @classmethod
    def _online_search(cls, value: Any) -> Any:
        from vllm_selfspec.layers.online_search import OnlineSearchConfig

        if value is None:
            return None
        try:
            return OnlineSearchConfig.from_dict(value).to_dict()
        except ValueError as exc:
            raise SelfSpecConfigError(str(exc)) from None

    @field_validator("online_profile_out", mode="before")
    @classmethod
    def _profile_out(cls, value: Any) -> Any:
        return _check_profile_out(value, "online_profile_out")

    @model_validator(mode="after")
    def _combinations(self) -> SelfSpecSettings:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SelfSpecConfigError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.layer_selection != "online":
            for key in ("online_search", "online_profile_out"):
                if getattr(self, key) is not None:
                    raise SelfSpecConfigError(
                        f"{key} needs layer_selection='online' (layer_selection is "
                        f"{self.layer_selection!r})"
                    )
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (lists instead of tuples); :meth:`from_dict` inverts it."""
        d = self.model_dump()
        d["skip_attention"] = list(self.skip_attention)
        d["skip_mlp"] = list(self.skip_mlp)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SelfSpecSettings:
        """Inverse of :meth:`to_dict`. Unknown keys are an error; keys with defaults may be
        missing. Values are validated as on construction."""
        if not isinstance(d, Mapping):
            raise SelfSpecConfigError(f"selfspec settings must be a mapping, got {d!r}")
        check_known_keys(d, list(cls.model_fields), "selfspec settings")
        check_required_keys(d, _REQUIRED, "selfspec settings")
        return cls(**dict(d))

    def describe(self) -> str:
        """One line for logs."""
        n = self.num_hidden_layers
        return (
            f"skipping {len(self.skip_attention)}/{n} attention and {len(self.skip_mlp)}/{n} MLP "
            f"sub-layers ({self.source}); num_speculative_tokens={self.num_speculative_tokens}, "
            f"adaptive={self.adaptive}, draft_confidence_threshold="
            f"{self.draft_confidence_threshold}, target_acceptance={self.target_acceptance}, "
            f"draft_sampling={self.draft_sampling}, layer_selection={self.layer_selection}"
            + (
                f", drafts={self.drafts} (prompt lookup n-grams {self.prompt_lookup_min}.."
                f"{self.prompt_lookup_max})"
                if self.drafts != "layer_skip"
                else ""
            )
        )


# ------------------------------------------------------------------------------- skip sets


def default_skip_set(num_hidden_layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A conservative skip set chosen from the depth alone: ``(skip_attention, skip_mlp)``.

    Skips the attention sub-layer of ``num_hidden_layers // 4`` layers, spread evenly over the
    upper half of the network (layers ``max(2, L // 2) .. L - 2``); never layers 0 and 1, never
    the last layer, and no MLP sub-layer (published profiles skip attention far more than MLP and
    cluster in the second half). Models with fewer than 4 layers get ``((), ())``: nothing is
    safe to skip. Deterministic.

    This is a fallback so that any supported model works; a profile searched for the model (see
    the design notes, section 4) drafts better.
    """
    if not is_int(num_hidden_layers) or num_hidden_layers < 1:
        raise SelfSpecConfigError(
            f"num_hidden_layers must be an integer >= 1, got {num_hidden_layers!r}"
        )
    n_layers = num_hidden_layers
    if n_layers < 4:
        return (), ()
    count = n_layers // 4
    first, last = max(2, n_layers // 2), n_layers - 2
    span = last - first + 1  # >= count for every n_layers >= 4
    # The midpoints of `count` equal slices of [first, last]; distinct because span >= count.
    attention = tuple(first + int((i + 0.5) * span / count) for i in range(count))
    return attention, ()


def _explicit_lists(spec: Mapping[str, Any], n_layers: int) -> tuple[tuple[int, ...], ...]:
    return tuple(
        check_layer_indices(spec.get(key, []), key=key, num_hidden_layers=n_layers)
        for key in ("skip_attention", "skip_mlp")
    )


def _check_removed_drafter_key(given: Mapping[str, Any]) -> None:
    """The ``drafter`` key of earlier releases: ``"device"`` (the one drafter left) is accepted
    with a warning, anything else is an error that says what to use instead."""
    if REMOVED_DRAFTER_KEY not in given:
        return
    value = given[REMOVED_DRAFTER_KEY]
    if value == "device":
        logger.warning(
            "selfspec: the 'drafter' key is deprecated and ignored: the device drafter is "
            "selfspec's only drafter; remove the key"
        )
        return
    raise SelfSpecConfigError(
        f"drafter={value!r}: the 'drafter' key was removed, and with it the host drafter "
        f"('host'). selfspec has one drafter, which drafts on vLLM's own speculator machinery on "
        f"every platform; remove the key (for layer-skip drafts only, as the host drafter made, "
        f"set \"drafts\": \"layer_skip\")"
    )


def _unknown_key_error(key: object) -> SelfSpecConfigError:
    valid = sorted(SELFSPEC_KEYS)
    return SelfSpecConfigError(
        f"unknown selfspec key {key!r}{did_you_mean(key, valid)}; "
        f"valid selfspec keys: {', '.join(valid)} "
        f"(plus vLLM's speculative-config keys such as num_speculative_tokens)"
    )


def resolve_settings(
    spec: Mapping[str, Any] | None,
    model: ModelFingerprint,
    num_speculative_tokens: int | None = None,
) -> SelfSpecSettings:
    """Validate the user's selfspec keys and resolve them for ``model``.

    ``spec`` holds only the selfspec keys (:data:`SELFSPEC_KEYS`) of the user's speculative
    config; a key whose value is ``None`` counts as not given. ``num_speculative_tokens`` is
    vLLM's key: when given it wins over a profile's ``draft`` default, which wins over
    :data:`DEFAULT_NUM_SPECULATIVE_TOKENS`. The other knobs likewise come from ``spec``, else the
    profile's ``draft`` defaults, else the module defaults.

    Raises :class:`SelfSpecConfigError` (or its subclass ``ProfileError``) for: an unknown key;
    an unsupported architecture; ``profile`` combined with skip lists; skip lists that are not
    lists of ints in ``0..L-1`` without duplicates; skipping every sub-layer; a profile that
    cannot be loaded or does not fit ``model``; out-of-range knobs.
    """
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise SelfSpecConfigError(
            f"selfspec settings must be a mapping of selfspec keys, got {type(spec).__name__}"
        )
    for key in spec:
        if key not in SELFSPEC_KEYS:
            raise _unknown_key_error(key)
    given = {k: v for k, v in spec.items() if v is not None}
    if not isinstance(model, ModelFingerprint):
        raise SelfSpecConfigError(f"model must be a ModelFingerprint, got {model!r}")
    if model.architecture not in SUPPORTED_ARCHITECTURES:
        raise SelfSpecConfigError(
            f"architecture {model.architecture!r} is not supported by selfspec; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    n_layers = model.num_hidden_layers

    lists = [k for k in ("skip_attention", "skip_mlp") if k in given]
    profile: Profile | None = None
    if "profile" in given and lists:
        raise SelfSpecConfigError(
            f"'profile' ({given['profile']!r}) cannot be combined with {' / '.join(lists)}: "
            f"give either a profile or explicit skip lists, not both"
        )
    if lists:
        skip_attention, skip_mlp = _explicit_lists(given, n_layers)
        source = "explicit skip lists"
    elif "profile" in given:
        ref = given["profile"]
        if not isinstance(ref, str) or not ref.strip():
            raise SelfSpecConfigError(
                f"profile must be the name of a shipped profile or the path of a profile .json "
                f"file, got {ref!r}"
            )
        profile = load_profile(ref)
        profile.check_model(model)
        skip_attention, skip_mlp = profile.skip_attention, profile.skip_mlp
        source = f"profile '{profile.name}' ({profile.path})"
    else:
        profile = find_shipped_profile(model)
        if profile is not None:
            skip_attention, skip_mlp = profile.skip_attention, profile.skip_mlp
            source = f"shipped profile '{profile.name}' matched the model fingerprint"
        else:
            skip_attention, skip_mlp = default_skip_set(n_layers)
            source = (
                f"default for a {n_layers}-layer model "
                f"(no profile matched; a searched profile would be faster)"
            )

    _check_removed_drafter_key(given)
    # Online selection: asked for, or the default when nothing chose the skip set (no explicit
    # lists, no profile given, no shipped profile matched); the chosen set is its starting point.
    if "layer_selection" in given:
        layer_selection = _check("layer_selection", given["layer_selection"])
    elif not lists and "profile" not in given and profile is None and n_layers >= 4:
        layer_selection = "online"
    else:
        layer_selection = "static"
    if layer_selection == "online":
        _check_online_fits(given.get("online_search"), n_layers)

    draft_defaults = profile.draft if profile is not None else {}

    def pick(key: str, default: Any = None) -> Any:
        """A draft knob: the user's value, else the profile's ``draft`` default (checked here,
        so that a message names the profile), else the default."""
        if key in given:
            return given[key]
        if key in draft_defaults:
            assert profile is not None
            return _check(key, draft_defaults[key], f"{profile.label}: draft.{key}")
        return SelfSpecSettings.model_fields[key].default if default is None else default

    if num_speculative_tokens is not None:
        k = num_speculative_tokens
    else:
        k = pick("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    lookup_min, lookup_max = _prompt_lookup_sizes(given)
    settings = SelfSpecSettings(
        num_speculative_tokens=k,
        skip_attention=skip_attention,
        skip_mlp=skip_mlp,
        source=source,
        num_hidden_layers=n_layers,
        adaptive=pick("adaptive"),
        draft_confidence_threshold=pick("draft_confidence_threshold"),
        target_acceptance=pick("target_acceptance"),
        draft_sampling=pick("draft_sampling"),
        layer_selection=layer_selection,
        online_search=given.get("online_search"),
        online_profile_out=given.get("online_profile_out"),
        drafts=given.get("drafts", DEFAULT_DRAFTS),
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
    )
    logger.debug("selfspec settings for %s: %s", model.describe(), settings.describe())
    return settings

