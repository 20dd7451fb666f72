"""Step (a) of the two-step method: turn the operator DAG into a sequence that the DP cuts.

:mod:`.topo` holds topological orders (Kahn's, depth-first, min-live), the bytes crossing each
position of a sequence and the map from cut points back to stages; :mod:`.blocks` the narrow
points and the blocks between them. Their public names are used from those modules.
"""

__all__ = ["blocks", "topo"]
