"""Training a train plan: stage modules cut from the exported program, and their runtime."""

__all__ = ["comm", "launch", "rank", "reference", "runtime", "save", "stages", "task",
           "torch_engine"]
