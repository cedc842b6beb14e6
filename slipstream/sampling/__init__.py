"""What a request asks for (SamplingParams), the per-request sampling columns, and the sampler
that turns logits into tokens on the device."""
