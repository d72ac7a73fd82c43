"""Profiles out of a search, and the ``show`` / ``validate`` helpers of ``selfspec-profile``."""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_selfspec.layers.profiles import ModelFingerprint, Profile, load_profile
from vllm_selfspec.layers.search.optimize import SearchResult


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def make_profile(
    result: SearchResult,
    out: str | os.PathLike[str],
    model_name: str | None = None,
    confirmed: Mapping[str, Any] | None = None,
) -> Profile:
    """The profile of ``result.best`` (named after ``out``'s stem) with its provenance.

    ``confirmed`` (from :func:`vllm_selfspec.layers.search.confirm.confirm_candidates`) adds the
    measured acceptance and speed of the end-to-end check.
    """
    cfg = result.config
    best = result.best
    name = Path(out).name.removesuffix(".json")
    fp = ModelFingerprint.from_model_dir(cfg.model_dir)
    fp = ModelFingerprint(fp.architecture, fp.num_hidden_layers, fp.hidden_size, fp.vocab_size,
                          name=model_name or Path(cfg.model_dir).name)
    cost = result.cost_model
    measured = confirmed or {}
    provenance: dict[str, Any] = {
        "method": (
            f"selfspec-profile search: Optuna {cfg.sampler.upper()} over the attention/MLP "
            f"skips of layers {cfg.protect_first}..{fp.num_hidden_layers - 1 - cfg.protect_last}; "
            f"objective: estimated speedup from teacher-forced matchness ({cfg.context} context) "
            f"and a {cost.kind} step-cost model"
        ),
        "source": f"{result.prompt_source}, {cfg.max_new_tokens} greedy tokens each "
                  f"({result.num_positions} scored positions)",
        "acceptance": _round(measured.get("per_token_acceptance", best.acceptance)),
        "date": _dt.date.today().isoformat(),
        "estimated_acceptance": _round(best.acceptance),
        "estimated_speedup": _round(best.speedup),
        "estimated_draft_cost": _round(best.c_draft),
        "measured_acceptance": _round(measured.get("per_token_acceptance")),
        "measured_acceptance_rate": _round(measured.get("acceptance_rate")),
        "measured_speedup": _round(measured.get("speedup")),
        "cost_model": {
            "kind": cost.kind,
            "attention_per_layer": _round(sum(cost.attention) / cost.full / cost.num_layers),
            "mlp_per_layer": _round(sum(cost.mlp) / cost.full / cost.num_layers),
            "fixed": _round(cost.fixed / cost.full),
            "verify_slope": _round(cost.verify_slope),
            "step_overhead": _round(cost.step_overhead),
            **({"step_s": _round(cost.details["step_s"], 5),
                "device": cost.details.get("device"), "dtype": cost.details.get("dtype")}
               if cost.details and "step_s" in cost.details else {}),
        },
        "budget": cfg.budget,
        "trials": len(result.trials),
        "search_wall_s": result.info.get("total_wall_s", round(result.wall_s, 1)),
        "search_sessions": len(result.info.get("session_wall_s", [1])),
        "seed": cfg.seed,
        "k_max": cfg.k_max,
    }
    if measured:
        provenance["confirm"] = {k: _round(v) if isinstance(v, float) else v
                                 for k, v in measured.items()}
    return Profile(
        name=name,
        model=fp,
        skip_attention=best.skip.attention,
        skip_mlp=best.skip.mlp,
        draft={"num_speculative_tokens": int(best.k)},
        provenance=provenance,
    )


def show_profile(profile: Profile) -> str:
    """A profile as text: fingerprint, a per-layer table of skipped sub-layers, provenance."""
    m = profile.model
    n = m.num_hidden_layers
    lines = [
        f"{profile.label}",
        f"model: {m.describe()}",
        f"skips: {len(profile.skip_attention)}/{n} attention, {len(profile.skip_mlp)}/{n} MLP"
        + (f"; draft defaults: {profile.draft}" if profile.draft else ""),
        "",
        " layer | attention | MLP",
        "-------+-----------+------",
    ]
    att, mlp = set(profile.skip_attention), set(profile.skip_mlp)
    for layer in range(n):
        a = "skip" if layer in att else "."
        b = "skip" if layer in mlp else "."
        lines.append(f" {layer:5d} | {a:^9} | {b:^4}")
    if profile.provenance:
        lines += ["", "provenance:"]
        for key, value in profile.provenance.items():
            if isinstance(value, Mapping):
                value = ", ".join(f"{k}={v}" for k, v in value.items())
            lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def validate_profile(path: str, model_dir: str) -> tuple[Profile, list[str]]:
    """Load ``path``, check it against the model in ``model_dir`` and resolve it as the plugin
    would. Returns the profile and human-readable findings; raises ``SelfSpecConfigError`` (or
    ``ProfileError``) with the reason when the plugin would refuse it."""
    from vllm_selfspec.config import resolve_settings

    profile = load_profile(path)
    fp = ModelFingerprint.from_model_dir(model_dir)
    profile.check_model(fp)
    settings = resolve_settings({"profile": profile.path or path}, fp)
    notes = [f"fits {fp.describe()}", f"resolves to: {settings.describe()}"]
    pm, mm = (profile.model.name or "").rstrip("/"), str(model_dir).rstrip("/")
    if pm and Path(pm).name.lower() != Path(mm).name.lower():
        notes.append(
            f"note: searched on {profile.model.name!r}; same shape, but acceptance is only "
            f"known for that checkpoint"
        )
    return profile, notes
