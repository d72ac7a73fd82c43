"""Prompt-lookup drafts for the drafter: vLLM's n-gram matcher over each request's tokens.

The matcher is vLLM's own (``vllm.v1.spec_decode.ngram_proposer.batch_propose_numba``, the
``ngram`` method's kernel: the longest suffix n-gram of ``prompt_lookup_min..max`` tokens that
occurred before, and up to ``k`` tokens that followed its latest earlier occurrence). vLLM's
``ngram`` method runs it after the step's bookkeeping, on the runner's token table; the device
drafter plans before the bookkeeping, so the tokens sampled this step are not in that table yet.
:meth:`PromptLookup.find` matches on a copy of the table's rows with them appended.

The kernel runs on the host, like vLLM's ``ngram``: on the CPU platform the sampled tokens are
host memory; on CUDA reading them is one device-to-host copy per step, which vLLM's synchronous
scheduling makes anyway for the step's bookkeeping.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptLookup:
    """Up to ``k`` lookup drafts per request, from its prompt and output tokens."""

    def __init__(self, min_n: int, max_n: int, k: int, max_model_len: int) -> None:
        from vllm.v1.spec_decode.ngram_proposer import batch_propose_numba

        self._kernel = batch_propose_numba
        self.min_n, self.max_n, self.k, self.max_model_len = min_n, max_n, k, max_model_len
        self._buf = np.zeros((0, 0), dtype=np.int32)
        self._drafts = np.zeros((0, k), dtype=np.int32)
        self._num = np.zeros(0, dtype=np.int32)
        # compile the kernel now (numba JIT, about a second), not in the first request's step
        self._match([0], np.array([4], dtype=np.int32), np.array([[1, 2, 1, 2]], dtype=np.int32))

    def find(
        self,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        sampled: list[list[int]],
        rows: list[int],
    ) -> dict[int, list[int]]:
        """Lookup drafts of ``rows``: their first ``num_tokens[row]`` tokens of ``token_ids``
        (the runner's table) followed by ``sampled[row]``; rows without a match are left out."""
        if not rows:
            return {}
        batch = len(sampled)
        lengths = np.asarray(num_tokens[:batch], dtype=np.int32).copy()
        width = 0
        for row in rows:
            width = max(width, int(lengths[row]) + len(sampled[row]))
        if self._buf.shape[0] < batch or self._buf.shape[1] < width:
            self._buf = np.zeros(
                (max(batch, self._buf.shape[0]), max(width, 2 * self._buf.shape[1])),
                dtype=np.int32,
            )
        buf = self._buf
        stored = min(width, token_ids.shape[1])
        buf[:batch, :stored] = token_ids[:batch, :stored]
        for row in rows:
            new = sampled[row]
            start = int(lengths[row])
            buf[row, start : start + len(new)] = new
            lengths[row] = start + len(new)
        return self._match(rows, lengths, buf)

    def _match(self, rows: list[int], lengths: np.ndarray, buf: np.ndarray) -> dict[int, list[int]]:
        import numba

        if self._num.shape[0] < buf.shape[0]:
            self._drafts = np.zeros((buf.shape[0], self.k), dtype=np.int32)
            self._num = np.zeros(buf.shape[0], dtype=np.int32)
        threads = numba.get_num_threads()
        numba.set_num_threads(1)  # as vLLM's ngram method below 8192 tokens: threads cost more
        try:
            self._kernel(
                np.asarray(rows, dtype=np.int64), lengths, buf, self.min_n, self.max_n,
                self.max_model_len, self.k, self._drafts, self._num,
            )
        finally:
            numba.set_num_threads(threads)
        return {
            row: self._drafts[row, : self._num[row]].tolist() for row in rows if self._num[row] > 0
        }


def valid_sampled(sampled_token_ids: Any, batch: int) -> list[list[int]]:
    """Each row's sampled tokens this step (vLLM pads rejected positions with -1)."""
    return [[t for t in row if t >= 0] for row in sampled_token_ids[:batch].tolist()]
