"""End-to-end check of ``selfspec-profile``'s ``--confirm`` path with real CPU vLLM engines."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from tests.tiny_models import tiny_model_dir  # noqa: E402
from vllm_selfspec.layers.search.confirm import acceptance_from_counters, confirm_candidates  # noqa: E402
from vllm_selfspec.layers.skip_set import SkipSet  # noqa: E402


def test_acceptance_from_counters() -> None:
    # k=3: 10 rounds; position 0 accepted 6x, position 1 4x, position 2 2x
    acc = acceptance_from_counters(
        {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12,
         "num_accepted_tokens_per_pos": [6, 4, 2]}, 3)
    assert acc["acceptance_rate"] == pytest.approx(12 / 30)
    assert acc["per_token_acceptance"] == pytest.approx(12 / (10 + 6 + 4))
    assert acc["mean_accepted_length"] == pytest.approx(2.2)
    assert acc["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])


@pytest.mark.engine
def test_confirm_zero_output_layers_accepts_everything() -> None:
    model = tiny_model_dir("search-zero", arch="llama", num_layers=8, zero_output_layers=[2, 5])
    prompts = ["The quick brown fox", "Write a function that returns the sum of two numbers."]
    report = confirm_candidates(
        str(model), prompts, [(SkipSet.of([2, 5], [2, 5]), 4)],
        max_tokens=24, enforce_eager=True, max_model_len=192, log=lambda _: None,
    )
    (exact,) = report["candidates"]
    assert exact["per_token_acceptance"] == 1.0 and exact["acceptance_rate"] == 1.0
    assert exact["identical_outputs"] == len(prompts)
    assert exact["identical_outputs_adaptive"] == len(prompts)
    assert exact["identical_outputs_off"] == len(prompts)
    assert exact["off_tokens_per_s"] > 0 and 0 < exact["vllm_draft_cost_ratio"] < 5
    assert report["plain_tokens_per_s"] > 0 and exact["adaptive_tokens_per_s"] > 0
