"""Benchmarks of vllm-selfspec (``python -m benchmarks.run``); see docs/benchmarks.md."""
