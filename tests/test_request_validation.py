"""Per-request selfspec overrides are checked when the request arrives, in the front end.

One plain engine gives the greedy reference. On a selfspec ``LLM`` (k_max 4) an invalid override
makes ``LLM.generate`` raise a ``ValueError`` that names the key and the reason, no request of
that batch stays in the engine, nothing reaches the worker (its drafter, which would log and
ignore the override, never sees one: the negative control switches the front-end check off and
shows that the drafter then does), and valid overrides give the plain output and are honoured
(a cap of 0 drafts nothing, a cap of 1 at most one token per step). On a selfspec OpenAI server
invalid ``vllm_xargs`` overrides get HTTP 400 with the key and the reason (completions and chat,
streamed or not), valid ones 200 with the plain tokens, and the server stays healthy.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_utils import MetricsWindow, engine, token_ids
from vllm_selfspec.plugin.worker_ext import SelfSpecWorkerExtension

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 192
NUM_LAYERS = 8
ZERO_LAYERS = [2, 5]  # the model of test_e2e_greedy: skipping these sub-layers is exact
K_MAX = 4
SPEC = {
    "method": "selfspec",
    "skip_attention": [*ZERO_LAYERS, 6],
    "skip_mlp": ZERO_LAYERS,
    "num_speculative_tokens": K_MAX,
}
MAX_TOKENS = 24
TEXTS = ["It was a bright cold day in April", "The quick brown fox", "Once upon a time there"]

# (extra_args, key named in the error, words of the reason)
INVALID_LLM: list[tuple[dict[str, Any], str, str]] = [
    ({"selfspec": {"num_speculative_tokens": K_MAX + 1}}, "selfspec.num_speculative_tokens",
     f"exceeds the configured maximum of {K_MAX}"),
    ({"selfspec": {"num_speculative_tokens": -1}}, "selfspec.num_speculative_tokens",
     "must be an int >= 0"),
    ({"selfspec": {"adaptive": "yes"}}, "selfspec.adaptive", "must be a bool"),
    ({"selfspec": {"k": 2}}, "selfspec.k", "unknown selfspec override key 'k'"),
    ({"selfspec": [2]}, "selfspec", "must be a dict"),
    ({"selfspec_draft_confidence_threshold": 1.5}, "selfspec_draft_confidence_threshold",
     "must be a number in [0, 1]"),
    ({"selfspec": {"adaptive": False}, "selfspec_adaptive": 0}, "selfspec", "not both"),
]
# vllm_xargs (flat keys) sent to the server: (kind, stream, xargs, key, reason)
INVALID_HTTP: list[tuple[str, bool, dict[str, Any], str, str]] = [
    ("cmpl", False, {"selfspec_num_speculative_tokens": -3}, "selfspec_num_speculative_tokens",
     "must be an int >= 0"),
    ("cmpl", True, {"selfspec_num_speculative_tokens": K_MAX + 5},
     "selfspec_num_speculative_tokens", f"exceeds the configured maximum of {K_MAX}"),
    ("chat", False, {"selfspec_bogus": 1}, "selfspec_bogus", "unknown selfspec override key"),
    ("chat", True, {"selfspec_adaptive": "maybe"}, "selfspec_adaptive", "must be a bool"),
    ("cmpl", True, {"selfspec_draft_confidence_threshold": 2},
     "selfspec_draft_confidence_threshold", "must be a number in [0, 1]"),
]
VALID_XARGS: list[dict[str, Any]] = [
    {"selfspec_num_speculative_tokens": 0},
    {"selfspec_num_speculative_tokens": K_MAX, "selfspec_adaptive": 0},
    {"selfspec_adaptive": "false", "selfspec_draft_confidence_threshold": 0.2},
]


@pytest.fixture(scope="module")
def model_dir():
    from tests.tiny_models import tiny_model_dir

    return tiny_model_dir(
        "e2e-zero", arch="llama", num_layers=NUM_LAYERS, zero_output_layers=ZERO_LAYERS
    )


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def _params(extra_args: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          extra_args=extra_args)


def _token_prompts(prompts: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


@pytest.fixture(scope="module")
def reference(model_dir, prompts) -> list[list[int]]:
    """Plain vLLM's greedy tokens of ``prompts``."""
    with engine(model_dir, None, max_model_len=MAX_MODEL_LEN) as llm:
        return token_ids(llm.generate(_token_prompts(prompts), _params(), use_tqdm=False))


class OverrideProbe(SelfSpecWorkerExtension):
    """Worker extension of the selfspec engine below."""

    def bad_overrides_seen(self) -> int:
        """Requests whose overrides the drafter found invalid (and ignored with a log line)."""
        return len(self.model_runner.drafter._bad_override_warned)


@pytest.fixture(scope="module")
def spec_llm(model_dir, reference):
    probe = f"{__name__}.{OverrideProbe.__name__}"
    with engine(model_dir, SPEC, max_model_len=MAX_MODEL_LEN, worker_extension_cls=probe) as llm:
        yield llm


def test_llm_refuses_invalid_overrides(spec_llm, prompts, reference, monkeypatch):
    from vllm.exceptions import VLLMValidationError

    batch = _token_prompts(prompts)
    for extra, key, reason in INVALID_LLM:
        # the bad request comes last in its batch: the ones before it were already added
        params = [_params(), _params(), _params(extra)]
        with pytest.raises(ValueError) as info:
            spec_llm.generate(batch, params, use_tqdm=False)
        message = str(info.value)
        assert repr(key) in message and reason in message, (extra, message)
        assert isinstance(info.value, VLLMValidationError) and info.value.parameter == key
        assert not spec_llm.llm_engine.has_unfinished_requests(), extra
    assert spec_llm.collective_rpc("bad_overrides_seen") == [0]
    # the engine keeps serving, with plain vLLM's output
    assert token_ids(spec_llm.generate(batch, _params(), use_tqdm=False)) == reference

    # negative control: without the front-end check the bad override reaches the drafter,
    # which ignores it and drafts with the defaults; the client learns nothing
    from vllm.v1.engine.input_processor import InputProcessor

    monkeypatch.setattr(InputProcessor, "_validate_params",
                        InputProcessor._validate_params.__wrapped__)
    out = spec_llm.generate(batch[:1], _params(INVALID_LLM[0][0]), use_tqdm=False)
    assert token_ids(out) == reference[:1]
    assert spec_llm.collective_rpc("bad_overrides_seen") == [1]


def test_llm_valid_overrides_identical_and_honoured(spec_llm, prompts, reference):
    batch = _token_prompts(prompts)
    valid = [
        {"selfspec": {"num_speculative_tokens": K_MAX, "adaptive": False}},
        {"selfspec": {"draft_confidence_threshold": 0.0}},
        {"selfspec_num_speculative_tokens": "2", "selfspec_adaptive": 0},
    ]
    window = MetricsWindow(spec_llm)
    assert token_ids(spec_llm.generate(batch, [_params(v) for v in valid],
                                       use_tqdm=False)) == reference
    assert window.delta()["num_draft_tokens"] > 0  # drafts were verified
    # cap 0: drafting off for these requests
    window = MetricsWindow(spec_llm)
    off = _params({"selfspec": {"num_speculative_tokens": 0}})
    assert token_ids(spec_llm.generate(batch, off, use_tqdm=False)) == reference
    assert window.delta()["num_draft_tokens"] == 0
    # cap 1 without adaptive exits: exactly one draft token per drafting step
    window = MetricsWindow(spec_llm)
    one = _params({"selfspec": {"num_speculative_tokens": 1, "adaptive": False}})
    assert token_ids(spec_llm.generate(batch, one, use_tqdm=False)) == reference
    d = window.delta()
    assert d["num_drafts"] > 0 and d["num_draft_tokens"] == d["num_drafts"], d


# --- OpenAI server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_server(model_dir, spec_llm):
    """Starts after the LLM tests (the LLM engine is shut down at module end, not before)."""
    from tests.api_server import api_server, free_port, server_command

    port = free_port()
    cmd = server_command(model_dir, port, SPEC, max_model_len=MAX_MODEL_LEN)
    with api_server(cmd, port, name="selfspec-validation") as server:
        yield server


def _post(server: Any, kind: str, prompt: list[int], xargs: dict[str, Any] | None,
          stream: bool = False) -> tuple[int, Any]:
    import httpx

    from tests.api_server import SERVED_MODEL_NAME

    body: dict[str, Any] = {
        "model": SERVED_MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if kind == "cmpl":
        path = "/v1/completions"
        body.update(prompt=prompt, return_token_ids=True)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": TEXTS[0]}]
    if xargs is not None:
        body["vllm_xargs"] = xargs
    r = httpx.post(server.base_url + path, json=body, timeout=300.0)
    if stream and r.status_code == 200:
        return 200, r.text
    return r.status_code, r.json()


def test_server_answers_400_for_invalid_overrides(spec_server, prompts, reference):
    for kind, stream, xargs, key, reason in INVALID_HTTP:
        status, body = _post(spec_server, kind, prompts[0], xargs, stream=stream)
        assert status == 400, (kind, stream, xargs, status, body)
        error = body["error"]
        assert repr(key) in error["message"] and reason in error["message"], error
        assert error["param"] == key, error
    assert spec_server.alive() and spec_server.healthy(), spec_server.log_tail()
    # valid overrides: 200 and plain vLLM's tokens
    for i, xargs in enumerate(VALID_XARGS):
        status, body = _post(spec_server, "cmpl", prompts[i], xargs)
        assert status == 200, (xargs, body)
        assert body["choices"][0]["token_ids"] == reference[i], xargs
    status, body = _post(spec_server, "chat", prompts[0], VALID_XARGS[1], stream=True)
    assert status == 200 and "[DONE]" in body and '"error"' not in body, body[-500:]
    assert spec_server.healthy(), spec_server.log_tail()
    log = spec_server.log_tail(10_000)
    assert "ignoring extra_args['selfspec']" not in log  # nothing invalid reached the drafter
