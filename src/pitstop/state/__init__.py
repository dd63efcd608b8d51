"""Layer 4: gathering and restoring the user's state (Statefuls, tensors, RNG, data position)."""
