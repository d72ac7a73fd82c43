"""Step-cost models and the estimated speedup of a skip set.

A cost model gives ``c_draft(skip)``, the latency of one draft step (a 1-token decode with the
skip set) in units of a full-model 1-token step, and ``c_verify(k)``, the latency of verifying
``k`` drafts (a ``k + 1``-token full forward) in the same unit. The estimated speedup of drafting
``k`` tokens per round with per-token acceptance ``a`` is then::

    E(a, k) / (k * c_draft + c_verify(k)),   E(a, k) = (1 - a**(k+1)) / (1 - a)

(:func:`vllm_selfspec.control.controller.expected_tokens`), maximised over ``k = 1 .. k_max``: the
speedup is what drafting achieves at its best draft length (below 1 when it cannot pay off; the
serving controller then drafts nothing).

Two models:

* :class:`LinearCostModel` (``--cost measured``): step time ``t_fixed + sum of the kept
  sub-layers' times``, calibrated by timing 1-token steps of the model on this machine (full,
  every searchable attention skipped, every searchable MLP skipped) and a ``k_max + 1``-token
  step for the verification slope.
* ``step_overhead`` (``--step-overhead``, both models): the share of a plain decoding step that
  the serving engine spends outside the model forward (scheduling, sampling, output processing).
  Every verification pays it once; draft steps (plain forwards inside the drafter) do not. The
  HF timings above cannot see it; ``--confirm`` reports vLLM's own draft / step times.
* :meth:`LinearCostModel.from_parameters` (``--cost params``): a hardware-independent model for
  memory-bound decoding: time proportional to the weights read (each sub-layer's parameters, the
  LM head and final norm always), plus a fixed per-step ``overhead`` fraction. Use it to search on
  one machine for another, and in tests (deterministic).

Pure PyTorch; no vLLM.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_selfspec.control.controller import best_speedup, expected_tokens
from vllm_selfspec.layers.search.matchness import LayerSkipper, decoder_layers
from vllm_selfspec.layers.skip_set import SkipSet

COST_KINDS = ("measured", "params")


@dataclass(frozen=True)
class LinearCostModel:
    """``time(skip) = fixed + sum(attention[i] for kept i) + sum(mlp[i] for kept i)``.

    Times are in any unit (seconds, or parameters for the parameter model); ``verify_slope`` is
    the extra cost of each verified draft token as a fraction of a full 1-token step.
    """

    kind: str
    fixed: float
    attention: tuple[float, ...]
    mlp: tuple[float, ...]
    verify_slope: float = 0.0
    details: Mapping[str, Any] | None = None
    step_overhead: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.step_overhead < 1.0:
            raise ValueError(f"step_overhead must be in [0, 1), got {self.step_overhead!r}")

    @property
    def num_layers(self) -> int:
        return len(self.attention)

    @property
    def full(self) -> float:
        return self.fixed + sum(self.attention) + sum(self.mlp)

    def c_draft(self, skip: SkipSet) -> float:
        """A draft step's cost in plain decoding steps: the kept share of the model forward; a
        draft step pays none of the engine's per-step overhead."""
        saved = sum(self.attention[i] for i in skip.attention) + sum(self.mlp[i] for i in skip.mlp)
        return (1.0 - self.step_overhead) * max(self.full - saved, 0.0) / self.full

    def c_verify(self, k: int) -> float:
        """Verifying ``k`` drafts: the engine's step overhead plus a ``k + 1``-token forward."""
        o = self.step_overhead
        return o + (1.0 - o) * (1.0 + self.verify_slope * k)

    def with_step_overhead(self, step_overhead: float) -> LinearCostModel:
        return dataclasses.replace(self, step_overhead=step_overhead)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attention"] = list(self.attention)
        d["mlp"] = list(self.mlp)
        d["details"] = dict(self.details or {})
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinearCostModel:
        return cls(
            kind=str(d["kind"]),
            fixed=float(d["fixed"]),
            attention=tuple(float(x) for x in d["attention"]),
            mlp=tuple(float(x) for x in d["mlp"]),
            verify_slope=float(d.get("verify_slope", 0.0)),
            details=dict(d.get("details") or {}),
            step_overhead=float(d.get("step_overhead", 0.0)),
        )

    def summary(self) -> str:
        n = self.num_layers
        att = sum(self.attention) / self.full / n
        mlp = sum(self.mlp) / self.full / n
        text = (
            f"{self.kind} cost model: per layer attention {att:.2%} and MLP {mlp:.2%} of a model "
            f"forward, fixed {self.fixed / self.full:.1%}, verify +{self.verify_slope:.1%} per "
            f"draft"
        )
        if self.step_overhead:
            text += f", engine overhead {self.step_overhead:.1%} of a step (verify steps only)"
        return text

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_parameters(
        cls, model: torch.nn.Module, overhead: float = 0.1, verify_slope: float = 0.0
    ) -> LinearCostModel:
        """Weights read per step: each sub-layer's parameters (with its pre-norm), plus the LM
        head and final norm always; ``overhead`` is the fixed share of a full step (launches,
        sampling, scheduling) that skipping cannot remove."""
        if not 0.0 <= overhead < 1.0:
            raise ValueError(f"overhead must be in [0, 1), got {overhead!r}")
        layers = decoder_layers(model)

        def count(*modules: torch.nn.Module | None) -> float:
            return float(sum(p.numel() for m in modules if m is not None for p in m.parameters()))

        attention = tuple(
            count(layer.self_attn, getattr(layer, "input_layernorm", None)) for layer in layers
        )
        mlp = tuple(
            count(layer.mlp, getattr(layer, "post_attention_layernorm", None)) for layer in layers
        )
        head = count(model.get_output_embeddings(), getattr(model.model, "norm", None))
        weights = head + sum(attention) + sum(mlp)
        # overhead share of the full step: fixed = head + overhead * full
        fixed = head + overhead * weights / (1.0 - overhead)
        return cls(
            kind="params",
            fixed=fixed,
            attention=attention,
            mlp=mlp,
            verify_slope=verify_slope,
            details={"overhead": overhead, "head_params": head, "layer_params": weights - head},
        )

    @classmethod
    def measure(
        cls,
        model: torch.nn.Module,
        searchable: Sequence[int],
        k_max: int = 8,
        context_tokens: int = 128,
        repeats: int = 15,
        warmup: int = 3,
    ) -> LinearCostModel:
        """Time 1-token steps of the HF model here: full, all searchable attention skipped, all
        searchable MLP skipped, and a ``k_max + 1``-token full step. Configurations are
        interleaved and the median of ``repeats`` is used; layers are assumed to cost the same
        (they have the same shapes)."""
        if not searchable:
            raise ValueError("no searchable layers to calibrate the cost model with")
        skipper = LayerSkipper(model)
        n = skipper.num_layers
        device = next(model.parameters()).device
        vocab = int(model.config.vocab_size)
        gen = torch.Generator().manual_seed(0)
        context = torch.randint(0, vocab, (1, context_tokens), generator=gen).to(device)
        one = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
        many = torch.randint(0, vocab, (1, k_max + 1), generator=gen).to(device)
        configs = {
            "full": (SkipSet(), one),
            "no_attention": (SkipSet.of(searchable, ()), one),
            "no_mlp": (SkipSet.of((), searchable), one),
            "verify": (SkipSet(), many),
        }
        from transformers import DynamicCache

        from vllm_selfspec.layers.search.matchness import _attention_mode

        times: dict[str, list[float]] = {name: [] for name in configs}
        with torch.inference_mode(), _attention_mode("plain"):
            cache = DynamicCache(config=model.config)
            with skipper.skipping(SkipSet()):
                model(input_ids=context, past_key_values=cache, use_cache=True)

            def step(skip: SkipSet, ids: torch.Tensor) -> float:
                # a copy of the prefilled cache, so every step sees the same context
                local = DynamicCache(config=model.config)
                for layer_idx, layer in enumerate(cache.layers):
                    local.update(layer.keys.clone(), layer.values.clone(), layer_idx)
                positions = torch.arange(context_tokens, context_tokens + ids.shape[1],
                                         device=device).unsqueeze(0)
                _sync(device)
                start = time.perf_counter()
                with skipper.skipping(skip):
                    model(input_ids=ids, position_ids=positions, past_key_values=local,
                          use_cache=True, logits_to_keep=1)
                _sync(device)
                return time.perf_counter() - start

            for i in range(warmup + repeats):
                for name, (skip, ids) in configs.items():
                    t = step(skip, ids)
                    if i >= warmup:
                        times[name].append(t)
        med = {name: statistics.median(v) for name, v in times.items()}
        s = len(searchable)
        floor = med["full"] * 1e-3
        t_attn = max((med["full"] - med["no_attention"]) / s, floor)
        t_mlp = max((med["full"] - med["no_mlp"]) / s, floor)
        fixed = max(med["full"] - n * (t_attn + t_mlp), 0.0)
        slope = max((med["verify"] / med["full"] - 1.0) / k_max, 0.0)
        return cls(
            kind="measured",
            fixed=fixed,
            attention=(t_attn,) * n,
            mlp=(t_mlp,) * n,
            verify_slope=slope,
            details={
                "step_s": med["full"],
                "no_attention_step_s": med["no_attention"],
                "no_mlp_step_s": med["no_mlp"],
                "verify_step_s": med["verify"],
                "context_tokens": context_tokens,
                "repeats": repeats,
                "device": str(device),
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(),
            },
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class SpeedupEstimate:
    speedup: float
    k: int
    c_draft: float
    expected_tokens: float


def estimate_speedup(
    acceptance: float, c_draft: float, cost: LinearCostModel, k_max: int
) -> SpeedupEstimate:
    """The best ``k`` in ``1..k_max`` for ``E(a, k) / (k * c_draft + c_verify(k))``.

    Ties go to the smaller ``k``; at least one draft (below 1 when drafting cannot pay off)."""
    if k_max < 1:
        return SpeedupEstimate(0.0, 1, c_draft, expected_tokens(acceptance, 1))
    speedup, k = best_speedup(
        acceptance, k_max, draft_cost=c_draft, verify_cost=cost.c_verify, allow_zero=False
    )
    return SpeedupEstimate(speedup, k, c_draft, expected_tokens(acceptance, k))
