"""The README's first command, ``python -m vllm_selfspec.tools.demo``, on its real model.

The demo runs as a subprocess, as the README runs it: SmolLM2-135M-Instruct from the PyPI wheel,
converted once (cached; test_assets.py converts it first in a full run), real MT-bench and
HumanEval prompts, a plain engine and a selfspec engine with the shipped SmolLM2 profile (found by
its fingerprint), both in vLLM's default (compiled) mode as the README runs them. Kept short: two
prompts, 32 greedy tokens, one timed pass.

Drafting is asserted, not assumed: the run fails if vLLM verified no draft tokens, accepted none,
or any output differs from plain decoding. Adaptive drafting is switched off for this run: the
shipped profile skips one attention sub-layer of 30, so on a CPU a draft costs about a plain step
and the controller's choice to draft follows timing noise (both outcomes are correct; only one
says anything about losslessness on the real model). The adaptive path is asserted on tiny models
whose drafts pay (tests/test_e2e_greedy.py, tests/test_online_engine.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from vllm_selfspec.layers.profiles import load_profile

pytestmark = pytest.mark.engine

NUM_PROMPTS = 2
MAX_TOKENS = 32
TIMEOUT_S = 1200  # a cold run converts the model first


def test_readme_demo_drafts_and_matches_plain(tmp_path):
    result_path = tmp_path / "demo.json"
    cmd = [
        sys.executable, "-m", "vllm_selfspec.tools.demo",
        "--num-prompts", str(NUM_PROMPTS),
        "--max-tokens", str(MAX_TOKENS),
        "--repeats", "1",
        "--speculative-config",
        '{"method": "selfspec", "num_speculative_tokens": 4, "adaptive": false}',
        "--json", str(result_path),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "INFO"}  # the drafter logs its skip set
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine-core processes too
        log, _ = proc.communicate()
        pytest.fail(f"the demo did not finish in {TIMEOUT_S} s:\n{log[-4000:]}")
    tail = log[-4000:]
    assert proc.returncode == 0, tail
    result = json.loads(result_path.read_text())
    assert result["model"].endswith("SmolLM2-135M-Instruct"), result
    assert result["num_prompts"] == NUM_PROMPTS, result
    assert min(result["output_tokens"]) >= MAX_TOKENS // 2, result  # real outputs, not empty
    assert result["num_draft_tokens"] > 0, result
    assert result["num_accepted_tokens"] > 0, result
    assert result["outputs_identical"] == NUM_PROMPTS, result
    # the split by draft source adds up to vLLM's counters (hybrid drafts, the default: layer
    # skip every step with k fixed, prompt lookup where a lookup pays more)
    by_source = result["by_source"]
    assert sum(c["num_draft_tokens"] for c in by_source.values()) == result[
        "num_draft_tokens"], result
    assert by_source["layer_skip"]["num_draft_tokens"] > 0, result
    assert "drafts by source    : " in log and "layer_skip " in log, tail
    assert "both engines in vLLM's default (compiled) mode" in log, tail
    assert f"outputs identical   : {NUM_PROMPTS}/{NUM_PROMPTS}" in log, tail
    assert "acceptance rate" in log and "speedup" in log, tail
    # the converted model matched the shipped profile's fingerprint: its skip set drafted
    profile = load_profile("smollm2-135m-instruct")  # as installed (top-level profiles/)
    n = profile.model.num_hidden_layers
    ready = (f"skipping {len(profile.skip_attention)}/{n} attention and "
             f"{len(profile.skip_mlp)}/{n} MLP sub-layers (shipped profile "
             f"'{profile.name}' matched")
    assert ready in log, tail
