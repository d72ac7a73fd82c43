"""The one reader of vLLM's model-runner internals.

The drafter, the batched skip forward and online layer selection see the running batch through
:class:`RunnerView` alone: which requests hold which rows, their token tables, the draft tokens
scheduled for verification, the paged-cache block tables and attention groups, each request's
``extra_args``, and the rows whose sample this step is discarded. A vLLM that renames one of these
fields is fixed here. The one field it writes is the draft distribution that vLLM's rejection
sampler reads (reset on a step in which the drafter runs no pass).

The wrappers around runner *methods* (:mod:`vllm_selfspec.plugin.patches.model_runner`) hold the
raw runner: they replace its attributes, which is a patch's job, not a reader's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch


class RunnerView:
    """A read view of one ``GPUModelRunner`` (vLLM 0.32's V1 runner; the CPU runner is one).

    ``runner`` may be None (a drafter built outside a runner, in unit tests): the view then holds
    no requests. ``runner`` stays public for tests that inspect the raw runner."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    # --- the batch ------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def _batch(self) -> Any:
        return self.runner.input_batch

    @property
    def req_ids(self) -> list[str]:
        """Request ids by row of the input batch (empty without a runner)."""
        return list(self._batch.req_ids) if self.runner is not None else []

    @property
    def token_ids_cpu(self) -> np.ndarray:
        """Token table ``[rows, max_model_len]``; row ``r`` holds its first
        ``num_tokens_no_spec[r]`` tokens."""
        return self._batch.token_ids_cpu

    @property
    def num_tokens_no_spec(self) -> np.ndarray:
        return self._batch.num_tokens_no_spec

    @property
    def num_prompt_tokens(self) -> np.ndarray:
        return self._batch.num_prompt_tokens

    @property
    def temperature_cpu(self) -> np.ndarray:
        return self._batch.temperature_cpu

    def top_k_top_p(self, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The top-k and top-p of ``rows``' requests (vLLM's sampler truncates their
        temperature-scaled distribution to these); each None where no request of the batch sets
        it, as vLLM's sampling metadata has it. A row without top-k holds the vocabulary size,
        one without top-p 1.0."""
        batch = self._batch
        top_k = None if batch.no_top_k else batch.top_k_cpu[rows]
        top_p = None if batch.no_top_p else batch.top_p_cpu[rows]
        return top_k, top_p

    @property
    def spec_token_ids(self) -> list[list[int]]:
        """Per row, the draft tokens this step verified (negative entries are padding)."""
        return self._batch.spec_token_ids

    def discarded_rows_mask(self) -> np.ndarray | None:
        """Per row, whether this step's sample is discarded (a partial prefill); None where this
        vLLM does not say."""
        mask = getattr(getattr(self.runner, "discard_request_mask", None), "np", None)
        return None if mask is None else mask[: len(self._batch.req_ids)]

    def extra_args(self, req_id: str) -> Mapping[str, Any] | None:
        """The request's ``SamplingParams.extra_args`` (None for an unknown request)."""
        state = self.runner.requests.get(req_id) if self.runner is not None else None
        return getattr(getattr(state, "sampling_params", None), "extra_args", None)

    # --- the paged KV cache -------------------------------------------------------------------

    def attention_groups(self) -> Iterator[tuple[Any, list[Any]]]:
        """``(block table, attention groups)`` per KV-cache group."""
        for gid, groups in enumerate(self.runner.attn_groups):
            yield self._batch.block_table[gid], groups

    def kv_capacity(self, row: int) -> int:
        """Token slots allocated to ``row`` (the smallest over the KV-cache groups)."""
        return min(
            int(table.num_blocks_per_row[row]) * table.block_size
            for table, _ in self.attention_groups()
        )

    # --- written: the draft distribution vLLM's rejection sampler reads -------------------------

    def set_draft_probs(self, probs: torch.Tensor | None, req_ids: list[str] | None) -> None:
        """``probs[i, j]``: the distribution draft ``j`` of ``req_ids[i]`` was sampled from."""
        self.runner._draft_probs = probs
        self.runner._draft_prob_req_ids = req_ids
