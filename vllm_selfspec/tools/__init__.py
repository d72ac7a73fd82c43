"""Command-line tools around the plugin: the demo, ``selfspec-profile``, the embedded models and
prompt sets, and reading vLLM's spec-decode counters from an offline ``LLM``."""
