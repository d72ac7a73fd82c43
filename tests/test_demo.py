"""The README's demo runs end to end (tiny model, two prompts) and reports identical outputs."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def test_demo_runs_and_outputs_match(capsys):
    from vllm_selfspec import demo
    from vllm_selfspec.testing.tiny_models import tiny_model_dir

    model_dir = tiny_model_dir("e2e-llama", arch="llama", num_layers=8)
    code = demo.main(
        [
            "--model", str(model_dir),
            "--num-prompts", "2",
            "--max-tokens", "12",
            "--repeats", "1",
            "--max-model-len", "1024",
            "--speculative-config",
            '{"method": "selfspec", "skip_attention": [5], "adaptive": false}',
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical   : 2/2" in out
    assert "acceptance rate" in out and "speedup" in out
