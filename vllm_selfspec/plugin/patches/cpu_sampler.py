"""Patches of vLLM's samplers on its CPU build: two bugs (no Triton) and one cost.

3. ``rejection_sampler.expand_batch_to_tokens`` (vLLM CPU build without Triton only): the C++
   ``expand_kernel_impl`` fills an int64 *copy* of a float32/int32 output and the function returns
   uninitialised memory, so rejection sampling at temperature > 0 uses garbage temperatures /
   top-k / top-p for every speculative method. The wrapper computes the expansion with PyTorch for
   those dtypes and delegates otherwise. Can go once the CPU op writes its output in place for
   every dtype (``tests/test_patches.py`` shows the bug on the unpatched function).
6. ``topk_topp_sampler.apply_top_k_only`` (vLLM without Triton only, i.e. the CPU build): with any
   speculative method vLLM runs every step through the rejection sampler, also steps in which no
   request has drafts; the target logits are then ``[0, vocab]`` and, for a batch with a top-k-only
   request (``top_k`` set, ``top_p`` not), ``k.max()`` of the empty ``k`` raises and kills the
   engine core (one ``"top_k": 1`` request takes the whole server down). The wrapper returns the
   empty logits unchanged and delegates otherwise. Can go once vLLM skips the rejection sampler
   on steps without drafts, or its CPU top-k handles an empty batch.
11. ``rejection_sampler.sample_recovered_tokens`` (CPU platform, selfspec runners only: the
   module function is wrapped at plugin load and acts only inside
   :func:`cheap_recovered_token_noise`, which the ``_sample`` wrapper of selfspec runners
   enters on steps with drafts). At
   temperature > 0 vLLM draws the Gumbel-max noise of the recovered tokens with
   ``Tensor.exponential_`` for *every* request of the batch: ``batch x vocab`` draws per
   verification step. On CPU, PyTorch's ``exponential_`` costs ~20 ns a draw (SmolLM2, vocab
   49152: 8 ms a step at batch 8, 31 ms at batch 32, against a plain step of ~45 / ~110 ms), the
   largest part of what sampled verification costs on this platform. The wrapper draws the same
   Exp(1) noise as ``-log(U)``, ``U`` uniform in float64 (~3x cheaper), and only for the
   requests that have drafts. A request with its own generator (a seed) still draws from it
   with ``exponential_``, as vLLM does, so seeded requests consume their generators as before.
   The recovered tokens are then sampled by vLLM's own kernel, unchanged: the argmax over the
   vocabulary of ``max(p_target - p_draft, 0) / q``, a draw from the residual distribution
   whatever exact Exp(1) sampler made ``q``. Can go once vLLM's CPU build draws this noise
   cheaply, or only for rows with drafts.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from vllm_selfspec.plugin.patches._shared import already_wrapped, install

# --- 3. CPU rejection-sampler bug -------------------------------------------------------------


def cpu_expand_bug_present() -> bool:
    """True where vLLM expands sampling parameters with the broken C++ op (CPU, no Triton)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return current_platform.is_cpu() and not HAS_TRITON


def _patch_cpu_expand_batch_to_tokens() -> None:
    if not cpu_expand_bug_present():
        return
    import torch
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    original = rejection_sampler.expand_batch_to_tokens
    if already_wrapped(original):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        if x.dtype == torch.int64:  # the C++ op fills int64 outputs in place: correct as it is
            return original(x, cu_num_tokens, num_tokens, replace_from, replace_to)
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        out = torch.repeat_interleave(x, counts, output_size=num_tokens)
        if replace_from != replace_to:
            out = out.masked_fill(out == replace_from, replace_to)
        return out

    install(rejection_sampler, "expand_batch_to_tokens", expand_batch_to_tokens, original)


# --- 6. CPU top-k-only on an empty batch of draft tokens ----------------------------------------


def _patch_cpu_empty_top_k_only() -> None:
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:  # the Triton top-k/top-p kernel is used instead
        return
    import vllm.v1.sample.ops.topk_topp_sampler as topk_topp_sampler

    original = topk_topp_sampler.apply_top_k_only
    if already_wrapped(original):
        return

    def apply_top_k_only(logits, k):
        if k.numel() == 0:  # no rows (a step without draft tokens): nothing to mask
            return logits
        return original(logits, k)

    install(topk_topp_sampler, "apply_top_k_only", apply_top_k_only, original)


# --- 11. CPU: cheap Gumbel-max noise for recovered tokens, drafting rows only --------------------

_CHEAP_RECOVERED_NOISE = contextvars.ContextVar("selfspec_cheap_recovered_noise", default=False)
"""True inside :func:`cheap_recovered_token_noise` (a selfspec runner's step with drafts)."""


def recovered_token_inverse_noise(
    num_draft_tokens: list[int],
    generators: dict[int, Any],
    vocab_size: int,
    dtype: Any,
    device: Any,
) -> Any:
    """``1 / q`` with ``q ~ Exp(1)`` i.i.d., ``[batch, vocab]``, filled only in the rows of
    requests that have drafts (vLLM's kernel reads no other row). ``q = -log(U)``, ``U ~
    Uniform[0, 1)`` in float64: ``U = 0`` gives ``q = inf`` and a score of 0, never a NaN. A
    request with its own generator draws ``exponential_`` from it, as vLLM does."""
    import torch

    batch_size = len(num_draft_tokens)
    seeded = {i: g for i, g in generators.items() if num_draft_tokens[i] > 0}
    unseeded = [i for i, n in enumerate(num_draft_tokens) if n > 0 and i not in seeded]
    noise = None
    if unseeded:
        log_u = torch.rand((len(unseeded), vocab_size), dtype=torch.float64, device=device).log_()
        noise = log_u.to(dtype).reciprocal_().neg_()  # 1 / -log(U): log(U) carries the precision
        if len(unseeded) == batch_size:  # every request drafts, none with a seed
            return noise
    inv_q = torch.empty((batch_size, vocab_size), dtype=dtype, device=device)
    if noise is not None:
        rows = torch.tensor(unseeded, dtype=torch.long, device=device)
        inv_q.index_copy_(0, rows, noise)
    for i, generator in seeded.items():
        inv_q[i].exponential_(generator=generator).reciprocal_()
    return inv_q


def _patch_cpu_recovered_token_noise() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    import vllm.v1.sample.rejection_sampler as rejection_sampler

    original = rejection_sampler.sample_recovered_tokens
    if already_wrapped(original):
        return

    def with_cheap_noise(
        max_spec_len,
        num_draft_tokens,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_probs,
        target_probs,
        sampling_metadata,
        device,
        use_fp64_gumbel=False,
    ):
        """vLLM's function with :func:`recovered_token_inverse_noise` as its noise."""
        inv_q = recovered_token_inverse_noise(
            num_draft_tokens,
            sampling_metadata.generators,
            target_probs.shape[-1],
            torch.float64 if use_fp64_gumbel else torch.float32,
            device,
        )
        recovered_token_ids = torch.empty_like(draft_token_ids)
        rejection_sampler._sample_recovered_tokens(
            recovered_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            inv_q,
            max_spec_len=max_spec_len,
        )
        return recovered_token_ids

    def sample_recovered_tokens(*args, **kwargs):
        sample = with_cheap_noise if _CHEAP_RECOVERED_NOISE.get() else original
        return sample(*args, **kwargs)

    install(rejection_sampler, "sample_recovered_tokens", sample_recovered_tokens, original)


@contextlib.contextmanager
def cheap_recovered_token_noise() -> Iterator[None]:
    """Patch 11 acts inside this block (where it is installed: on CPU; elsewhere the block
    changes nothing). The ``_sample`` wrapper of selfspec runners (patch 9) runs steps with
    drafts in it, so other engines in the process keep vLLM's noise."""
    token = _CHEAP_RECOVERED_NOISE.set(True)
    try:
        yield
    finally:
        _CHEAP_RECOVERED_NOISE.reset(token)
