"""What every patch module shares."""

SENTINEL = "_vllm_selfspec_patched"
"""Set on every wrapper: a second installation finds it and does nothing."""
