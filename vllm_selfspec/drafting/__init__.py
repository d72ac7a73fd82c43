"""The drafter and the forward passes it runs: the layer-skip forward over the target's own
modules, the drafter on vLLM's speculator machinery, prompt-lookup drafts, the step-cost feed across
TP ranks, the compiled-draft cache and the device clock."""
