"""`vllm serve` with selfspec, end to end: the OpenAI API, /metrics, and a load burst.

One plain server of the tiny model runs every request first (the reference; it is stopped before
the next server starts), then one selfspec server runs the same requests, driven with the official
``openai`` client: completions and chat completions, streaming and not, ``n > 1``, stop strings,
stop token ids, logprobs, max_tokens running into max_model_len, per-request draft caps through
``vllm_xargs``. Greedy responses must be identical (token ids, text, finish reasons; logprob values
to 1e-3). Then /metrics must show vLLM's spec-decode counters and the plugin's own metrics, and a
burst of concurrent mixed requests (greedy, sampled, clients that disconnect mid-stream) must leave
the server up, idle and at its memory level, with every completed greedy response equal to plain.

On the CPU build the server is ``python -m vllm.entrypoints.openai.api_server`` (same flags as
``vllm serve``).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import pytest

from vllm_selfspec.testing.serve import (
    SERVED_MODEL_NAME,
    api_server,
    free_port,
    metric_value,
    server_command,
)

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 192
NUM_LAYERS = 8
ZERO_LAYERS = [2, 5]  # o_proj/down_proj zeroed: skipping them is exact
K = 4
# Zero-output layers plus one real attention sub-layer: drafts are often, not always, accepted
# (acceptance ~0.7 on this model), so the adaptive controller keeps drafting and rejections occur.
SPEC_CONFIG = {
    "method": "selfspec",
    "skip_attention": [*ZERO_LAYERS, 6],
    "skip_mlp": ZERO_LAYERS,
    "num_speculative_tokens": K,
}
LOGPROB_ABS_TOL = 1e-3  # fp32; verification runs k+1 tokens per request where plain runs one
# The burst (see test_load_burst)
LOAD_REQUESTS = 72
LOAD_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0
# The abort test (see test_disconnected_streams_are_aborted): the tiny model's position limit
ABORT_MAX_MODEL_LEN = 1024
# RSS of the server's process tree after a burst vs before it (see test_load_burst)
RSS_TOLERANCE_REL = 0.10
RSS_TOLERANCE_ABS = 256 << 20


# --- the requests -------------------------------------------------------------------------------


def _corpus_prompts() -> list[str]:
    from vllm_selfspec.testing.tiny_models import tokenizer_corpus

    return [line.strip() for line in tokenizer_corpus() if line.strip()]


def _token_prompt(n: int, offset: int = 0) -> list[int]:
    """A prompt of n token ids (ids of the tokenizer corpus)."""
    ids = _corpus_ids()
    return [ids[(offset + i) % len(ids)] for i in range(n)]


_IDS: list[int] = []


def _corpus_ids() -> list[int]:
    if not _IDS:
        from vllm_selfspec.testing.tiny_models import (
            SPECIAL_TOKENS,
            build_tiny_tokenizer,
            tokenizer_corpus,
        )

        tok = build_tiny_tokenizer()
        for line in tokenizer_corpus():
            _IDS.extend(tok(line, add_special_tokens=False)["input_ids"])
        _IDS[:] = [i for i in _IDS if i >= len(SPECIAL_TOKENS)]  # no special tokens
    return _IDS


GREEDY = {"temperature": 0.0}
# vLLM refuses n > 1 with greedy sampling. top_k=1 at temperature 1 samples the argmax, so the
# output is still deterministic and must equal plain decoding; it runs vLLM's random-sampling and
# rejection-sampling path (selfspec samples such drafts from its draft distribution).
ARGMAX_SAMPLED = {"temperature": 1.0}  # with _xb(top_k=1)


def _xb(**extra: Any) -> dict[str, Any]:
    """extra_body with ignore_eos + return_token_ids + ``extra``."""
    return {"extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def functional_requests(stops: dict[str, list[str]]) -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (endpoint, kwargs for the openai client); ``stops`` from :func:`pick_stops`."""
    prompts = _corpus_prompts()
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": prompts[10]},
    ]
    lp = {"logprobs": 3}
    reqs: dict[str, tuple[str, dict[str, Any]]] = {}
    for i, (p, n) in enumerate(zip(prompts[:6], [40, 25, 7, 1, 60, 33], strict=True)):
        reqs[f"cmpl_{i}"] = ("cmpl", {"prompt": p, "max_tokens": n, **GREEDY, **lp, **_xb()})
        reqs[f"cmpl_stream_{i}"] = (
            "cmpl",
            {"prompt": p, "max_tokens": n, "stream": True, **GREEDY, **lp, **_xb()},
        )
    reqs["cmpl_batch_prompts"] = (
        "cmpl",
        {"prompt": prompts[6:10], "max_tokens": 30, **GREEDY, **_xb()},
    )
    reqs["cmpl_token_prompt"] = (
        "cmpl",
        {"prompt": _token_prompt(50, 7), "max_tokens": 40, **GREEDY, **_xb()},
    )
    n_cmpl = {"max_tokens": 30, "n": 3, **ARGMAX_SAMPLED, **_xb(top_k=1)}
    reqs["cmpl_n3"] = ("cmpl", {"prompt": prompts[1], **n_cmpl})
    reqs["cmpl_n3_stream"] = ("cmpl", {"prompt": prompts[2], "stream": True, **n_cmpl})
    reqs["chat"] = (
        "chat",
        {
            "messages": chat,
            "max_tokens": 40,
            "logprobs": True,
            "top_logprobs": 2,
            **GREEDY,
            **_xb(),
        },
    )
    reqs["chat_stream"] = (
        "chat",
        {
            "messages": chat,
            "max_tokens": 40,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
            **GREEDY,
            **_xb(),
        },
    )
    n_chat = {"messages": chat, "max_tokens": 25, "n": 2, **ARGMAX_SAMPLED, **_xb(top_k=1)}
    reqs["chat_n2"] = ("chat", n_chat)
    reqs["chat_n2_stream"] = ("chat", {**n_chat, "stream": True})
    reqs["chat_eos"] = (  # may end on <|im_end|> / EOS: finish reasons must agree too
        "chat",
        {
            "messages": chat[1:],
            "max_tokens": 60,
            **GREEDY,
            "extra_body": {"return_token_ids": True},
        },
    )
    # stop strings picked from the plain output (so they do occur), streaming and not
    for i, stop in stops.items():
        base = {"prompt": prompts[int(i)], "max_tokens": 60, "stop": stop, **GREEDY, **_xb()}
        reqs[f"stop_{i}"] = ("cmpl", base)
        reqs[f"stop_stream_{i}"] = ("cmpl", {**base, "stream": True})
        reqs[f"stop_incl_{i}"] = ("cmpl", {**base, **_xb(include_stop_str_in_output=True)})
    reqs["stop_token_ids"] = (
        "cmpl",
        {
            "prompt": prompts[3],
            "max_tokens": 60,
            **GREEDY,
            **_xb(stop_token_ids=_corpus_ids()[20:60:3]),
        },
    )
    # max_tokens running into max_model_len: clipped to the room left, finish reason "length"
    for n_prompt, max_tokens in [(170, 64), (150, 42), (189, 3), (191, 100)]:
        reqs[f"max_model_len_{n_prompt}"] = (
            "cmpl",
            {
                "prompt": _token_prompt(n_prompt, n_prompt),
                "max_tokens": max_tokens,
                **GREEDY,
                **_xb(),
            },
        )
    reqs["max_model_len_stream"] = (
        "cmpl",
        {"prompt": _token_prompt(172, 3), "max_tokens": 64, "stream": True, **GREEDY, **_xb()},
    )
    reqs["max_model_len_chat"] = (
        "chat",
        {"messages": [{"role": "user", "content": " ".join(prompts)[:300]}], **GREEDY, **_xb()},
    )  # no max_tokens: all the room that is left
    # per-request draft caps (flat vllm_xargs keys): off, 1, always-k
    for name, xargs in [
        ("off", {"selfspec_num_speculative_tokens": 0}),
        ("cap1", {"selfspec_num_speculative_tokens": 1}),
        ("fixed_k", {"selfspec_adaptive": 0}),
    ]:
        reqs[f"xargs_{name}"] = (
            "cmpl",
            {"prompt": prompts[4], "max_tokens": 50, **GREEDY, **_xb(vllm_xargs=xargs)},
        )
    return reqs


SAMPLED_REQUESTS = {
    "sampled_n4": (
        "cmpl",
        {
            "prompt": "Once upon a time",
            "max_tokens": 24,
            "n": 4,
            "temperature": 0.9,
            "top_p": 0.95,
            "seed": 7,
            **_xb(),
        },
    ),
    "sampled_stream": (
        "cmpl",
        {
            "prompt": "The weather today",
            "max_tokens": 24,
            "stream": True,
            "temperature": 1.0,
            **_xb(top_k=20),
        },
    ),
    "sampled_chat": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 24,
            "temperature": 0.7,
            **_xb(),
        },
    ),
}


# --- running requests and summarising the responses ----------------------------------------------


def _extra(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


def _cmpl_logprobs(lp: Any) -> Any:
    if lp is None:
        return None
    return {
        "tokens": list(lp.tokens or []),
        "token_logprobs": list(lp.token_logprobs or []),
        "top": [sorted((d or {}).items()) for d in (lp.top_logprobs or [])],
    }


def _chat_logprobs(lp: Any) -> Any:
    if lp is None or lp.content is None:
        return None
    return [
        (c.token, c.logprob, [(t.token, t.logprob) for t in (c.top_logprobs or [])])
        for c in lp.content
    ]


def summarize(kind: str, resp: Any) -> dict[str, Any]:
    """A comparable summary of a non-streamed response."""
    choices = {}
    for c in sorted(resp.choices, key=lambda c: c.index):
        if kind == "cmpl":
            choices[c.index] = {
                "text": c.text,
                "logprobs": _cmpl_logprobs(c.logprobs),
            }
        else:
            choices[c.index] = {
                "text": c.message.content,
                "logprobs": _chat_logprobs(c.logprobs),
            }
        choices[c.index].update(
            token_ids=list(_extra(c, "token_ids") or []),
            finish_reason=c.finish_reason,
            stop_reason=_extra(c, "stop_reason"),
        )
    return {"choices": choices, "completion_tokens": resp.usage.completion_tokens}


def summarize_stream(kind: str, chunks: list[Any]) -> dict[str, Any]:
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            d = choices.setdefault(
                c.index,
                {
                    "text": "",
                    "logprobs": None,
                    "token_ids": [],
                    "finish_reason": None,
                    "stop_reason": None,
                },
            )
            if kind == "cmpl":
                d["text"] += c.text or ""
                lp = _cmpl_logprobs(c.logprobs)
                if lp is not None:
                    acc = d["logprobs"] or {"tokens": [], "token_logprobs": [], "top": []}
                    for key in acc:
                        acc[key] += lp[key]
                    d["logprobs"] = acc
            else:
                d["text"] += (c.delta.content or "") if c.delta else ""
                lp = _chat_logprobs(c.logprobs)
                if lp is not None:
                    d["logprobs"] = (d["logprobs"] or []) + lp
            d["token_ids"] += list(_extra(c, "token_ids") or [])
            if c.finish_reason is not None:
                d["finish_reason"] = c.finish_reason
                d["stop_reason"] = _extra(c, "stop_reason")
    return {"choices": dict(sorted(choices.items())), "completion_tokens": None}


def run_request(client: Any, kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    api = client.completions if kind == "cmpl" else client.chat.completions
    if kwargs.get("stream"):
        return summarize_stream(kind, list(api.create(model=SERVED_MODEL_NAME, **kwargs)))
    return summarize(kind, api.create(model=SERVED_MODEL_NAME, **kwargs))


def pick_stops(client: Any) -> dict[str, list[str]]:
    """Stop strings occurring in the plain greedy output of prompts 0, 4 and 5 (after some text)."""
    prompts = _corpus_prompts()
    stops = {}
    for i in ("0", "4", "5"):
        text = run_request(
            client, "cmpl", {"prompt": prompts[int(i)], "max_tokens": 60, **GREEDY, **_xb()}
        )["choices"][0]["text"]
        start = min(len(text) // 3, 40)
        pairs = [text[j : j + 2] for j in range(start, max(len(text) - 2, start))]
        candidates = [p for p in pairs if p.isascii() and p.strip() and p.isprintable()]
        stops[i] = [candidates[0]] if candidates else ["e"]
    return stops


def assert_same(plain: Any, spec: Any, path: str = "") -> None:
    """Equal, with logprob floats compared to LOGPROB_ABS_TOL."""
    if isinstance(plain, float) or isinstance(spec, float):
        assert plain is not None and spec is not None, f"{path}: {plain!r} != {spec!r}"
        if math.isinf(plain) or math.isinf(spec):
            assert plain == spec, f"{path}: {plain!r} != {spec!r}"
        else:
            assert abs(plain - spec) <= LOGPROB_ABS_TOL, f"{path}: {plain!r} != {spec!r}"
    elif isinstance(plain, dict) and isinstance(spec, dict):
        assert plain.keys() == spec.keys(), f"{path}: keys {plain.keys()} != {spec.keys()}"
        for key in plain:
            assert_same(plain[key], spec[key], f"{path}.{key}")
    elif isinstance(plain, list | tuple) and isinstance(spec, list | tuple):
        assert len(plain) == len(spec), f"{path}: length {len(plain)} != {len(spec)}"
        for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert plain == spec, f"{path}: {plain!r} != {spec!r}"


# --- the load burst ---------------------------------------------------------------------------


def load_requests(n: int = LOAD_REQUESTS, seed: int = 0) -> list[dict[str, Any]]:
    """Mixed lengths; greedy and sampled; streamed and not; some clients disconnect early."""
    rng = random.Random(seed)
    prompts = _corpus_prompts()
    caps = [
        None,
        None,
        None,
        {"selfspec_num_speculative_tokens": 0},
        {"selfspec_num_speculative_tokens": 2},
        {"selfspec_adaptive": 0},
    ]
    out = []
    for i in range(n):
        role = ("greedy", "greedy", "greedy", "sampled", "disconnect", "greedy_chat")[i % 6]
        n_prompt = rng.choice([4, 12, 30, 60, 100, 140])
        max_tokens = rng.choice([2, 8, 16, 32, 48, 64, 90])
        xargs = caps[rng.randrange(len(caps))]
        extra: dict[str, Any] = {"ignore_eos": True, "return_token_ids": True}
        if xargs:
            extra["vllm_xargs"] = xargs
        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "extra_body": extra}
        kind = "cmpl"
        if role == "greedy_chat":
            kind = "chat"
            kwargs["messages"] = [{"role": "user", "content": prompts[i % len(prompts)]}]
        else:
            kwargs["prompt"] = _token_prompt(n_prompt, offset=i * 13)
        if role == "sampled":
            kwargs.update(temperature=rng.choice([0.6, 0.9, 1.2]), top_p=0.95)
            if rng.random() < 0.5:
                kwargs["seed"] = i
        else:
            kwargs["temperature"] = 0.0
        disconnect_after = None
        if role == "disconnect":
            kwargs["max_tokens"] = 150
            kwargs["temperature"] = rng.choice([0.0, 0.8])
            disconnect_after = rng.choice([1, 3, 8])
        kwargs["stream"] = role == "disconnect" or rng.random() < 0.5
        out.append(
            {
                "id": i,
                "role": role,
                "kind": kind,
                "kwargs": kwargs,
                "disconnect_after": disconnect_after,
            }
        )
    return out


async def _one(client: Any, req: dict[str, Any]) -> tuple[str, Any]:
    kind, kwargs = req["kind"], req["kwargs"]
    api = client.completions if kind == "cmpl" else client.chat.completions
    try:
        if not kwargs.get("stream"):
            resp = await api.create(model=SERVED_MODEL_NAME, **kwargs)
            return "ok", summarize(kind, resp)
        stream = await api.create(model=SERVED_MODEL_NAME, **kwargs)
        chunks = []
        async for chunk in stream:
            chunks.append(chunk)
            if req["disconnect_after"] is not None and len(chunks) >= req["disconnect_after"]:
                await stream.close()  # the client goes away mid-stream
                return "disconnected", len(chunks)
        return "ok", summarize_stream(kind, chunks)
    except Exception as exc:  # counted and reported by the test
        return "error", f"{type(exc).__name__}: {exc}"


def _async_client(base_url: str) -> Any:
    import httpx
    import openai

    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key="none",
        max_retries=0,
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0),
    )


async def _burst(base_url: str, reqs: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    client = _async_client(base_url)
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(_one(client, r) for r in reqs)), timeout=LOAD_TIMEOUT_S
        )
    finally:
        await client.close()


def run_burst(base_url: str, reqs: list[dict[str, Any]]) -> tuple[list[tuple[str, Any]], float]:
    start = time.monotonic()
    results = asyncio.run(_burst(base_url, reqs))
    return results, time.monotonic() - start


def wait_idle(server: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll /metrics until no request is running or waiting (aborted streams released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        running = metric_value(m, "vllm:num_requests_running")
        waiting = metric_value(m, "vllm:num_requests_waiting")
        if running == 0 and waiting == 0:
            return m
        assert time.monotonic() < deadline, f"server not idle: running={running} waiting={waiting}"
        time.sleep(0.5)


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir():
    from vllm_selfspec.testing.tiny_models import tiny_model_dir

    return tiny_model_dir(
        "e2e-zero", arch="llama", num_layers=NUM_LAYERS, zero_output_layers=ZERO_LAYERS
    )


def _client(server: Any) -> Any:
    import openai

    return openai.OpenAI(
        base_url=server.openai_url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    """Everything the plain server answers: functional requests, the off-request, load greedy."""
    port = free_port()
    cmd = server_command(model_dir, port, max_model_len=MAX_MODEL_LEN)
    with api_server(cmd, port, name="plain") as server:
        client = _client(server)
        stops = pick_stops(client)
        reqs = functional_requests(stops)
        results = {name: run_request(client, kind, kw) for name, (kind, kw) in reqs.items()}
        long_off = run_request(client, *long_off_request())
        load = [r for r in load_requests() if r["role"] in ("greedy", "greedy_chat")]
        burst, _ = run_burst(server.openai_url, load)
        metrics_text = server.metrics_text()
    return {
        "stops": stops,
        "functional": results,
        "long_off": long_off,
        "load": {r["id"]: res for r, res in zip(load, burst, strict=True)},
        "metrics_text": metrics_text,
    }


@pytest.fixture(scope="module")
def spec_server(model_dir, reference):
    port = free_port()
    cmd = server_command(model_dir, port, SPEC_CONFIG, max_model_len=MAX_MODEL_LEN)
    with api_server(cmd, port, name="selfspec") as server:
        yield server


@pytest.fixture(scope="module")
def long_spec_server(model_dir, spec_server):
    """A selfspec server whose requests may run to ABORT_MAX_MODEL_LEN tokens (abort test only).

    Streams that long take many seconds to run to the end, so a disconnect that reaches the engine
    late on a loaded machine (the API server shares the CPU with the engine) still ends them far
    from their full length. Depends on spec_server so that it starts after the other tests.
    """
    port = free_port()
    cmd = server_command(model_dir, port, SPEC_CONFIG, max_model_len=ABORT_MAX_MODEL_LEN)
    with api_server(cmd, port, name="selfspec-long") as server:
        yield server


def long_off_request() -> tuple[str, dict[str, Any]]:
    """A long greedy stream with drafting switched off for this request only."""
    return "cmpl", {
        "prompt": "It was a bright cold day in April",
        "max_tokens": 120,
        "stream": True,
        **GREEDY,
        **_xb(vllm_xargs={"selfspec_num_speculative_tokens": 0}),
    }


# --- tests ---------------------------------------------------------------------------------------


def test_plain_server_has_no_selfspec_metrics(reference):
    """An engine that does not ask for selfspec gets none of the plugin's metrics."""
    assert "vllm:selfspec_" not in reference["metrics_text"]
    assert "vllm:spec_decode_num_drafts_total" not in reference["metrics_text"]


def fixed_k(kw: dict[str, Any]) -> dict[str, Any]:
    """The same request with adaptive drafting off for it: always K drafts (unless capped)."""
    extra = dict(kw.get("extra_body") or {})
    extra["vllm_xargs"] = {"selfspec_adaptive": 0, **(extra.get("vllm_xargs") or {})}
    return {**kw, "extra_body": extra}


def test_openai_api_greedy_identical_to_plain(spec_server, reference):
    """Every functional request twice: adaptive drafting (the server's default) and always-K."""
    client = _client(spec_server)
    reqs = functional_requests(reference["stops"])
    failures = []
    for name, (kind, kw) in reqs.items():
        for variant, kwargs in (("adaptive", kw), ("fixed_k", fixed_k(kw))):
            got = run_request(client, kind, kwargs)
            try:
                assert_same(reference["functional"][name], got, f"{name}[{variant}]")
            except AssertionError as exc:
                failures.append(str(exc))
    assert not failures, "\n".join(failures)
    ref = reference["functional"]
    # the workload really covers what it claims
    assert len(ref["cmpl_n3"]["choices"]) == 3 and len(ref["chat_n2_stream"]["choices"]) == 2
    assert ref["cmpl_n3"]["choices"][0]["token_ids"] == ref["cmpl_n3"]["choices"][2]["token_ids"]
    assert ref["cmpl_0"]["choices"][0]["logprobs"]["top"][0]
    assert ref["chat"]["choices"][0]["logprobs"]
    for i in reference["stops"]:
        assert ref[f"stop_{i}"]["choices"][0]["finish_reason"] == "stop"
        assert ref[f"stop_stream_{i}"]["choices"][0]["finish_reason"] == "stop"
    for n_prompt in (170, 150, 189, 191):
        c = ref[f"max_model_len_{n_prompt}"]["choices"][0]
        assert c["finish_reason"] == "length"
        assert n_prompt + len(c["token_ids"]) == MAX_MODEL_LEN
    assert ref["max_model_len_stream"]["choices"][0]["finish_reason"] == "length"
    assert ref["max_model_len_chat"]["choices"][0]["finish_reason"] == "length"


def test_sampled_requests_are_well_formed(spec_server):
    client = _client(spec_server)
    for name, (kind, kw) in SAMPLED_REQUESTS.items():
        got = run_request(client, kind, kw)
        assert len(got["choices"]) == kw.get("n", 1), name
        for c in got["choices"].values():
            assert len(c["token_ids"]) == kw["max_tokens"], (name, c)
            assert c["finish_reason"] == "length", (name, c)


def test_metrics_spec_decode_counters_and_plugin_metrics(spec_server, reference):
    m = spec_server.metrics()
    drafts = metric_value(m, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_value(m, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(m, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and draft_tokens >= drafts and accepted > 0, (drafts, draft_tokens, accepted)
    per_pos = {
        int(lab["position"]): v
        for lab, v in m["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    }
    assert sorted(per_pos) == list(range(K))
    assert per_pos[0] > 0 and sum(per_pos.values()) == accepted
    # positions: accepted at i+1 implies accepted at i
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(K - 1))

    mean = metric_value(m, "vllm:selfspec_mean_draft_length")
    assert 1.0 <= mean <= K, mean
    decode_steps = metric_value(m, "vllm:selfspec_decode_request_steps_total")
    off_steps = metric_value(m, "vllm:selfspec_request_steps_drafting_off_total")
    # drafts verified + decode steps without drafts = all decode steps
    assert decode_steps >= drafts and off_steps > 0, (decode_steps, off_steps, drafts)
    print(
        f"\nmetrics: drafts={drafts:.0f} draft_tokens={draft_tokens:.0f} "
        f"accepted={accepted:.0f} per_pos={per_pos} mean_draft_length={mean:.3f} "
        f"decode_request_steps={decode_steps:.0f} off_steps={off_steps:.0f}"
    )


def test_drafting_off_gauge_mid_stream(spec_server, reference):
    """While a request with drafting off decodes, the gauge counts it; its output is still plain."""
    import openai

    client = openai.OpenAI(
        base_url=spec_server.openai_url, api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )
    kind, kw = long_off_request()
    counter = "vllm:selfspec_request_steps_drafting_off_total"
    before = metric_value(wait_idle(spec_server), counter)
    chunks, seen = [], []
    for chunk in client.completions.create(model=SERVED_MODEL_NAME, **kw):
        chunks.append(chunk)
        if len(chunks) in (10, 30, 60):
            seen.append(metric_value(spec_server.metrics(), "vllm:selfspec_requests_drafting_off"))
    # The gauge shows the latest step only, so a sample can miss it on a loaded machine; the
    # counter of request-steps without drafts must have grown while the request decoded.
    assert metric_value(spec_server.metrics(), counter) - before >= 1, seen
    assert_same(reference["long_off"], summarize_stream(kind, chunks), "long_off")
    # idle again: the gauge returns to 0
    m = wait_idle(spec_server)
    assert metric_value(m, "vllm:selfspec_requests_drafting_off") == 0


def test_load_burst(spec_server, reference):
    """>= 64 concurrent requests of mixed lengths; greedy and sampled; early disconnects.

    Passes when: the server stays up and healthy; no request errors or hangs (every request
    finishes within REQUEST_TIMEOUT_S, the burst within LOAD_TIMEOUT_S); every completed greedy
    response equals the plain server's; the server is idle afterwards (disconnected streams were
    aborted, nothing left running or waiting); the RSS of the server's process tree after the burst
    is within max(RSS_TOLERANCE_REL, RSS_TOLERANCE_ABS) of its level before the burst.
    """
    reqs = load_requests()
    assert len(reqs) >= 64
    wait_idle(spec_server)
    rss_before = spec_server.rss_bytes()
    rss_before_procs = spec_server.rss_by_process()
    before = spec_server.metrics()
    results, duration = run_burst(spec_server.openai_url, reqs)
    assert spec_server.alive() and spec_server.healthy(), spec_server.log_tail()
    after = wait_idle(spec_server)
    time.sleep(2.0)
    rss_after = spec_server.rss_bytes()
    # a second identical burst: memory must not keep growing
    results2, duration2 = run_burst(spec_server.openai_url, reqs)
    wait_idle(spec_server)
    time.sleep(2.0)
    rss_after2 = spec_server.rss_bytes()
    rss_after2_procs = spec_server.rss_by_process()
    assert spec_server.alive() and spec_server.healthy(), spec_server.log_tail()

    def tally(res):
        return {s: sum(1 for st, _ in res if st == s) for s in ("ok", "disconnected", "error")}

    errors = [
        (r["id"], val)
        for burst in (results, results2)
        for r, (st, val) in zip(reqs, burst, strict=True)
        if st == "error"
    ]
    mismatches = []
    greedy_checked = 0
    for burst in (results, results2):
        for r, (status, val) in zip(reqs, burst, strict=True):
            if r["role"] in ("greedy", "greedy_chat") and status == "ok":
                greedy_checked += 1
                try:
                    assert_same(reference["load"][r["id"]][1], val, f"load[{r['id']}]")
                except AssertionError as exc:
                    mismatches.append(str(exc))
    # Tokens the engine generated for the disconnected streams (all generated tokens of burst 1
    # minus those of the completed requests), reported only: here the client itself is one of the
    # processes starved by the burst, so how late it closes a stream says more about the machine
    # than about the server. test_disconnected_streams_are_aborted asserts the abort.
    generated = metric_value(after, "vllm:generation_tokens_total") - metric_value(
        before, "vllm:generation_tokens_total"
    )
    completed_tokens = sum(
        len(c["token_ids"]) for (st, val) in results if st == "ok" for c in val["choices"].values()
    )
    disconnected_tokens = generated - completed_tokens
    disconnected_full = sum(
        min(r["kwargs"]["max_tokens"], MAX_MODEL_LEN - len(r["kwargs"]["prompt"]))
        for r in reqs
        if r["role"] == "disconnect"
    )
    mib = 1 << 20
    roles = {k: sum(r["role"] == k for r in reqs) for k in sorted({r["role"] for r in reqs})}
    print(
        f"\nload burst: {len(reqs)} requests, all concurrent (concurrency {len(reqs)}), "
        f"roles {roles}"
        f"\n  burst 1: {duration:.1f} s, {tally(results)}; tokens generated for the disconnected "
        f"streams {disconnected_tokens:.0f} of {disconnected_full} had they run to the end"
        f"\n  burst 2: {duration2:.1f} s, {tally(results2)}"
        f"\n  greedy responses compared with plain: {greedy_checked}, mismatches: {len(mismatches)}"
        f"\n  errors: {len(errors)}"
        f"\n  RSS server tree: before {rss_before / mib:.0f} MiB, after burst 1 "
        f"{rss_after / mib:.0f} MiB ({(rss_after - rss_before) / mib:+.0f}), after burst 2 "
        f"{rss_after2 / mib:.0f} MiB ({(rss_after2 - rss_before) / mib:+.0f}); tolerance "
        f"max({RSS_TOLERANCE_REL:.0%}, {RSS_TOLERANCE_ABS / mib:.0f} MiB)"
        f"\n  RSS by process (MiB) before: {rss_before_procs}\n  after burst 2: {rss_after2_procs}"
    )
    assert not errors, errors[:5]
    assert not mismatches, "\n".join(mismatches[:5])
    assert tally(results)["disconnected"] == sum(r["role"] == "disconnect" for r in reqs)
    assert greedy_checked == 2 * sum(r["role"] in ("greedy", "greedy_chat") for r in reqs)
    tolerance = max(RSS_TOLERANCE_REL * rss_before, RSS_TOLERANCE_ABS)
    assert rss_after - rss_before <= tolerance, (rss_before, rss_after)
    assert rss_after2 - rss_before <= tolerance, (rss_before, rss_after2)


async def _abort_phase(
    server: Any, background: list[dict[str, Any]], streams: list[dict[str, Any]]
) -> tuple[list[Any], list[Any]]:
    client = _async_client(server.openai_url)
    try:
        bg = [asyncio.ensure_future(_one(client, r)) for r in background]
        deadline = time.monotonic() + 60.0
        while True:  # the background load is running before any stream starts
            m = await asyncio.to_thread(server.metrics)
            if metric_value(m, "vllm:num_requests_running") >= len(background):
                break
            assert time.monotonic() < deadline, "background requests never ran"
            await asyncio.sleep(0.05)
        disconnected = await asyncio.gather(*(_one(client, r) for r in streams))
        return list(await asyncio.gather(*bg)), list(disconnected)
    finally:
        await client.close()


def test_disconnected_streams_are_aborted(long_spec_server):
    """A client that closes its stream gets its request aborted in the engine mid-drafting.

    Long streams (each could run to ABORT_MAX_MODEL_LEN, many seconds) start while non-streamed
    requests keep the engine busy, and close after their first chunk. None of them may finish by
    length (the engine's finish counters), and the tokens generated for them must stay far below
    what they would have been had they run to the end (with abort broken: all of them).
    """
    server = long_spec_server
    n_prompt = 8
    bg_tokens = 400  # long enough to be still running when the streams start, on a loaded machine
    base: dict[str, Any] = {
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    background = [
        {
            "id": i,
            "role": "greedy",
            "kind": "cmpl",
            "disconnect_after": None,
            "kwargs": {
                **base,
                "prompt": _token_prompt(n_prompt, offset=7 * i),
                "max_tokens": bg_tokens,
            },
        }
        for i in range(8)
    ]
    full_len = ABORT_MAX_MODEL_LEN - n_prompt
    streams = [
        {
            "id": 100 + i,
            "role": "disconnect",
            "kind": "cmpl",
            "disconnect_after": 1,
            "kwargs": {
                **base,
                "prompt": _token_prompt(n_prompt, offset=11 * i),
                "stream": True,
                "max_tokens": full_len,
            },
        }
        for i in range(6)
    ]
    success = "vllm:request_success_total"
    before = wait_idle(server)
    bg_results, stream_results = asyncio.run(_abort_phase(server, background, streams))
    after = wait_idle(server)
    assert [st for st, _ in bg_results] == ["ok"] * len(background), bg_results
    assert [st for st, _ in stream_results] == ["disconnected"] * len(streams), stream_results
    generated = metric_value(after, "vllm:generation_tokens_total") - metric_value(
        before, "vllm:generation_tokens_total"
    )
    background_tokens = sum(
        len(c["token_ids"]) for _, v in bg_results for c in v["choices"].values()
    )
    assert background_tokens == bg_tokens * len(background)
    closed_tokens = generated - background_tokens
    full = len(streams) * full_len
    finished_by_length = metric_value(after, success, finished_reason="length") - metric_value(
        before, success, finished_reason="length"
    )
    print(
        f"\nclosed streams: {closed_tokens:.0f} tokens generated of {full} had they run to the end;"
        f" requests finished by length: {finished_by_length:.0f} (background: {len(background)})"
    )
    assert finished_by_length == len(background), finished_by_length
    assert 0 <= closed_tokens < 0.5 * full, (closed_tokens, generated, background_tokens)
