"""Patches of vLLM's samplers for bugs of its CPU build (no Triton).

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
"""

from __future__ import annotations

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
