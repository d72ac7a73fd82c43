"""What vLLM sees: the plugin's engine-start rewrite, its patches of vLLM internals, its metrics
and worker extension. The only package that reads or patches vLLM internals outside the drafters."""
