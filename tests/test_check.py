"""``python -m vllm_selfspec.check``, the self-check users run on their hardware (CPU, tiny model).

The check runs as a subprocess, as users run it, in float32 (a random-weight model has near ties).
The model has two layers with zero output projections: a config that skips exactly those drafts
exactly, so every output must match and drafts must land. One run is in vLLM's default (compiled)
mode with that config, given without ``"method"`` (the check adds it). The negative control runs
the default config with an injected fault (``tests/fault_site``: a selfspec runner samples a wrong
first token in every row; plain engines are untouched), which the check must report: exit code 1
and a FAIL verdict. Each run starts two engines; the fault run is eager to save compile time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

NUM_PROMPTS = 3
COMPARED = 2 * NUM_PROMPTS  # the timed pass at batch size 1 and the batched pass
ZERO_LAYERS = [2, 5]
TIMEOUT_S = 600
FAULT_SITE = Path(__file__).parent / "fault_site"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir("e2e-zero", arch="llama", num_layers=8, zero_output_layers=ZERO_LAYERS)


def run_check(model: Path, *extra: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    cmd = [
        sys.executable, "-m", "vllm_selfspec.check", "--model", str(model),
        "--dtype", "float32", "--max-model-len", "192", "--max-tokens", "16",
        "--num-prompts", str(NUM_PROMPTS), "--repeats", "1", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine-core processes too
        log, _ = proc.communicate()
        pytest.fail(f"the check did not finish in {TIMEOUT_S} s:\n{log[-4000:]}")
    return proc.returncode, log


def test_check_passes_in_default_mode(model_dir, tmp_path):
    result_path = tmp_path / "check.json"
    spec = {"skip_attention": ZERO_LAYERS, "skip_mlp": ZERO_LAYERS, "num_speculative_tokens": 4,
            "adaptive": False}  # fmt: skip
    rc, log = run_check(
        model_dir, "--speculative-config", json.dumps(spec), "--json", str(result_path)
    )
    tail = log[-4000:]
    assert rc == 0, tail
    verdict = log.rstrip().splitlines()[-1]  # the last line, after every engine log
    assert re.fullmatch(rf"selfspec check: PASS \(outputs identical {COMPARED}/{COMPARED}; "
                        r"\d+\.\d\dx plain(; WARNING: slower than plain decoding)?\)",
                        verdict), tail  # fmt: skip
    result = json.loads(result_path.read_text())
    assert result["speculative_config"] == {"method": "selfspec", **spec}, result
    assert result["dtype"] == "float32", result
    assert result["outputs_compared"] == result["outputs_identical"] == COMPARED, result
    assert result["num_draft_tokens"] > 0 and result["acceptance_rate"] > 0.5, result
    # hybrid drafts (the default): the split by source adds up to vLLM's counters
    by_source = result["by_source"]
    assert sum(c["num_draft_tokens"] for c in by_source.values()) == result["num_draft_tokens"]
    assert by_source["layer_skip"]["num_draft_tokens"] > 0, result
    assert result["draft_cost_s"] is not None and result["draft_cost_s"] > 0, result
    assert result["plain_tokens_per_s"] > 0 and result["selfspec_tokens_per_s"] > 0, result
    assert f"outputs identical   : {COMPARED}/{COMPARED}" in log, tail
    for line in ("acceptance rate", "mean accepted length", "draft cost ratio",
                 "tokens/s ratio", "drafts by source    : "):  # fmt: skip
        assert line in log, (line, tail)
    assert "Enforce eager" not in log, tail  # vLLM's default mode, not eager


def test_check_catches_a_wrong_token(model_dir):
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAULT_SITE),
                                                        os.environ.get("PYTHONPATH")])),
           "SELFSPEC_INJECT_FAULT": "wrong_token"}  # fmt: skip
    rc, log = run_check(model_dir, "--enforce-eager", env=env)
    tail = log[-4000:]
    assert rc == 1, tail
    verdict = log.rstrip().splitlines()[-1]
    assert verdict == f"selfspec check: FAIL ({COMPARED}/{COMPARED} outputs differ from plain " \
                      "decoding)", tail  # fmt: skip
    assert 'running selfspec {"method": "selfspec"} ...' in log, tail  # the default config
    assert "hint:" not in log, tail  # float32: no rounding hint


def test_check_rejects_another_method():
    from vllm_selfspec.check import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "unused", "--speculative-config", '{"method": "ngram"}'])
    assert exc.value.code == 2
