"""Patches of vLLM's model runner (worker processes): the device drafter's construction and the
per-instance patches of selfspec runners.

4. ``GPUModelRunner._input_fits_in_drafter`` (per runner instance, selfspec runners only): vLLM
   switches drafting off for the *whole batch* as soon as one request is within ``k`` tokens of
   ``max_model_len``. Our proposer clips each request's draft length itself, so it keeps drafting
   for the others. ``GPUModelRunner._bookkeeping_sync`` (same instance patch, CPU only): see
   :func:`patch_runner_cpu_discarded_generators` (a seeded request with a chunked prefill
   killed the engine core). Can go once vLLM decides per request near ``max_model_len``, and
   once its CPU runner stops rewinding CPU generators by a Philox offset.
8. ``GPUModelRunner.__init__`` (worker processes; installed lazily by an import hook when
   ``vllm.v1.worker.gpu_model_runner`` is first imported): a selfspec engine runs as vLLM's
   ``draft_model`` method with the target as the draft
   model, and vLLM's runner would build a ``DraftModelProposer`` that loads a second copy of the
   weights and KV cache. On those engines only, the wrapper delegates with the runner module's
   ``DraftModelProposer`` name pointing to
   :class:`vllm_selfspec.drafting.device_drafter.SelfSpecDeviceProposer` (a subclass, so every
   runner gate for ``draft_model`` passes), so that vLLM builds ours in its place; a runner that
   built something else is refused at start. With it, the drafter wraps its runner's
   ``take_draft_token_ids`` (:func:`patch_runner_take_draft_token_ids`): per-request draft
   lengths and the confidence exit cut drafts where vLLM moves them to the host, and its
   ``propose_draft_token_ids`` (:func:`patch_runner_propose_without_drafts`): a step whose
   plan runs no draft pass skips vLLM's draft-input preparation. Can go once vLLM lets a plugin
   register a speculator class that the runner builds.
9. ``GPUModelRunner._sample`` (per runner instance, selfspec runners only): a step
   in which no request has drafts is sampled by vLLM's plain sampler, as a plain engine samples
   it, instead of going through the rejection sampler (see
   :func:`patch_runner_sample_without_drafts`); a step with drafts runs inside patch 11's scope
   (:mod:`.cpu_sampler`). Can go once vLLM keys the speculative path on
   the scheduled drafts.
10. ``WorkerWrapperBase.selfspec_source_totals`` (worker processes; added, not wrapped, when a
   selfspec drafter is built): the per-source draft counters live in the drafter, in the workers,
   and the front end exports them (:mod:`vllm_selfspec.plugin.metrics`). vLLM's
   ``collective_rpc`` calls a worker method by name (a function needs
   ``VLLM_ALLOW_INSECURE_SERIALIZATION``), and a ``worker_extension_cls`` is the user's to set, so
   the method is added to the worker wrapper every executor calls through. It only reads. Can go
   once vLLM carries per-source speculative counters from the workers to its metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_selfspec.plugin.engine_markers import is_selfspec_engine
from vllm_selfspec.plugin.patches._shared import already_wrapped, install
from vllm_selfspec.plugin.patches.cpu_sampler import cheap_recovered_token_noise
from vllm_selfspec.plugin.runner_view import RunnerView

if TYPE_CHECKING:
    import torch


# --- 4. per-runner: do not switch drafting off for the whole batch ----------------------------


def patch_runner_input_fits_in_drafter(runner: Any) -> None:
    """Instance patch on one selfspec model runner (never on the class)."""
    original = runner._input_fits_in_drafter
    if already_wrapped(original):
        return

    def _input_fits_in_drafter(common_attn_metadata):
        # The proposer clips every request to max_model_len itself; only "no metadata" means
        # there is nothing to draft for.
        return common_attn_metadata is not None

    install(runner, "_input_fits_in_drafter", _input_fits_in_drafter, original)


def patch_runner_cpu_discarded_generators(runner: Any) -> None:
    """Instance patch on one selfspec model runner on CPU (never on the class).

    ``GPUModelRunner._bookkeeping_sync`` rewinds the generator of a seeded request whose sampled
    token is discarded (a partial prefill) with ``gen.set_offset(gen.get_offset() - 4)``, a
    CUDA Philox offset; a CPU ``torch.Generator`` raises ``CPU Generator does not use offset``
    and the engine core dies (one request with a ``seed`` chunked in a busy selfspec step took a
    whole OpenAI server down: the verification tokens fill the batch budget, so prefills are
    chunked far more often than in plain decoding). The wrapper hides the discarded rows'
    generators from that loop (their draws are not rewound: the sampled distribution is
    unchanged, a seeded output may depend on how its prefill was chunked) and delegates.
    """
    from vllm.platforms import current_platform

    original = getattr(runner, "_bookkeeping_sync", None)
    if original is None or already_wrapped(original) or not current_platform.is_cpu():
        return

    def _bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        generators = runner.input_batch.generators
        num_reqs = runner.input_batch.num_reqs
        hidden = {}
        if generators:
            for i in runner.discard_request_mask.np[:num_reqs].nonzero()[0]:
                if int(i) in generators:
                    hidden[int(i)] = generators.pop(int(i))
        try:
            return original(*args, **kwargs)
        finally:
            generators.update(hidden)

    install(runner, "_bookkeeping_sync", _bookkeeping_sync, original)


# --- 8. the device drafter on the model runner --------------------------------------------------

_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def install_device_drafter() -> None:
    """Patch the runner now if its module is imported, else right after its first import (the
    plugin entry point stays cheap: nothing of vLLM's worker is imported for it)."""
    module = sys.modules.get(_RUNNER_MODULE)
    if module is not None:
        _patch_runner_init(module)
    elif not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport(_RUNNER_MODULE, _patch_runner_init))


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after module ``name`` is executed (one shot)."""

    def __init__(self, name: str, patch: Any) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch_runner_init(module: Any) -> None:
    """Device-drafter engines get
    :class:`~vllm_selfspec.drafting.device_drafter.SelfSpecDeviceProposer`
    where vLLM builds its ``DraftModelProposer``: the runner module's name for that class points
    to ours while the runner's own constructor runs (one proposer built, not vLLM's and then
    ours). Other engines are untouched."""
    cls = module.GPUModelRunner
    original = cls.__init__
    if already_wrapped(original):
        return

    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        if not is_selfspec_engine(vllm_config):
            return original(self, vllm_config, *args, **kwargs)
        from vllm_selfspec.drafting.device_drafter import SelfSpecDeviceProposer

        vllm_class = module.DraftModelProposer
        module.DraftModelProposer = SelfSpecDeviceProposer
        try:
            original(self, vllm_config, *args, **kwargs)
        finally:
            module.DraftModelProposer = vllm_class
        drafter = getattr(self, "drafter", None)
        if not isinstance(drafter, SelfSpecDeviceProposer):
            raise RuntimeError(
                "selfspec: vLLM's model runner did not build the selfspec drafter (this vLLM "
                "version builds its draft-model proposer elsewhere); install a vLLM that "
                "vllm-selfspec supports"
            )
        _patch_device_drafter_runner(self, drafter)

    install(cls, "__init__", __init__, original)


def install_worker_source_totals() -> None:
    """Patch 10: ``WorkerWrapperBase.selfspec_source_totals`` (idempotent; called when the
    drafter is built, in the worker process, where vLLM's worker module is imported already)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from vllm_selfspec.plugin.worker_ext import source_totals

    if hasattr(WorkerWrapperBase, "selfspec_source_totals"):
        return

    def selfspec_source_totals(self: Any) -> Any:
        return source_totals(self.worker)

    install(WorkerWrapperBase, "selfspec_source_totals", selfspec_source_totals, source_totals)


def _patch_device_drafter_runner(runner: Any, drafter: Any) -> None:
    """The instance patches of a runner that built the device drafter (each below says why)."""
    install_worker_source_totals()
    patch_runner_input_fits_in_drafter(runner)
    patch_runner_cpu_discarded_generators(runner)
    patch_runner_take_draft_token_ids(runner, drafter.trim)
    patch_runner_propose_without_drafts(
        runner, drafter.plan_before_preparation, drafter.sampled_token_observer()
    )
    patch_runner_sample_without_drafts(runner, drafter.count_plain_sampled)


def patch_runner_take_draft_token_ids(runner: Any, trim: Any) -> None:
    """Instance wrap of ``runner.take_draft_token_ids`` (device drafter): each request's drafts
    go through ``trim(req_ids, drafts)`` when the engine core takes them. The padded draft pass
    drafts the same length for every row; this is where per-request budgets and the confidence
    exit cut them, at the point vLLM moves drafts to the host anyway."""
    original = runner.take_draft_token_ids
    if already_wrapped(original):
        return

    def take_draft_token_ids() -> Any:
        result = original()
        if result is None:
            return None
        return dataclasses.replace(
            result, draft_token_ids=trim(result.req_ids, result.draft_token_ids)
        )

    install(runner, "take_draft_token_ids", take_draft_token_ids, original)


def rejected_from_sampled(sampled_token_ids: Any, num_draft_tokens: Any) -> torch.Tensor:
    """Per row, the drafts rejected this step, as vLLM's ``prepare_inputs_padded`` counts them:
    ``drafted + 1 - valid`` where a row had drafts (valid: sampled tokens that are not the
    ``-1`` padding of rejected positions), else 0. ``sampled_token_ids``: the padded tensor (on
    the host on CPU, on the GPU under CUDA's synchronous scheduling: the result is on the same
    device) or vLLM's per-row lists."""
    import torch

    device = sampled_token_ids.device if isinstance(sampled_token_ids, torch.Tensor) else None
    drafted = torch.as_tensor(list(num_draft_tokens), dtype=torch.int32, device=device)
    rows = drafted.shape[0]
    if isinstance(sampled_token_ids, torch.Tensor):
        valid = (sampled_token_ids[:rows] >= 0).sum(dim=1, dtype=torch.int32)
    else:
        valid = torch.tensor([len(r) for r in sampled_token_ids[:rows]], dtype=torch.int32)
    return torch.where(drafted > 0, drafted + 1 - valid, torch.zeros_like(drafted))


def patch_runner_propose_without_drafts(
    runner: Any, plan_step: Any, see_sampled: Callable[[Any], None] | None = None
) -> None:
    """Instance wrap of ``runner.propose_draft_token_ids`` (selfspec runners).

    Before it calls the drafter, vLLM's runner prepares the draft pass's inputs on every step:
    the next tokens and rejected counts (``prepare_next_token_ids_padded``,
    ``prepare_inputs_padded``) and the target slices. When the drafter then plans no pass
    (every request capped at 0 or switched off, or, with prompt lookup, every drafting request
    drafting by lookup) they are thrown away: that preparation was a third of the measured cost
    of a selfspec engine whose every request has drafting switched off (the overhead floor).
    The wrapper asks ``plan_step(num_spec_tokens_to_schedule, batch_size, num_rejected)``
    first; it returns the (empty) drafts when no pass runs, else ``None`` and the wrapper
    delegates. ``num_rejected``, the drafts each request had rejected this step (``None`` on a
    step that verified none), is counted here from the sampled tokens as vLLM's preparation
    counts it (``drafted + 1 - valid sampled`` for a row with drafts, else 0), on the device
    the sampled tokens are on (host memory on CPU; the drafter reads the counts once per step,
    as vLLM's synchronous scheduling reads the sampled tokens anyway). Runners that copy
    sampled-token counts to the host for the next step (``valid_sampled_token_count_event``:
    async scheduling, which selfspec engines run without) always delegate. ``see_sampled`` gets
    every step's sampled tokens first (vLLM hands them to the runner's method, not to the
    drafter's ``propose``): the prompt-lookup source matches n-grams that end in them.
    """
    original = runner.propose_draft_token_ids
    if already_wrapped(original):
        return

    def propose_draft_token_ids(
        scheduler_output: Any,
        sampled_token_ids: Any,
        sampling_metadata: Any,
        hidden_states: Any,
        sample_hidden_states: Any,
        aux_hidden_states: Any,
        spec_decode_metadata: Any,
        common_attn_metadata: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if see_sampled is not None:
            see_sampled(sampled_token_ids)
        if getattr(runner, "valid_sampled_token_count_event", None) is None:
            num_draft = getattr(spec_decode_metadata, "num_draft_tokens", ())
            drafts = plan_step(
                scheduler_output.num_spec_tokens_to_schedule,
                common_attn_metadata.batch_size(),
                rejected_from_sampled(sampled_token_ids, num_draft) if any(num_draft) else None,
            )
            if drafts is not None:
                # what vLLM's method resets before proposing: no draft probabilities this step
                RunnerView(runner).set_draft_probs(None, None)
                return drafts
        return original(
            scheduler_output,
            sampled_token_ids,
            sampling_metadata,
            hidden_states,
            sample_hidden_states,
            aux_hidden_states,
            spec_decode_metadata,
            common_attn_metadata,
            *args,
            **kwargs,
        )

    install(runner, "propose_draft_token_ids", propose_draft_token_ids, original)


def patch_runner_sample_without_drafts(
    runner: Any, on_plain_step: Callable[[], None] | None = None
) -> None:
    """Instance wrap of ``runner._sample`` (selfspec runners only).

    vLLM 0.32 keys its runner's speculative path on the config, not on the step: every step of a
    speculative engine builds spec-decode metadata and samples through the rejection sampler,
    also a step in which no request has drafts (a prefill, requests capped at 0, drafting
    switched off by the controller). There the rejection sampler's output is the bonus token,
    drawn by the same plain sampler, plus indexing, casts and a rejection pass over an empty
    draft set: ~0.4 ms a step on CPU, the largest part of the overhead floor. On such a step the
    wrapper calls vLLM's ``_sample`` without the metadata, which samples with the plain sampler
    exactly as a plain engine does (same logits rows: one per request; same generator draws).
    Steps with drafts delegate unchanged, inside :func:`~.cpu_sampler.cheap_recovered_token_noise`
    (patch 11: on CPU the rejection sampler's recovered-token noise is drawn cheaply, for the
    requests with drafts only). ``on_plain_step`` is called on each step sampled so.
    Can go once vLLM keys the speculative path on the scheduled drafts.
    """
    original = runner._sample
    if already_wrapped(original):
        return

    def _sample(logits: Any, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is None:
            return original(logits, None)
        if spec_decode_metadata.max_spec_len == 0:
            if on_plain_step is not None:
                on_plain_step()
            return original(logits, None)
        with cheap_recovered_token_noise():  # patch 11 (installed on CPU only)
            return original(logits, spec_decode_metadata)

    install(runner, "_sample", _sample, original)
