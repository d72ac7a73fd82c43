"""Draft-length control: per-request draft lengths, the draft source per request and step, and the
measured step costs they plan with. Imports neither vLLM nor torch."""
