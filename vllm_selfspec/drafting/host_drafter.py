"""The selfspec drafter: vLLM's ``custom_class`` proposer that drafts with the target model itself.

vLLM builds it on every tensor-parallel rank (``create_custom_proposer(vllm_config)`` from the model
runner's constructor), hands it the target model through :meth:`SelfSpecProposer.load_model`, and
calls :meth:`SelfSpecProposer.propose` after each verification step with the accepted tokens.

A draft round for the running requests is up to ``k`` one-token decode steps through the target's
own modules with the profile's sub-layers skipped. Step ``j`` feeds each request's newest token at
position ``p + j`` (``p`` = first position without K/V) and writes the K/V of the non-skipped
attention layers into the target's own paged cache at that position. The next verification runs the
full model over the same positions and overwrites those slots before any full-model read, so no
extra KV page and no weight copy is needed. The scheduler reserves the lookahead slots (see
:mod:`vllm_selfspec.plugin.patches`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from vllm_selfspec.config import SelfSpecSettings
from vllm_selfspec.control.controller import DraftLengthController, running_request_overrides
from vllm_selfspec.control.observation import SourceTotals, StepObservation, Verification
from vllm_selfspec.control.step_costs import StepCostRecorder
from vllm_selfspec.drafting.batch_forward import skip_model_logits
from vllm_selfspec.drafting.cost_feed import CostFeed
from vllm_selfspec.drafting.skip_forward import LayerSkipForward
from vllm_selfspec.errors import SelfSpecConfigError
from vllm_selfspec.layers.online_scoring import online_selector
from vllm_selfspec.plugin.engine_markers import ADDITIONAL_CONFIG_KEY
from vllm_selfspec.plugin.patches.model_runner import (
    install_worker_source_totals,
    patch_runner_cpu_discarded_generators,
    patch_runner_input_fits_in_drafter,
    patch_runner_sample_without_drafts,
)
from vllm_selfspec.plugin.runner_view import RunnerView, find_model_runner

logger = logging.getLogger("vllm.selfspec.proposer")

_DRAFT_SEED = 0x5E1F5BEC


class SelfSpecProposer:
    """Layer-skip self-drafting for vLLM's V1 model runner (``method="custom_class"``)."""

    def __init__(self, vllm_config: Any) -> None:
        raw = (vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            raise SelfSpecConfigError(
                "SelfSpecProposer got no selfspec settings: enable it with "
                "speculative_config={'method': 'selfspec', ...} (the vllm-selfspec plugin must be "
                "installed in every process)"
            )
        self.vllm_config = vllm_config
        self.settings = SelfSpecSettings.from_dict(raw)
        self.k_max = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.skip_attention = frozenset(self.settings.skip_attention)
        self.skip_mlp = frozenset(self.settings.skip_mlp)
        self.probabilistic = self.settings.draft_sampling == "probabilistic"

        runner = find_model_runner()
        patch_runner_input_fits_in_drafter(runner)
        patch_runner_cpu_discarded_generators(runner)
        patch_runner_sample_without_drafts(runner)
        install_worker_source_totals()
        self.runner_view = RunnerView(runner)
        self.device = self.runner_view.device
        self.controller = DraftLengthController.for_settings(self.settings, self.k_max)
        # Same seed on every TP rank: probabilistic drafts stay identical across ranks.
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(_DRAFT_SEED)

        self._target: torch.nn.Module | None = None
        self._forward: LayerSkipForward | None = None
        self._cost_feed = CostFeed(self.device)
        self._tp_rank = self._cost_feed.rank
        self._last_propose_end: float | None = None
        self._last_req_ids: list[str] = []
        self._costs = StepCostRecorder()
        self._draft_confidences: dict[str, list[float]] = {}
        self._next_log = time.monotonic() + _log_interval()
        self._bad_override_warned: set[str] = set()
        # On-the-fly layer selection (changes skip_attention / skip_mlp between draft rounds).
        self.online = online_selector(self.settings, self.runner_view, vllm_config, self.k_max,
                                      self._costs, self._tp_rank)
        self.source_totals = SourceTotals()  # the per-source Prometheus counters read them
        self.counters: dict[str, int] = {
            "steps": 0,
            "steps_with_drafts": 0,
            "draft_forwards": 0,
            "draft_tokens": 0,
            "rows_considered": 0,
            "rows_drafting": 0,
            "rows_off": 0,
            "steps_with_ragged_drafts": 0,
            "kv_overflow_clips": 0,
            "max_model_len_clips": 0,
            # rows whose draft stopped before its budget on the confidence exit (Draft & Verify)
            "confidence_exits": 0,
        }

    # --- vLLM hooks -----------------------------------------------------------------------------

    def load_model(self, target_model: torch.nn.Module) -> None:
        # Never stored as ``self.model``: vLLM treats ``drafter.model`` as a separate draft model.
        self._target = target_model
        self._forward = LayerSkipForward(target_model)
        for kind, indices in (("attention", self.skip_attention), ("MLP", self.skip_mlp)):
            bad = sorted(i for i in indices if not 0 <= i < self._forward.num_layers)
            if bad:
                raise SelfSpecConfigError(
                    f"skip_{kind.lower()} indices {bad} are out of range for a model with "
                    f"{self._forward.num_layers} layers"
                )
        logger.info(
            "selfspec drafter ready on TP rank %d: skipping attention %s and MLP %s of %d layers",
            self._tp_rank,
            sorted(self.skip_attention),
            sorted(self.skip_mlp),
            self._forward.num_layers,
        )
        if self.online is not None:
            self._use_skip_set(self.online.attach(self._forward, target_model))

    @torch.inference_mode()
    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        start = time.perf_counter()
        req_ids = self.runner_view.req_ids
        drafts: list[list[int]] = [[] for _ in req_ids]

        observation = self._observe(req_ids, sampled_token_ids)
        self.source_totals.add(observation)
        verified_drafts = observation.drafted
        self.controller.observe(observation)
        if self.online is not None:  # may switch the skip set, never inside a draft round
            self._online_step(observation)
        # The gap since the previous call is one verification step only while the same requests
        # keep decoding: a changed batch means prefills, or an idle engine waiting for requests,
        # either of which would make drafting look far cheaper than it is.
        if (self._last_propose_end is not None and req_ids == self._last_req_ids
                and all(sampled_token_ids)):
            self._costs.observe_verify(len(req_ids), verified_drafts,
                                       start - self._last_propose_end)
        self._last_req_ids = req_ids
        rows, budgets = self._plan(req_ids, sampled_token_ids, num_tokens_no_spec)
        self.counters["steps"] += 1
        if rows:
            self._draft(rows, budgets, req_ids, sampled_token_ids, num_tokens_no_spec, drafts)
        self._update_costs()
        self._maybe_log()
        self._last_propose_end = time.perf_counter()
        return drafts

    # --- per-step pieces --------------------------------------------------------------------------

    def _observe(self, req_ids: list[str], sampled: list[list[int]]) -> StepObservation:
        """This step's observation: the verified drafts (scheduled drafts of the rows that
        sampled; accepted: the sampled tokens but the bonus one) with their draft confidences,
        and the controller's cost table (rank 0's on every tensor-parallel rank)."""
        spec_token_ids = self.runner_view.spec_token_ids
        confidences = self._draft_confidences
        self._draft_confidences = {}
        verified = []
        for row, req_id in enumerate(req_ids):
            if not sampled[row]:
                continue
            drafted = sum(1 for t in spec_token_ids[row] if t >= 0)
            if drafted:
                verified.append(Verification(
                    req_id, drafted, min(len(sampled[row]) - 1, drafted),
                    tuple(confidences.get(req_id, [])[:drafted]),
                ))
        return StepObservation(
            req_ids=tuple(req_ids),
            decoding=tuple(bool(tokens) for tokens in sampled),
            verified=tuple(verified),
            costs=self.controller.step_costs,
        )

    def _online_step(self, observation: StepObservation) -> None:
        """Online layer selection's step."""
        assert self.online is not None
        new = self.online.step(observation)
        if new is not None:
            self._use_skip_set(new)

    def _use_skip_set(self, cand: Any) -> None:
        """Draft with ``cand`` from the next round on (online selection)."""
        assert self.online is not None and self.online.search is not None
        if (frozenset(cand.attention), frozenset(cand.mlp)) == (self.skip_attention,
                                                                 self.skip_mlp):
            return
        self.skip_attention = frozenset(cand.attention)
        self.skip_mlp = frozenset(cand.mlp)
        # the acceptance the controller learnt was the old set's: restart it from the new set's
        # matchness on the traffic (the same on every tensor-parallel rank: the search is)
        self.controller.restart_acceptance(self.online.search.matchness(cand))

    def _plan(
        self, req_ids: list[str], sampled: list[list[int]], num_tokens_no_spec: np.ndarray
    ) -> tuple[list[int], list[int]]:
        candidates = [row for row, s in enumerate(sampled) if s]
        if not candidates:
            return [], []
        cand_ids = [req_ids[row] for row in candidates]
        overrides = running_request_overrides(
            self.runner_view.extra_args, cand_ids, self.k_max, self._bad_override_warned
        )
        planned = self.controller.plan(cand_ids, overrides=overrides)
        rows: list[int] = []
        budgets: list[int] = []
        self.counters["rows_considered"] += len(candidates)
        for row, k in zip(candidates, planned, strict=True):
            if k <= 0:
                self.counters["rows_off"] += 1
                continue
            num_tokens = int(num_tokens_no_spec[row])
            position = num_tokens - 1  # the newest token: no K/V yet
            # Verification of position + k must stay inside max_model_len.
            room = self.max_model_len - num_tokens
            if room < k:
                self.counters["max_model_len_clips"] += 1
                k = room
            # Draft writes cover position .. position + k - 1: never past the allocated blocks.
            capacity = self.runner_view.kv_capacity(row)
            if position + k > capacity:
                self.counters["kv_overflow_clips"] += 1
                k = capacity - position
            if k > 0:
                rows.append(row)
                budgets.append(k)
        return rows, budgets

    def _draft(
        self,
        rows: list[int],
        budgets: list[int],
        req_ids: list[str],
        sampled: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        drafts: list[list[int]],
    ) -> None:
        assert self._forward is not None and self._target is not None
        rows_np = np.asarray(rows, dtype=np.int64)
        budgets_np = np.asarray(budgets, dtype=np.int64)
        base_pos = num_tokens_no_spec[rows_np].astype(np.int64) - 1
        tokens = np.asarray([sampled[row][-1] for row in rows], dtype=np.int64)
        temperatures = self.runner_view.temperature_cpu[rows_np].astype(np.float32)
        sample_mask = (temperatures > 0) if self.probabilistic else np.zeros(len(rows), bool)
        top_k, top_p = self.runner_view.top_k_top_p(rows_np) if sample_mask.any() else (None, None)
        alive = np.ones(len(rows), dtype=bool)
        max_k = int(budgets_np.max())
        probs_buffer = None
        if sample_mask.any():
            probs_buffer = torch.zeros(
                (len(rows), max_k, self._vocab_size()), dtype=torch.float32, device=self.device
            )
        forwards = 0
        confidences: dict[str, list[float]] = {req_ids[row]: [] for row in rows}
        for step in range(max_k):
            active = np.nonzero(alive & (budgets_np > step))[0]
            if active.size == 0:
                break
            forward_start = time.perf_counter()
            positions = base_pos[active] + step
            logits = self._draft_forward(rows_np[active], positions, tokens[active], step)
            forwards += 1
            next_tokens, confidence, probs = self._pick_tokens(
                logits, temperatures[active], sample_mask[active],
                None if top_k is None else top_k[active], None if top_p is None else top_p[active],
            )
            next_np = next_tokens.cpu().numpy()  # waits for the device: the timing is complete
            conf_np = confidence.cpu().numpy()
            self._costs.observe_draft(len(active), time.perf_counter() - forward_start)
            if probs_buffer is not None:
                if probs is None:
                    # Only greedy rows are still drafting at this step (the sampled rows stopped
                    # earlier or had smaller budgets): their draft distribution is one-hot.
                    probs = torch.zeros(
                        (len(active), probs_buffer.shape[-1]),
                        dtype=probs_buffer.dtype,
                        device=self.device,
                    ).scatter_(1, next_tokens.view(-1, 1), 1.0)
                probs_buffer[torch.from_numpy(active).to(self.device), step] = probs
            for i, local in enumerate(active):
                row = rows[local]
                drafts[row].append(int(next_np[i]))
                confidences[req_ids[row]].append(float(conf_np[i]))
                if self.controller.should_stop(req_ids[row], float(conf_np[i])):
                    alive[local] = False
                    if step + 1 < budgets[local]:
                        self.counters["confidence_exits"] += 1
            tokens[active] = next_np
        self._draft_confidences = confidences
        if probs_buffer is not None:
            self.runner_view.set_draft_probs(probs_buffer, [req_ids[row] for row in rows])
        lengths = {len(drafts[row]) for row in rows}
        self.counters["steps_with_drafts"] += 1
        self.counters["draft_forwards"] += forwards
        self.counters["rows_drafting"] += len(rows)
        self.counters["draft_tokens"] += sum(len(drafts[row]) for row in rows)
        if len(lengths) > 1:
            self.counters["steps_with_ragged_drafts"] += 1

    def _vocab_size(self) -> int:
        return int(self.vllm_config.model_config.get_vocab_size())

    def _draft_forward(
        self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray, step: int
    ) -> torch.Tensor:
        """One draft decode step for ``rows``; returns their logits ``[len(rows), vocab]``."""
        num = len(rows)
        return self.run_skip_model(
            rows=rows,
            row_of_token=rows,
            positions=positions,
            tokens=tokens,
            query_start_cpu=torch.arange(num + 1, dtype=torch.int32),
            seq_lens_cpu=torch.from_numpy((positions + 1).astype(np.int32)),
            max_query_len=1,
            skip_attention=self.skip_attention,
            skip_mlp=self.skip_mlp,
            step=step,
        )

    def run_skip_model(self, **kwargs: Any) -> torch.Tensor:
        """Logits of the model with the given sub-layers skipped over rows of the input batch
        (:func:`vllm_selfspec.drafting.batch_forward.skip_model_logits`)."""
        assert self._forward is not None and self._target is not None
        return skip_model_logits(
            self.runner_view, self.vllm_config, self._forward, self._target, **kwargs
        )

    def _pick_tokens(
        self,
        logits: torch.Tensor,
        temperatures: np.ndarray,
        sample_mask: np.ndarray,
        top_k: np.ndarray | None = None,
        top_p: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Draft tokens, their draft probability (confidence), and the draft distributions.

        Greedy rows (and all rows with ``draft_sampling="argmax"``) take the argmax. Rows with
        temperature > 0 sample from ``q``: the distribution their request samples from,
        ``softmax(logits / T)`` truncated to its top-k / top-p as vLLM's sampler truncates it
        (``top_k`` / ``top_p``: per row, None where no row sets them). vLLM's rejection sampler
        then gets ``q`` and keeps the output distribution exactly the target's. (Drawn from the
        untruncated distribution, a request with top-k or top-p, e.g. every request to a model
        whose generation config sets them, drafted tokens its target never emits.)
        """
        logits = logits.float()
        if not sample_mask.any():
            probs = torch.softmax(logits, dim=-1)
            confidence, tokens = probs.max(dim=-1)
            return tokens, confidence, None
        temps = torch.from_numpy(np.where(sample_mask, temperatures, 1.0)).to(logits.device)
        scaled = logits / temps.unsqueeze(-1)
        if top_k is not None or top_p is not None:
            scaled = _truncate(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        greedy_tokens = probs.argmax(dim=-1)
        # Exponential-race sampling: argmax(q / E) with E ~ Exp(1) draws from q.
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        sampled_tokens = (probs / noise).argmax(dim=-1)
        mask_t = torch.from_numpy(sample_mask).to(logits.device)
        tokens = torch.where(mask_t, sampled_tokens, greedy_tokens)
        # Greedy rows are drafted deterministically: their "distribution" is one-hot.
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_tokens.unsqueeze(1), 1.0)
        draft_probs = torch.where(mask_t.unsqueeze(1), probs, one_hot)
        confidence = probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, confidence, draft_probs

    # --- costs, logging, introspection -----------------------------------------------------------

    def _update_costs(self) -> None:
        """Hand the controller the measured cost table (rank 0's on every TP rank)."""
        self._cost_feed.step(self._costs, self.controller)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now < self._next_log:
            return
        self._next_log = now + _log_interval()
        if self._tp_rank != 0:
            return
        stats = self.controller.stats()
        self.controller.reset_stats_window()
        logger.info("selfspec: %s", ", ".join(f"{k}={_fmt(v)}" for k, v in stats.items()))

    def stats(self) -> dict[str, Any]:
        """Counters and controller state (read by tests and the worker extension)."""
        costs = self._costs.snapshot()
        batch = max(1, len(self._last_req_ids))
        plain = costs.plain_cost(batch) if costs.verify else None
        return {
            **self.counters,
            "controller": self.controller.stats(),
            # medians measured on this worker, for the batch size of the latest step
            "draft_cost_s": float(costs.draft_cost(batch, batch)) if costs.draft else None,
            "plain_step_s": plain if costs.has_plain(batch) else None,
            "verify_cost_s": {f"{x:g}": c for (b, x), c in sorted(costs.verify.items())
                              if b == costs._verify_bucket(batch)},
            # the whole table: "bucket:x" -> verification step, "bucket" -> one draft forward
            "cost_table": {
                "verify": {f"{b}:{x:g}": c for (b, x), c in sorted(costs.verify.items())},
                "draft": {str(b): c for b, c in sorted(costs.draft.items())},
            },
            "skip_attention": sorted(self.skip_attention),
            "skip_mlp": sorted(self.skip_mlp),
            "k_max": self.k_max,
            "online": self.online.stats() if self.online is not None else None,
        }


def _truncate(
    scaled: torch.Tensor, top_k: np.ndarray | None, top_p: np.ndarray | None
) -> torch.Tensor:
    """vLLM's own top-k / top-p truncation of temperature-scaled logits (what its sampler
    applies), masked entries ``-inf``."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    device = scaled.device
    k = None if top_k is None else torch.from_numpy(np.asarray(top_k, np.int32)).to(device)
    p = None if top_p is None else torch.from_numpy(np.asarray(top_p, np.float32)).to(device)
    return apply_top_k_top_p(scaled, k, p)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _log_interval() -> float:
    try:
        import vllm.envs as envs

        return float(envs.VLLM_LOG_STATS_INTERVAL)
    except Exception:  # pragma: no cover - older/newer vLLM
        return 10.0
