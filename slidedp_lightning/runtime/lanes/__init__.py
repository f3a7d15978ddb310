"""The concurrent work of a step: streams, liveness, unit residency, activations, gradients and the update."""
