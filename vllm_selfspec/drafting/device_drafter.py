"""The selfspec drafter, on every platform: layer-skip and prompt-lookup drafts on vLLM's own
device-side speculator machinery.

vLLM's own speculator machinery (``DraftModelProposer`` / ``SpecDecodeBaseProposer``) runs the
draft: sampled tokens and drafts stay on the device, one padded draft pass per engine step,
positions, slots and sequence lengths advance on the device between draft steps (vLLM's fused
step kernel), no host sync per draft token, and the draft forward goes through vLLM's compilation
path (``support_torch_compile``: inductor on CPU, piecewise CUDA graphs on CUDA). The "draft
model" is the target itself: :class:`SelfDraftModel` holds the target's modules by reference and
runs the layer-skip stack, its attention layers are the target's own non-skipped ones (no KV pages
of its own: drafts write the target's paged cache, and verification overwrites those slots before
any full-model read), and no weight is loaded or copied.

A selfspec engine is configured as vLLM's ``draft_model`` method with the target as the draft
model (:mod:`vllm_selfspec.plugin.engine_config`), on vLLM's V1 model runner with synchronous
scheduling; :func:`vllm_selfspec.plugin.patches.model_runner.install_device_drafter` has its runner
build this class where vLLM builds its ``DraftModelProposer``.

Differences from vLLM's ``draft_model`` (each a method below, wrapping and delegating):

* The first draft pass is one token per request: the sampled token at the first position without
  K/V (``seq_len - num_rejected``). vLLM's pass re-encodes every verified token, which on a shared
  cache would overwrite the full model's K/V of accepted positions with the draft's.
* Rows that step past ``max_model_len`` write nothing for the rest of the pass. vLLM's step kernel
  sends such a row back to position 0 and carries on at 1, 2, ... with real slots: harmless in a
  draft model's own cache, but in the target's it overwrote a request's first K/V (a wrong token
  was reproduced). vLLM hides this by switching drafting off for the whole batch near the end; we
  do not (see ``patches.model_runner.patch_runner_input_fits_in_drafter``).
* Draft lengths are planned per request and step before the pass (the draft-length controller:
  per-request caps, and with ``adaptive`` the acceptance- and cost-driven plan of
  :class:`~vllm_selfspec.control.controller.DraftLengthController`). The pass runs the longest
  planned length for every row (none at all when every budget is 0) and each request's drafts
  are trimmed to its budget, and with ``adaptive`` before the first draft whose chained top-1
  probability does not pay for its verification, when the engine core takes them: one host read
  of the pass's top-1 probabilities per step, where vLLM reads the drafts anyway. Draft &
  Verify's confidence exit stops *drafting*; here the padded pass has run (stopping it early would
  need a host sync per draft token) and its forwards are spent, so only the verification of a
  draft can still be saved.

* With ``"drafts": "hybrid"`` (the default) or ``"lookup"`` a request can draft by prompt lookup
  instead: its newest n-gram matched against its own earlier tokens (vLLM's ``ngram`` kernel,
  :mod:`vllm_selfspec.drafting.prompt_lookup`), taken when it pays at least as well as the
  layer-skip budget (:mod:`vllm_selfspec.control.source_choice`). Lookup rows get no layer-skip
  budget, a step whose every drafting request took a lookup runs no pass, and lookup drafts reach
  the rejection sampler as deterministic proposals
  (:meth:`SelfSpecDeviceProposer.take_last_draft_probs`).

* With ``"layer_selection": "online"`` the skip set is searched while serving
  (:class:`~vllm_selfspec.layers.online_scoring.OnlineSelector`): the draft runs eager while the
  search explores (one draft model whose skip set changes between passes), and each set the
  search settles on is compiled once and cached (CPU; on CUDA a set adopted after start-up runs
  eager, since vLLM captures CUDA graphs only at start-up:
  :class:`~vllm_selfspec.drafting.model_cache.DraftModelCache`). The
  draft's attention layers are then all of the target's, so that the attention metadata of a
  pass covers whichever set drafts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_selfspec.config import SelfSpecSettings
from vllm_selfspec.control.controller import (
    DraftLengthController,
    running_request_overrides,
)
from vllm_selfspec.control.observation import SourceTotals, StepObservation, Verification
from vllm_selfspec.control.source_choice import LookupAcceptance, choose_lookups
from vllm_selfspec.control.step_costs import StepCostRecorder
from vllm_selfspec.drafting.cost_feed import CostFeed
from vllm_selfspec.drafting.model_cache import DraftModelCache
from vllm_selfspec.drafting.prompt_lookup import valid_sampled
from vllm_selfspec.drafting.skip_forward import LayerSkipForward, decoder_stack
from vllm_selfspec.drafting.step_clock import StepClock
from vllm_selfspec.layers.online_scoring import online_selector
from vllm_selfspec.plugin.engine_markers import ADDITIONAL_CONFIG_KEY
from vllm_selfspec.plugin.runner_view import RunnerView

logger = logging.getLogger("vllm.selfspec.device_drafter")

PADDING_SLOT_ID = -1  # vLLM's "write nothing" slot (vllm.v1.attention.backends.utils)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1})
class SelfDraftModel(nn.Module):
    """The target model with the profile's sub-layers skipped, as vLLM's drafter calls a model.

    The target is held outside ``nn.Module`` registration: its parameters stay the target's (no
    copy, not counted twice), and the skip set is a constant of the compiled graph.
    """

    def __init__(
        self,
        *,
        vllm_config: Any,
        prefix: str = "",
        target: nn.Module | None = None,
        skip_attention: frozenset[int] = frozenset(),
        skip_mlp: frozenset[int] = frozenset(),
    ) -> None:
        super().__init__()
        assert target is not None
        self._target = (target,)
        self._skip = LayerSkipForward(target)
        self.skip_attention = frozenset(skip_attention)
        self.skip_mlp = frozenset(skip_mlp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self._skip.run(input_ids, positions, self.skip_attention, self.skip_mlp)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(hidden_states)

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return decoder_stack(self._target[0]).embed_input_ids(input_ids)


def attention_layer_names(skip: LayerSkipForward, skip_attention: frozenset[int]) -> set[str]:
    """vLLM's names of the target's attention layers the draft runs (its KV-writing layers)."""
    return {
        skip.stack.layers[index].self_attn.attn.layer_name
        for index in range(skip.start_layer, skip.end_layer)
        if index not in skip_attention
    }


class SelfSpecDeviceProposer(DraftModelProposer):
    """vLLM's draft-model proposer with the target as its own layer-skipping draft model."""

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        raw = (vllm_config.additional_config or {})[ADDITIONAL_CONFIG_KEY]
        self.settings = SelfSpecSettings.from_dict(raw)
        self.k_max = self.settings.num_speculative_tokens
        self.runner_view = RunnerView(runner)  # vLLM's base class keeps no reference
        self._pending_rejected: torch.Tensor | None = None
        self._planned: int | None = None  # a pass length planned before vLLM's preparation
        self._planned_at: Any = None  # when that plan was made (a StepClock mark)
        self._past_end = torch.zeros(self.max_batch_size, dtype=torch.bool, device=device)
        self._past_end_rows = torch.zeros((), dtype=torch.int64, device=device)
        # Draft lengths: caps only (adaptive off), or the adaptive controller.
        self.controller = DraftLengthController.for_settings(self.settings, self.k_max)
        self._costs = StepCostRecorder()
        self._cost_feed = CostFeed(device)
        self._budgets: dict[str, int] = {}  # this step's plan, read when the drafts are taken
        self._step_confidences: list[torch.Tensor] = []  # per draft step, [batch] top-1 probs
        self._last_req_ids: list[str] = []
        self._last_end: Any = None  # the previous step's end (a StepClock mark)
        self._clock = StepClock(device)  # host clock on CPU, CUDA events on CUDA
        self._bad_override_warned: set[str] = set()
        self.source_totals = SourceTotals()  # the per-source Prometheus counters read them
        self.counters = {
            "steps": 0,
            "draft_passes": 0,
            "passes_skipped": 0,  # every budget 0: no draft forward at all
            "prepare_skipped": 0,  # steps without a pass that skipped vLLM's input preparation too
            "plain_sampled": 0,  # steps without drafts, sampled without the rejection sampler
            "draft_forwards": 0,
            "draft_tokens": 0,  # handed to verification, after the trim
            "trimmed_tokens": 0,
            "confidence_exits": 0,
            # prompt-lookup drafts ("drafts": "hybrid" / "lookup"); the rest of draft_tokens
            # came from layer-skip passes
            "lookup_found": 0,  # request-steps with a lookup draft found (taken or not)
            "lookup_rows": 0,  # request-steps handed a lookup draft
            "lookup_tokens": 0,
            "lookup_accepted": 0,
            "lookup_only_steps": 0,  # steps whose every draft was a lookup: no pass
            # lookups that paid alone but not the step's switch to verification (source_choice)
            "lookup_step_declined": 0,
            # decoding request-steps planned, and those planned no draft from either source (the
            # benchmarks' "drafting off" share)
            "rows_considered": 0,
            "rows_off": 0,
        }
        # Prompt lookup: this step's sampled tokens (from the runner), the lookup drafts chosen,
        # and which requests were handed lookup drafts last step.
        self._lookup = None
        self.lookup_acceptance: LookupAcceptance | None = None
        if self.settings.drafts != "layer_skip":
            from vllm_selfspec.drafting.prompt_lookup import PromptLookup

            self._lookup = PromptLookup(
                self.settings.prompt_lookup_min,
                self.settings.prompt_lookup_max,
                self.k_max,
                self.max_model_len,
            )
            self.lookup_acceptance = LookupAcceptance()
        self._sampled: torch.Tensor | None = None
        self._lookups: dict[str, list[int]] = {}
        # Online layer selection: the search, the eager draft it explores with, and a compiled
        # draft per skip set it settled on.
        self.online = online_selector(self.settings, self.runner_view, vllm_config, self.k_max,
                                      self._costs, self._cost_feed.rank)
        self._explorer: SelfDraftModel | None = None
        self._models: DraftModelCache[SelfDraftModel] | None = None  # built by load_model
        self._handed_lookup: set[str] = set()
        # the runner that built this drafter gets its instance patches from
        # patches.model_runner._patch_runner_init once its constructor returns (they call into
        # this drafter)
        logger.info("selfspec drafter: %s, k=%d", self.settings.describe(), self.k_max)

    # --- model ------------------------------------------------------------------------------

    def load_model(self, target_model: nn.Module) -> None:
        """Build the self-draft model over ``target_model``; load nothing, allocate no KV. The
        model active when this returns is the one vLLM compiles (and, on CUDA, captures) at
        start-up."""
        from vllm.platforms import current_platform

        self._target_model = target_model
        self._models = DraftModelCache(self._build_compiled_draft,
                                       compile_after_start=current_platform.is_cpu())
        skip_attention = frozenset(self.settings.skip_attention)
        skip_mlp = frozenset(self.settings.skip_mlp)
        if self.online is None:
            self.model = self._models.start_up_model((skip_attention, skip_mlp))
            # vLLM builds the pass's attention metadata for the draft's attention layers; a draft
            # that skips every attention sub-layer reads none, but vLLM needs one group to build
            self._draft_attn_layer_names = attention_layer_names(
                self.model._skip, skip_attention
            ) or attention_layer_names(self.model._skip, frozenset())
        else:
            self._explorer = self._new_draft(skip_attention, skip_mlp,
                                             tag="selfspec_draft_explore")
            self._explorer.do_not_compile = True  # eager: its skip set changes between passes
            self._draft_attn_layer_names = attention_layer_names(self._explorer._skip, frozenset())
            start = self.online.attach(self._explorer._skip, target_model)
            self.model = self._models.start_up_model(
                (frozenset(start.attention), frozenset(start.mlp))
            )
        self._models.end_start_up()

    def _new_draft(
        self, skip_attention: frozenset[int], skip_mlp: frozenset[int], tag: str
    ) -> SelfDraftModel:
        from vllm.compilation.backends import set_model_tag
        from vllm.config import set_current_vllm_config

        with set_model_tag(tag), set_current_vllm_config(self.vllm_config):
            return SelfDraftModel(
                vllm_config=self.vllm_config,
                prefix="selfspec_draft",
                target=self._target_model,
                skip_attention=skip_attention,
                skip_mlp=skip_mlp,
            )

    def _build_compiled_draft(self, key: Any) -> SelfDraftModel:
        """The draft model of skip set ``key`` through vLLM's compilation path (compiled at its
        first pass); one compile-cache tag per set: a compiled graph bakes the skip set in."""
        skip_attention, skip_mlp = key
        tag = "selfspec_draft_a{}_m{}".format(
            "-".join(map(str, sorted(skip_attention))) or "none",
            "-".join(map(str, sorted(skip_mlp))) or "none",
        )
        return self._new_draft(skip_attention, skip_mlp, tag)

    def _use_skip_set(self, skip_attention: frozenset[int], skip_mlp: frozenset[int]) -> None:
        """Online selection: draft with this set from the next pass on: its compiled draft when
        there is one, or when the search has settled on it and the platform allows compiling it
        now (:class:`~vllm_selfspec.drafting.model_cache.DraftModelCache`), else the eager
        explorer."""
        assert self.online is not None and self._explorer is not None
        key = (skip_attention, skip_mlp)
        model = self._models.cached(key)
        if model is None and not self.online.searching:
            model = self._models.settled_model(key)
            if model is not None:
                logger.info(
                    "selfspec online: compiling the draft of the chosen set (attention %s, MLP "
                    "%s)", sorted(skip_attention), sorted(skip_mlp),
                )
        if model is None:
            model = self._explorer
            model.skip_attention, model.skip_mlp = skip_attention, skip_mlp
        self.model = model

    # --- the pass ---------------------------------------------------------------------------

    def propose(
        self, *args: Any, num_rejected_tokens_gpu: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        k_limit = int(kwargs.pop("num_speculative_tokens", self.k_max))
        k_step, self._planned = self._planned, None
        planned = k_step is not None
        if not planned:  # not planned by plan_before_preparation
            k_step = self._begin_step(num_rejected_tokens_gpu, k_limit)
        cad = kwargs["common_attn_metadata"]
        if k_step == 0:
            drafts = self._no_pass(cad.batch_size())
        else:
            # The first pass below places each request's token after its rejected slots itself,
            # so the base loop must not subtract them again from the sequence lengths.
            self._pending_rejected = num_rejected_tokens_gpu
            self.counters["draft_passes"] += 1
            self.counters["draft_forwards"] += k_step
            # A pass planned before vLLM's preparation of its inputs is charged that preparation
            # too: a step without a pass skips it
            # (patches.model_runner.patch_runner_propose_without_drafts).
            pass_start = self._planned_at if planned else self._clock.mark()
            drafts = super().propose(
                *args, num_speculative_tokens=k_step, num_rejected_tokens_gpu=None, **kwargs
            )
            # the pass's time on the device (one forward = its share); the planning before it
            # runs on plain steps too and is not a draft forward's cost
            batch = cad.batch_size()
            self._clock.measure(
                pass_start, self._clock.mark(),
                lambda s, batch=batch, k=k_step: self._costs.observe_draft(batch, s / k),
            )
        self._end_step()
        return drafts

    def plan_before_preparation(
        self, k_limit: int, batch_size: int, num_rejected: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The step's bookkeeping and plan, before vLLM prepares the pass's inputs (see
        :func:`~vllm_selfspec.plugin.patches.model_runner.patch_runner_propose_without_drafts`;
        ``num_rejected``: the drafts each request had rejected this step, ``None`` when none were
        verified): the empty drafts when no pass runs (lookup drafts are handed out by
        :meth:`trim`), else ``None`` (the plan is kept for :meth:`propose`, which vLLM calls
        next)."""
        k_step = self._begin_step(num_rejected, k_limit)
        if k_step > 0:
            self._planned = k_step
            self._planned_at = self._clock.mark()
            return None
        self.counters["prepare_skipped"] += 1
        drafts = self._no_pass(batch_size)
        self._end_step()
        return drafts

    def _begin_step(self, num_rejected: torch.Tensor | None, k_limit: int) -> int:
        """Observe the verification of last step's drafts and the step's cost; plan this step's
        budgets; returns the pass length."""
        start = self._clock.mark()
        self._clock.collect()  # the intervals the device has finished since the last step
        req_ids = self.runner_view.req_ids
        discarded = self._discarded(len(req_ids))
        verified, observation = self._observe(req_ids, discarded, num_rejected)
        self.controller.observe(observation)
        if self.online is not None:  # may switch the skip set: between passes only
            self._online_step(observation)
        # The gap since the previous pass is one verification step only while the same requests
        # keep decoding (a changed batch means prefills or an idle engine in between).
        if self._last_end is not None and req_ids == self._last_req_ids and not any(discarded):
            batch = len(req_ids)
            self._clock.measure(
                self._last_end, start,
                lambda s, batch=batch, x=verified: self._costs.observe_verify(batch, x, s),
            )
        self._last_req_ids = req_ids
        self.counters["steps"] += 1
        self._step_confidences = []
        found = self._find_lookups(req_ids, discarded)
        return self._plan(
            [r for r, d in zip(req_ids, discarded, strict=True) if not d], k_limit, found
        )

    def _see_sampled(self, sampled_token_ids: torch.Tensor) -> None:
        self._sampled = sampled_token_ids

    def sampled_token_observer(self) -> Any:
        """What the runner hands each step's sampled tokens to before the plan (prompt lookup
        reads them), or None when this drafter does not look anything up."""
        return self._see_sampled if self._lookup is not None else None

    def _find_lookups(self, req_ids: list[str], discarded: list[bool]) -> dict[str, list[int]]:
        """This step's prompt-lookup drafts, by request (none without ``drafts`` lookup/hybrid)."""
        sampled, self._sampled = self._sampled, None
        if self._lookup is None or sampled is None or not req_ids:
            return {}
        rows = [row for row, d in enumerate(discarded) if not d]
        found = self._lookup.find(
            self.runner_view.token_ids_cpu,
            self.runner_view.num_tokens_no_spec,
            valid_sampled(sampled, len(req_ids)),
            rows,
        )
        return {req_ids[row]: tokens for row, tokens in found.items()}

    def count_plain_sampled(self) -> None:
        self.counters["plain_sampled"] += 1

    def _no_pass(self, batch_size: int) -> torch.Tensor:
        self.counters["passes_skipped"] += 1
        self.counters["lookup_only_steps"] += bool(self._lookups)
        self._last_draft_probs = None  # the runner reads it after every propose
        return torch.empty((batch_size, 0), dtype=torch.int64, device=self.device)

    def _end_step(self) -> None:
        self._cost_feed.step(self._costs, self.controller)
        self._last_end = self._clock.mark()

    # --- draft lengths ----------------------------------------------------------------------

    def _discarded(self, num_reqs: int) -> list[bool]:
        """Per row of this step: a partial prefill (its sampled token is discarded, nothing to
        plan for)."""
        mask = self.runner_view.discarded_rows_mask()
        if mask is None:
            return [False] * num_reqs
        return [bool(v) for v in mask]  # the view's mask has the batch's rows

    def _observe(
        self, req_ids: list[str], discarded: list[bool], num_rejected: torch.Tensor | None
    ) -> tuple[int, StepObservation]:
        """This step's verification of the drafts handed out last step (drafted: what the
        scheduler scheduled; accepted: drafted minus vLLM's rejected count): lookup drafts go to
        the source choice, layer-skip ones into the step's observation (with the controller's
        cost table, rank 0's on every tensor-parallel rank); returns how many drafts were
        verified in all, and the observation."""
        from_lookup, self._handed_lookup = self._handed_lookup, set()
        total = 0
        verified: list[Verification] = []
        lookups: list[Verification] = []
        if num_rejected is not None and req_ids:
            rejected = num_rejected[: len(req_ids)].tolist()  # one read per step
            scheduled = self.runner_view.spec_token_ids
            for row, req_id in enumerate(req_ids):
                drafted = sum(1 for t in scheduled[row] if t >= 0)
                if not drafted:
                    continue
                total += drafted
                if req_id in from_lookup:
                    accepted = drafted - int(rejected[row])
                    self.counters["lookup_accepted"] += accepted
                    assert self.lookup_acceptance is not None
                    self.lookup_acceptance.observe(req_id, drafted, accepted)
                    lookups.append(Verification(req_id, drafted, accepted))
                    continue
                # no confidences: they calibrate Draft & Verify's engine-wide exit, which this
                # drafter does not apply (drafts_worth_verifying cuts a pass's drafts by cost)
                verified.append(Verification(req_id, drafted, drafted - int(rejected[row])))
        if self.lookup_acceptance is not None:
            self.lookup_acceptance.retain(req_ids)
        observation = StepObservation(
            req_ids=tuple(req_ids),
            decoding=tuple(not d for d in discarded),
            verified=tuple(verified),
            costs=self.controller.step_costs,
            lookup=tuple(lookups),
        )
        self.source_totals.add(observation)
        return total, observation

    def _online_step(self, observation: StepObservation) -> None:
        """Online layer selection's step."""
        assert self.online is not None
        new = self.online.step(observation)
        if new is not None:
            # the acceptance the controller learnt was the old set's: restart it from the new
            # set's matchness on the traffic (the same on every tensor-parallel rank)
            self.controller.restart_acceptance(self.online.search.matchness(new))
        if new is not None or (self.model is self._explorer and not self.online.searching):
            current = self.online.current
            self._use_skip_set(frozenset(current.attention), frozenset(current.mlp))

    def _plan(self, req_ids: list[str], k_limit: int, found: dict[str, list[int]]) -> int:
        """Budgets of this step's decoding requests (kept for :meth:`trim`; the others get none),
        and which of them draft by the lookups ``found`` this step;
        returns the pass length."""
        overrides = running_request_overrides(
            self.runner_view.extra_args, req_ids, self.k_max, self._bad_override_warned
        )
        budgets = self.controller.plan(req_ids, overrides=overrides)
        self.counters["lookup_found"] += len(found)
        if found:
            assert self.lookup_acceptance is not None
            choice = choose_lookups(
                self.controller, self.lookup_acceptance, hybrid=self.settings.drafts == "hybrid",
                req_ids=req_ids, budgets=budgets, found=found, k_limit=k_limit,
            )
            self._lookups = choice.drafts
            self.counters["lookup_step_declined"] += choice.declined
        else:
            self._lookups = {}
        if self.settings.drafts == "lookup":  # prompt lookup only: no layer-skip pass ever
            budgets = [0] * len(budgets)
        elif self._lookups:
            budgets = [
                0 if r in self._lookups else b for r, b in zip(req_ids, budgets, strict=True)
            ]
        self._budgets = dict(zip(req_ids, budgets, strict=True))
        self.counters["rows_considered"] += len(req_ids)
        self.counters["rows_off"] += sum(
            1 for r, b in zip(req_ids, budgets, strict=True) if b <= 0 and r not in self._lookups
        )
        return max(0, min(max(budgets, default=0), k_limit, self.k_max))

    def _sample_from_logits(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        """vLLM's draft sampling, from the distribution the request samples from: the
        temperature-scaled logits truncated by its top-k / top-p (vLLM's own draft sampler applies
        the temperature only, so such a request drew most drafts from tokens the target never
        emits). The truncated distribution is what reaches the rejection sampler as the draft
        probabilities, so the output distribution is still the target's."""
        top_k, top_p = sampling_metadata.top_k, sampling_metadata.top_p
        temperature = sampling_metadata.temperature
        rows = logits.shape[0]
        if (
            not self._enable_probabilistic_draft_probs
            or sampling_metadata.all_greedy
            or (top_k is None and top_p is None)
            or temperature is None
            or any(t is not None and t.shape[0] != rows for t in (top_k, top_p, temperature))
        ):
            return super()._sample_from_logits(logits, sampling_metadata)
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
        from vllm.v1.sample.sampler import _SAMPLING_EPS

        greedy = temperature < _SAMPLING_EPS
        # float32 first, as the target's sampler scales and truncates float32 logits (and vLLM's
        # CUDA top-k / top-p kernel, Triton, takes float32 only)
        scaled = logits.float() / torch.where(
            greedy, torch.ones_like(temperature), temperature
        ).view(-1, 1).float()
        truncated = apply_top_k_top_p(scaled, top_k, top_p)
        # sampled at temperature 1 from here on (greedy rows keep theirs: argmax, which the
        # truncation keeps)
        at_one = dataclasses.replace(
            sampling_metadata,
            temperature=torch.where(greedy, temperature, torch.ones_like(temperature)),
        )
        return super()._sample_from_logits(truncated, at_one)

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata: Any) -> Any:
        """vLLM's draft sampling, plus each row's top-1 probability of the drafted token (the
        confidence exit's input) when the controller adapts."""
        if not self.settings.adaptive:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        tokens, probs = self._sample_from_logits(logits, sampling_metadata)
        if probs is None:  # argmax drafts: the drafted token is the most likely one
            confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        else:
            confidence = probs.gather(1, tokens.view(-1, 1).long()).squeeze(1).float()
        self._step_confidences.append(confidence)
        return tokens, probs

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: Any,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, Any]:
        """One query token per request: its sampled token at the first position without K/V."""
        batch = cad.batch_size()
        seq_lens = cad.seq_lens[:batch].to(torch.int64)
        rejected = self._pending_rejected
        if rejected is not None:
            seq_lens = seq_lens - rejected[:batch].to(torch.int64)
        positions = seq_lens  # the sampled token's position (positions 0..seq_len-1 have K/V)
        past_end = positions >= self.max_model_len
        self._past_end[:batch] = past_end
        positions = positions.masked_fill(past_end, 0)
        block = cad.block_table_tensor[
            torch.arange(batch, device=positions.device), positions // self.block_size
        ]
        slots = block.to(torch.int64) * self.block_size + positions % self.block_size
        slots = slots.masked_fill(past_end, PADDING_SLOT_ID)
        self.input_ids[:batch] = next_token_ids[:batch].to(self.input_ids.dtype)
        self._set_positions(batch, positions)
        upper = cad.seq_lens_cpu_upper_bound
        new_cad = dataclasses.replace(
            cad,
            query_start_loc=self.arange[: batch + 1],
            query_start_loc_cpu=torch.from_numpy(self.token_arange_np[: batch + 1]).clone(),
            seq_lens=(positions + 1).masked_fill(past_end, 1).to(cad.seq_lens.dtype),
            num_actual_tokens=batch,
            max_query_len=1,
            max_seq_len=min(cad.max_seq_len + 1, self.max_model_len),
            slot_mapping=slots,
            seq_lens_cpu_upper_bound=None if upper is None else upper + 1,
            positions=None,
            is_prefilling=None,
            logits_indices_padded=None,
            num_logits_indices=None,
        )
        return batch, self.arange[:batch], new_cad

    def _update_positions_dependent_metadata(
        self,
        positions: torch.Tensor,
        common_attn_metadata: Any,
        batch_size: int,
        input_batch_size: int,
        block_size: int,
    ) -> torch.Tensor:
        """vLLM's step update, then no writes for rows that have passed ``max_model_len``."""
        newly = ((positions[:batch_size] + 1) >= self.max_model_len) & ~self._past_end[:batch_size]
        self._past_end_rows += newly.sum()  # on the device: read only by stats()
        self._past_end[:batch_size] |= newly
        out = super()._update_positions_dependent_metadata(
            positions, common_attn_metadata, batch_size, input_batch_size, block_size
        )
        self._slot_mapping_buffer[:batch_size].masked_fill_(
            self._past_end[:batch_size], PADDING_SLOT_ID
        )
        return out

    # --- per-request caps -------------------------------------------------------------------

    def trim(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Each request's drafts cut to its planned budget and, with ``adaptive``, before the
        first draft not worth its verification
        (:meth:`~vllm_selfspec.control.controller.DraftLengthController.drafts_worth_verifying`)."""
        confidences = (
            torch.stack(self._step_confidences, dim=1).tolist() if self._step_confidences else None
        )
        marginal = (
            self.controller.marginal_verify_cost(
                len(req_ids), max(self._budgets.values(), default=0)
            )
            if confidences is not None
            else 0.0
        )
        out = []
        for row, (req_id, tokens) in enumerate(zip(req_ids, drafts, strict=True)):
            lookup = self._lookups.get(req_id)
            if lookup is not None:  # a lookup draft in place of this row's pass output
                self._handed_lookup.add(req_id)
                self.counters["lookup_rows"] += 1
                self.counters["lookup_tokens"] += len(lookup)
                self.counters["draft_tokens"] += len(lookup)
                out.append(list(lookup))
                continue
            budget = min(self._budgets.get(req_id, 0), len(tokens))
            keep = budget
            if confidences is not None:
                conf = confidences[row]
                keep = self.controller.drafts_worth_verifying(req_id, conf, budget, marginal)
                if keep < budget:
                    self.counters["confidence_exits"] += 1
            self.counters["trimmed_tokens"] += len(tokens) - keep
            self.counters["draft_tokens"] += keep
            out.append(tokens[:keep])
        return out

    def take_last_draft_probs(self) -> torch.Tensor | None:
        """The pass's draft probabilities, with each lookup row's drafts as the deterministic
        proposals they are (probability 1 on the looked-up token), for vLLM's rejection sampler.
        None when no pass ran: vLLM then treats every draft as deterministic, as for ``ngram``."""
        probs = super().take_last_draft_probs()
        if probs is None or not self._lookups:
            return probs
        width = max(len(t) for t in self._lookups.values())
        if width > probs.shape[1]:  # a lookup draft longer than the pass
            wider = probs.new_zeros((probs.shape[0], width, probs.shape[2]))
            wider[:, : probs.shape[1]] = probs
            probs = wider
        for row, req_id in enumerate(self.runner_view.req_ids):
            tokens = self._lookups.get(req_id)
            if tokens:
                index = torch.tensor(tokens, dtype=torch.int64, device=probs.device)
                probs[row, : len(tokens)] = 0.0
                probs[row, torch.arange(len(tokens), device=probs.device), index] = 1.0
        self._last_draft_probs = probs
        return probs

    def stats(self) -> dict[str, Any]:
        costs = self._costs.snapshot()
        batch = max(1, len(self._last_req_ids))
        return {
            "drafter": "device",
            **self.counters,
            # draft rows stopped at max_model_len (they write nothing past it)
            "rows_past_end": int(self._past_end_rows.item()),
            "controller": self.controller.stats(),
            "drafts": self.settings.drafts,
            "lookup_acceptance": (
                None if self.lookup_acceptance is None
                else self.lookup_acceptance.engine_acceptance()
            ),
            "draft_cost_s": float(costs.draft_cost(batch, batch)) if costs.draft else None,
            "plain_step_s": costs.plain_cost(batch) if costs.has_plain(batch) else None,
            # the measured table: "bucket:x" -> a step verifying x drafts per request, "bucket"
            # -> one draft forward (seconds, this worker's: "_s" keys differ across TP ranks)
            "cost_table_s": {
                "verify": {f"{b}:{x:g}": c for (b, x), c in sorted(costs.verify.items())},
                "draft": {str(b): c for b, c in sorted(costs.draft.items())},
            },
            "k_max": self.k_max,
            "skip_attention": sorted(self.model.skip_attention),
            "skip_mlp": sorted(self.model.skip_mlp),
            # the draft model of the latest pass: through vLLM's compilation ("compiled", once
            # it has run) or eager (tests' enforce_eager, or online selection exploring)
            "draft_model": "compiled" if getattr(self.model, "compiled", False) else "eager",
            "compiled_drafts": len(self._models) if self._models is not None else 0,
            "online": self.online.stats() if self.online is not None else None,
        }
