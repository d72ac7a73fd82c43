#!/usr/bin/env python
"""Talk to a selfspec vLLM server with the official ``openai`` client (see serve_openai.sh).

    python examples/openai_client.py [--base-url http://localhost:8000/v1]

Shows a completion, a streamed chat completion, a request with drafting switched off through
``vllm_xargs`` (flat ``selfspec_<key>`` entries: ``selfspec_num_speculative_tokens``,
``selfspec_adaptive``, ``selfspec_draft_confidence_threshold``), and the spec-decode metrics.
"""

from __future__ import annotations

import argparse
import urllib.request

import openai


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://localhost:8000/v1")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="EMPTY")
    model = client.models.list().data[0].id

    r = client.completions.create(model=model, prompt="The capital of France is",
                                  max_tokens=32, temperature=0.0)
    print("completion:", repr(r.choices[0].text))

    print("chat (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Write a haiku about speed."}],
        max_tokens=48, temperature=0.7, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    # Per-request control: vllm_xargs takes flat keys (no nested objects).
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=32,
                                  temperature=0.0,
                                  extra_body={"vllm_xargs": {"selfspec_num_speculative_tokens": 0}})
    print("drafting off for this request:", repr(r.choices[0].text))

    metrics_url = args.base_url.rsplit("/v1", 1)[0] + "/metrics"
    with urllib.request.urlopen(metrics_url) as resp:
        for line in resp.read().decode().splitlines():
            wanted = line.startswith(("vllm:spec_decode_num", "vllm:selfspec_"))
            if wanted and "_created" not in line:
                print(line)


if __name__ == "__main__":
    main()
