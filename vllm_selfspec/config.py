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

Pure Python (stdlib only): importable without vLLM or torch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from vllm_selfspec.control.controller import DEFAULT_EXIT_THRESHOLD, DEFAULT_TARGET_ACCEPTANCE
from vllm_selfspec.control.source_choice import (
    DEFAULT_DRAFTS,
    DEFAULT_PROMPT_LOOKUP_MAX,
    DEFAULT_PROMPT_LOOKUP_MIN,
    DRAFT_SOURCES,
)
from vllm_selfspec.errors import SelfSpecConfigError, check_known_keys, did_you_mean, is_int
from vllm_selfspec.layers.profiles import (
    ModelFingerprint,
    Profile,
    check_layer_indices,
    find_shipped_profile,
    load_profile,
)

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
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_ADAPTIVE = True
DEFAULT_DRAFT_CONFIDENCE_THRESHOLD = DEFAULT_EXIT_THRESHOLD
DEFAULT_DRAFT_SAMPLING = "probabilistic"
DRAFT_SAMPLING_MODES = ("probabilistic", "argmax")
LAYER_SELECTION_MODES = ("static", "online")
DRAFTERS = ("host", "device")
"""``host``: the ``custom_class`` drafter (CPU lists, eager drafts; every feature). ``device``:
vLLM's device-side speculator path (experimental; see
:mod:`vllm_selfspec.drafting.device_drafter`)."""
DEFAULT_DRAFTER = "host"

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
        "drafter",
        "drafts",
        "prompt_lookup_min",
        "prompt_lookup_max",
    }
)
"""The selfspec-specific keys of a speculative config (``num_speculative_tokens`` is vLLM's)."""


# ------------------------------------------------------------------------------ validators


def _check_num_speculative_tokens(value: object, where: str) -> int:
    if not is_int(value) or value < 1:  # type: ignore[operator]
        raise SelfSpecConfigError(f"{where} must be an integer >= 1, got {value!r}")
    return value  # type: ignore[return-value]


def _check_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise SelfSpecConfigError(f"{where} must be true or false, got {value!r}")
    return value


def _check_fraction(value: object, where: str, *, low_open: bool, high_open: bool) -> float:
    interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        x = float(value)  # type: ignore[arg-type]
        ok = (
            math.isfinite(x)
            and (x > 0 if low_open else x >= 0)
            and (x < 1 if high_open else x <= 1)
        )
    if not ok:
        raise SelfSpecConfigError(f"{where} must be a number in {interval}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _check_draft_confidence_threshold(value: object, where: str) -> float:
    return _check_fraction(value, where, low_open=False, high_open=True)


def _check_target_acceptance(value: object, where: str) -> float:
    return _check_fraction(value, where, low_open=True, high_open=False)


def _check_draft_sampling(value: object, where: str) -> str:
    if value not in DRAFT_SAMPLING_MODES or not isinstance(value, str):
        allowed = " or ".join(repr(m) for m in DRAFT_SAMPLING_MODES)
        raise SelfSpecConfigError(f"{where} must be {allowed}, got {value!r}")
    return value


def _check_drafter(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in DRAFTERS:
        allowed = " or ".join(repr(m) for m in DRAFTERS)
        raise SelfSpecConfigError(f"{where} must be {allowed}, got {value!r}")
    return value


def _check_drafts(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in DRAFT_SOURCES:
        allowed = ", ".join(repr(m) for m in DRAFT_SOURCES)
        raise SelfSpecConfigError(f"{where} must be one of {allowed}, got {value!r}")
    return value


def _check_prompt_lookup(low: object, high: object) -> None:
    for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not is_int(value) or value < 1:  # type: ignore[operator]
            raise SelfSpecConfigError(f"{key} must be an integer >= 1, got {value!r}")
    if low > high:  # type: ignore[operator]
        raise SelfSpecConfigError(
            f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}"
        )


def _prompt_lookup_sizes(given: Mapping[str, Any]) -> tuple[int, int]:
    """The n-gram sizes of prompt lookup: the defaults, or around the one size given (checked by
    :class:`SelfSpecSettings`: a bad value is passed on as it is)."""
    low, high = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    if low is None:
        low = min(DEFAULT_PROMPT_LOOKUP_MIN, high) if is_int(high) else DEFAULT_PROMPT_LOOKUP_MIN
    if high is None:
        high = max(DEFAULT_PROMPT_LOOKUP_MAX, low) if is_int(low) else DEFAULT_PROMPT_LOOKUP_MAX
    return low, high


def _check_layer_selection(value: object, where: str) -> str:
    if not isinstance(value, str) or value not in LAYER_SELECTION_MODES:
        allowed = " or ".join(repr(m) for m in LAYER_SELECTION_MODES)
        raise SelfSpecConfigError(f"{where} must be {allowed}, got {value!r}")
    return value


def _check_online_search(value: object, where: str) -> dict[str, Any] | None:
    from vllm_selfspec.layers.online_search import OnlineSearchConfig

    if value is None:
        return None
    try:
        return OnlineSearchConfig.from_dict(value).to_dict()  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise SelfSpecConfigError(str(exc)) from None


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


@dataclass(frozen=True)
class SelfSpecSettings:
    """Resolved, validated selfspec settings (what the proposer in each worker runs with).

    Construction validates every field and sorts the skip lists; :meth:`to_dict` /
    :meth:`from_dict` round-trip through JSON.
    """

    num_speculative_tokens: int
    skip_attention: tuple[int, ...]
    skip_mlp: tuple[int, ...]
    source: str
    num_hidden_layers: int
    adaptive: bool = DEFAULT_ADAPTIVE
    draft_confidence_threshold: float = DEFAULT_DRAFT_CONFIDENCE_THRESHOLD
    target_acceptance: float = DEFAULT_TARGET_ACCEPTANCE
    draft_sampling: str = DEFAULT_DRAFT_SAMPLING
    layer_selection: str = "static"
    online_search: dict[str, Any] | None = None
    online_profile_out: str | None = None
    drafter: str = DEFAULT_DRAFTER
    drafts: str = DEFAULT_DRAFTS
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not is_int(n) or n < 1:
            raise SelfSpecConfigError(f"num_hidden_layers must be an integer >= 1, got {n!r}")
        for key in ("skip_attention", "skip_mlp"):
            indices = check_layer_indices(getattr(self, key), key=key, num_hidden_layers=n)
            object.__setattr__(self, key, indices)
        if len(self.skip_attention) == n and len(self.skip_mlp) == n:
            raise SelfSpecConfigError(
                f"skip_attention and skip_mlp together skip every sub-layer of all {n} layers, "
                f"so the draft would not run the model at all; keep at least one attention or "
                f"MLP sub-layer (valid layer indices are 0..{n - 1})"
            )
        if not isinstance(self.source, str):
            raise SelfSpecConfigError(f"source must be a string, got {self.source!r}")
        _check_num_speculative_tokens(self.num_speculative_tokens, "num_speculative_tokens")
        _check_bool(self.adaptive, "adaptive")
        object.__setattr__(
            self,
            "draft_confidence_threshold",
            _check_draft_confidence_threshold(
                self.draft_confidence_threshold, "draft_confidence_threshold"
            ),
        )
        object.__setattr__(
            self,
            "target_acceptance",
            _check_target_acceptance(self.target_acceptance, "target_acceptance"),
        )
        _check_draft_sampling(self.draft_sampling, "draft_sampling")
        _check_layer_selection(self.layer_selection, "layer_selection")
        object.__setattr__(
            self, "online_search", _check_online_search(self.online_search, "online_search")
        )
        _check_profile_out(self.online_profile_out, "online_profile_out")
        _check_drafter(self.drafter, "drafter")
        _check_drafts(self.drafts, "drafts")
        _check_prompt_lookup(self.prompt_lookup_min, self.prompt_lookup_max)
        if self.drafts != "layer_skip" and self.drafter != "device":
            raise SelfSpecConfigError(
                f"drafts={self.drafts!r} (prompt-lookup drafts) needs drafter 'device'; the "
                f"'{self.drafter}' drafter drafts with layer skipping only ('layer_skip')"
            )
        if self.layer_selection != "online":
            for key in ("online_search", "online_profile_out"):
                if getattr(self, key) is not None:
                    raise SelfSpecConfigError(
                        f"{key} needs layer_selection='online' (layer_selection is "
                        f"{self.layer_selection!r})"
                    )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (lists instead of tuples); :meth:`from_dict` inverts it."""
        d = asdict(self)
        d["skip_attention"] = list(self.skip_attention)
        d["skip_mlp"] = list(self.skip_mlp)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SelfSpecSettings:
        """Inverse of :meth:`to_dict`. Unknown keys are an error; keys with defaults may be
        missing. Values are validated as on construction."""
        if not isinstance(d, Mapping):
            raise SelfSpecConfigError(f"selfspec settings must be a mapping, got {d!r}")
        names = [f.name for f in fields(cls)]
        check_known_keys(d, names, "selfspec settings")
        required = ("num_speculative_tokens", "skip_attention", "skip_mlp", "source")
        missing = [k for k in required + ("num_hidden_layers",) if k not in d]
        if missing:
            raise SelfSpecConfigError(f"selfspec settings: missing key(s) {', '.join(missing)}")
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

    # Online selection: asked for, or the default when nothing chose the skip set (no explicit
    # lists, no profile given, no shipped profile matched); the chosen set is its starting point.
    drafter = _check_drafter(given.get("drafter", DEFAULT_DRAFTER), "drafter")
    if "layer_selection" in given:
        layer_selection = _check_layer_selection(given["layer_selection"], "layer_selection")
    elif not lists and "profile" not in given and profile is None and n_layers >= 4:
        layer_selection = "online"
    else:
        layer_selection = "static"
    if layer_selection == "online":
        _check_online_fits(given.get("online_search"), n_layers)

    draft_defaults = profile.draft if profile is not None else {}

    def pick(key: str, default: Any) -> tuple[Any, str]:
        if key in given:
            return given[key], key
        if key in draft_defaults:
            assert profile is not None
            return draft_defaults[key], f"{profile.label}: draft.{key}"
        return default, key

    if num_speculative_tokens is not None:
        k = _check_num_speculative_tokens(num_speculative_tokens, "num_speculative_tokens")
    else:
        k = _check_num_speculative_tokens(
            *pick("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
        )
    lookup_min, lookup_max = _prompt_lookup_sizes(given)
    settings = SelfSpecSettings(
        num_speculative_tokens=k,
        skip_attention=skip_attention,
        skip_mlp=skip_mlp,
        source=source,
        num_hidden_layers=n_layers,
        adaptive=(
            _check_bool(*pick("adaptive", DEFAULT_ADAPTIVE))
            if drafter == "host" or "adaptive" in given
            else False  # the device drafter drafts k fixed unless asked (adaptive: experimental)
        ),
        draft_confidence_threshold=_check_draft_confidence_threshold(
            *pick("draft_confidence_threshold", DEFAULT_DRAFT_CONFIDENCE_THRESHOLD)
        ),
        target_acceptance=_check_target_acceptance(
            *pick("target_acceptance", DEFAULT_TARGET_ACCEPTANCE)
        ),
        draft_sampling=_check_draft_sampling(*pick("draft_sampling", DEFAULT_DRAFT_SAMPLING)),
        layer_selection=layer_selection,
        online_search=given.get("online_search"),
        online_profile_out=given.get("online_profile_out"),
        drafter=drafter,
        drafts=_check_drafts(given.get("drafts", DEFAULT_DRAFTS), "drafts"),
        prompt_lookup_min=lookup_min,
        prompt_lookup_max=lookup_max,
    )
    logger.debug("selfspec settings for %s: %s", model.describe(), settings.describe())
    return settings

