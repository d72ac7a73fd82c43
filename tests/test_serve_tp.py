"""`vllm serve --tensor-parallel-size 2` (multiprocessing backend) with selfspec: greedy = TP=1.

On CPU each rank gets one core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``); see
/work/shared/design/cpu-platform.md. The reference is a plain TP=1 engine in this process.
"""

from __future__ import annotations

import pytest

from tests.api_server import (
    SERVED_MODEL_NAME,
    api_server,
    free_port,
    metric_value,
    server_command,
)
from tests.engine_utils import engine, token_ids

pytestmark = pytest.mark.engine

PROMPTS = [[5, 77, 301, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 400, 401], [33] * 20, [100, 200, 300],
           list(range(40, 200, 3))]
MAX_TOKENS = 40
SPEC = {"method": "selfspec", "skip_attention": [3, 5], "skip_mlp": [6],
        "num_speculative_tokens": 4, "adaptive": False}


def test_tp2_server_greedy_identical_to_tp1():
    import openai
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.tiny_models import tiny_model_dir

    model_dir = tiny_model_dir("e2e-llama", arch="llama", num_layers=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with engine(model_dir) as llm:
        reference = token_ids(llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                                           params, use_tqdm=False))

    port = free_port()
    cmd = server_command(model_dir, port, SPEC, extra_args=[
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"])
    with api_server(cmd, port, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, name="tp2") as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="none", max_retries=0,
                               timeout=300)
        extra = {"ignore_eos": True, "return_token_ids": True}
        batch = client.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPTS,
                                          max_tokens=MAX_TOKENS, temperature=0.0,
                                          extra_body=extra)
        got = [c.token_ids for c in sorted(batch.choices, key=lambda c: c.index)]
        streamed = []
        for chunk in client.completions.create(model=SERVED_MODEL_NAME, prompt=PROMPTS[1],
                                               max_tokens=MAX_TOKENS, temperature=0.0,
                                               stream=True, extra_body=extra):
            streamed += chunk.choices[0].token_ids or []
        m = server.metrics()
    assert got == reference
    assert streamed == reference[1]
    assert metric_value(m, "vllm:spec_decode_num_draft_tokens_total") > 0
