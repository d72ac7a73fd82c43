"""Worker extension for the device-drafter tests: what the worker holds (tests only)."""

from __future__ import annotations

from typing import Any

from tests.pinned_costs import PinnedCostsExtension

DRAFTER_PROBE_EXTENSION = "tests.drafter_probe.DrafterProbe"


class DrafterProbe(PinnedCostsExtension):
    """Also pins step costs (:func:`tests.pinned_costs.pin_step_costs`)."""

    def memory_probe(self) -> dict[str, Any]:
        """Parameter storage and KV cache of this worker, and what its drafter holds."""
        runner = self.model_runner
        params = {p.data_ptr(): p.numel() * p.element_size() for p in runner.model.parameters()}
        kv = [t for t in _tensors(getattr(runner, "kv_caches", []))]
        drafter = getattr(runner, "drafter", None)
        draft_model = getattr(drafter, "model", None)
        out: dict[str, Any] = {
            "param_bytes": sum(params.values()),
            "kv_tensors": len(kv),
            "kv_bytes": sum(t.numel() * t.element_size() for t in kv),
            "drafter": type(drafter).__name__,
        }
        if draft_model is not None:
            own = list(draft_model.parameters())
            out["drafter_own_params"] = len(own)
            out["drafter_layers"] = sorted(getattr(drafter, "_draft_attn_layer_names", ()))
            out["target_layers"] = sorted(
                runner.vllm_config.compilation_config.static_forward_context
            )
            out["compiled"] = not getattr(draft_model, "do_not_compile", True) and bool(
                getattr(draft_model, "compiled", False)
            )
        return out


def _tensors(obj: Any) -> list[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []
