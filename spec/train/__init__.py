"""Training the multi-layer EAGLE draft from the target's own responses."""
