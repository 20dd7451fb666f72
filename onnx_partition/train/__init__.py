"""Training a train plan: stage modules cut from the exported program, and their runtime."""
