"""A layer-skip forward over chosen rows of the model runner's input batch, outside vLLM's loop.

Online layer selection runs its scoring passes with it. Attention reads the target's paged cache
through vLLM's own metadata builders (``build_metadata_for_drafting`` of the runner's attention
groups), and the tokens' K/V goes to their slots, or nowhere (slot -1) with ``write_kv=False``.

The forward is eager: the target's modules called by :class:`~vllm_selfspec.drafting.skip_forward.
LayerSkipForward`, never the target's compiled graph.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from vllm_selfspec.drafting.skip_forward import LayerSkipForward
from vllm_selfspec.plugin.runner_view import RunnerView


def skip_model_logits(
    runner_view: RunnerView,
    vllm_config: Any,
    forward: LayerSkipForward,
    target: torch.nn.Module,
    *,
    rows: np.ndarray,
    row_of_token: np.ndarray,
    positions: np.ndarray,
    tokens: np.ndarray,
    query_start_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    max_query_len: int,
    skip_attention: Collection[int],
    skip_mlp: Collection[int],
    step: int = 0,
    write_kv: bool = True,
) -> torch.Tensor:
    """Logits ``[tokens, vocab]`` of ``target`` with the given sub-layers skipped.

    ``rows`` are the requests' rows in the runner's input batch (read through ``runner_view``);
    ``row_of_token`` / ``positions`` / ``tokens`` hold one entry per query token.
    ``query_start_cpu`` / ``seq_lens_cpu`` are the per-row query offsets and sequence lengths of
    vLLM's attention metadata.
    """
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backend import CommonAttentionMetadata

    device = runner_view.device
    num_tokens = len(tokens)
    rows_t = torch.from_numpy(rows).to(device)
    positions_t = torch.from_numpy(positions).to(device)
    input_ids = torch.from_numpy(tokens).to(device)
    query_start = query_start_cpu.to(device)
    seq_lens = seq_lens_cpu.to(device)
    max_seq_len = int(seq_lens_cpu.max())
    num_reqs = len(runner_view.req_ids)

    attn_metadata: dict[str, Any] = {}
    slot_by_layer: dict[str, torch.Tensor] = {}
    for table, groups in runner_view.attention_groups():
        if write_kv:
            block_size = table.block_size
            block_ids = table.get_numpy_array()[row_of_token, positions // block_size]
            slots = torch.from_numpy(
                block_ids.astype(np.int64) * block_size + positions % block_size
            ).to(device)
        else:
            slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        common = CommonAttentionMetadata(
            query_start_loc=query_start,
            query_start_loc_cpu=query_start_cpu,
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
            num_reqs=len(rows),
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            block_table_tensor=table.get_device_tensor(num_reqs)[rows_t],
            slot_mapping=slots,
            causal=True,
            positions=positions_t,
        )
        for group in groups:
            metadata = group.build_metadata_for_drafting(common, step)
            for layer_name in group.layer_names:
                attn_metadata[layer_name] = metadata
                slot_by_layer[layer_name] = slots
    with torch.inference_mode():
        with set_forward_context(
            attn_metadata, vllm_config, num_tokens=num_tokens, slot_mapping=slot_by_layer
        ):
            hidden = forward.run(input_ids, positions_t, skip_attention, skip_mlp)
        return target.compute_logits(hidden)
