"""The drafters and the forward passes they run: the layer-skip forward over the target's own
modules, the host and device drafters, prompt-lookup drafts, the step-cost feed across TP ranks."""
