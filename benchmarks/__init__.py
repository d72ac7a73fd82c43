"""Benchmarks of vllm-selfspec: ``python -m benchmarks.run --suite ...`` (see docs/benchmarks.md)."""
