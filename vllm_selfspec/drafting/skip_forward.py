"""A forward pass through the target's own decoder modules with chosen sub-layers skipped.

A decoder layer of the supported families computes ``h = h + Attn(norm1(h)); h = h + MLP(norm2(h))``
with vLLM's fused residual convention (``norm(h, residual)`` adds and normalises). Skipping a
sub-layer is the identity on the residual stream: neither the sub-layer nor its pre-norm runs, and a
skipped attention sub-layer writes no K/V. No weight is copied: the executor holds references to the
target's modules.

The submodules are called directly, so the pass never enters the target's compiled graph or CUDA
graphs (it is eager PyTorch plus vLLM's custom ops).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn

from vllm_selfspec.errors import SelfSpecConfigError

_DECODER_LAYER_CLASSES = (
    "LlamaDecoderLayer",
    "MistralDecoderLayer",
    "Qwen2DecoderLayer",
    "Qwen3DecoderLayer",
)
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def decoder_stack(target: nn.Module) -> nn.Module:
    """The inner ``*Model`` (embeddings, layers, final norm) of a supported ``*ForCausalLM``."""
    inner = getattr(target, "model", None)
    if inner is None and hasattr(target, "get_language_model"):
        inner = getattr(target.get_language_model(), "model", None)
    missing = [a for a in ("embed_input_ids", "layers", "norm") if not hasattr(inner, a)]
    if inner is None or missing:
        raise SelfSpecConfigError(
            f"selfspec cannot drive {type(target).__name__}: no decoder stack with "
            f"embed_input_ids/layers/norm (missing: {missing or ['model']})"
        )
    return inner


class LayerSkipForward:
    """Runs the target's decoder stack with some attention / MLP sub-layers skipped."""

    def __init__(self, target: nn.Module) -> None:
        self.stack = decoder_stack(target)
        self.start_layer = getattr(self.stack, "start_layer", 0)
        self.end_layer = getattr(self.stack, "end_layer", len(self.stack.layers))
        self.num_layers = len(self.stack.layers)
        for index in range(self.start_layer, self.end_layer):
            layer = self.stack.layers[index]
            name = type(layer).__name__
            if name not in _DECODER_LAYER_CLASSES or any(
                not hasattr(layer, part) for part in _LAYER_PARTS
            ):
                raise SelfSpecConfigError(
                    f"selfspec supports the decoder layers {', '.join(_DECODER_LAYER_CLASSES)}; "
                    f"layer {index} is a {name}"
                )
            if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
                raise SelfSpecConfigError(
                    f"layer {index} uses time-conditioned norms, which selfspec does not support"
                )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        skip_attention: Collection[int],
        skip_mlp: Collection[int],
    ) -> torch.Tensor:
        """Final-norm hidden states for ``input_ids`` at ``positions`` (under a forward context).

        Calling the object runs this under ``torch.inference_mode``; a caller that compiles the
        pass (the device drafter) calls ``run`` itself."""
        hidden = self.stack.embed_input_ids(input_ids)
        residual: torch.Tensor | None = None
        layers = self.stack.layers
        for index in range(self.start_layer, self.end_layer):
            layer = layers[index]
            if index not in skip_attention:
                if residual is None:
                    residual, normed = hidden, layer.input_layernorm(hidden)
                else:
                    normed, residual = layer.input_layernorm(hidden, residual)
                hidden = layer.self_attn(positions=positions, hidden_states=normed)
            if index not in skip_mlp:
                if residual is None:
                    residual, normed = hidden, layer.post_attention_layernorm(hidden)
                else:
                    normed, residual = layer.post_attention_layernorm(hidden, residual)
                hidden = layer.mlp(normed)
        if residual is None:
            return self.stack.norm(hidden)
        return self.stack.norm(hidden, residual)[0]

    __call__ = torch.inference_mode()(run)
