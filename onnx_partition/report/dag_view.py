"""The operator graph of a large model, condensed for the report: one box per stage and
repeated block (a transformer layer, a ResNet stage), edges labelled with the bytes they carry.

Blocks come from the exporter's module scopes: torch.onnx records each node's
``pkg.torch.onnx.name_scopes`` (``['', 'blocks.3', 'blocks.3.attn', ...]``); the TorchScript
exporter names nodes ``/blocks.3/attn/MatMul``. A node's block is its first scope ending in a
number (``blocks.3``), else its first scope, else ``top level``. Drawn with Graphviz ``dot``
where the ``graphviz`` package and binary are installed, with the report's own layered layout
otherwise.
"""

from __future__ import annotations

import ast
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from onnx_partition.graph import OpGraph
from onnx_partition.report.svg import DagNode, esc, layered_dag, stage_colour, text_on
from onnx_partition.values import fmt_bytes

__all__ = ["TOP", "Flow", "Group", "block_of", "condense", "draw", "graphviz_available"]

TOP = "top level"
_NUMBERED = re.compile(r"(^|[._])\d+$")


@dataclass(frozen=True)
class Group:
    stage: int
    block: str
    ops: int


@dataclass(frozen=True)
class Flow:
    src: int  # group index
    dst: int
    nbytes: int
    tensors: int


def block_of(name: str, scopes: list[str]) -> str:
    """The repeated block a node belongs to (see the module docstring)."""
    if scopes:  # the last scope is the node's own (its torch.fx name)
        parts = [s for s in scopes[:-1] if s]
    else:  # "/blocks.3/attn/MatMul": the path, cumulative
        path = [p for p in name.split("/")[:-1] if p]
        parts = [".".join(path[: i + 1]) for i in range(len(path))]
    for scope in parts:
        if _NUMBERED.search(scope):
            return scope
    return parts[0] if parts else TOP


def _scopes(graph: OpGraph) -> dict[str, list[str]]:
    """Node key -> the exporter's name scopes (empty when none were recorded)."""
    found: dict[str, list[str]] = {}
    for node in graph.model.graph.node:
        for prop in node.metadata_props:
            if prop.key == "pkg.torch.onnx.name_scopes":
                try:
                    value = ast.literal_eval(prop.value)
                except (ValueError, SyntaxError):
                    continue
                if isinstance(value, list):
                    found[node.name] = [str(v) for v in value]
    return found


def condense(graph: OpGraph, stage_of: Mapping[str, int]) -> tuple[list[Group], list[Flow]]:
    """Groups (stage, block) in topological order of their first operator, and the tensors
    between them (bytes summed over distinct tensors). Free (constant-only) nodes are left out."""
    scopes = _scopes(graph)
    index: dict[tuple[int, str], int] = {}
    counts: list[int] = []
    keys: list[tuple[int, str]] = []
    group_of: dict[int, int] = {}
    for node in graph.nodes:
        if node.free or node.key not in stage_of:
            continue
        key = (stage_of[node.key], block_of(node.key, scopes.get(node.key, [])))
        if key not in index:
            index[key] = len(keys)
            keys.append(key)
            counts.append(0)
        counts[index[key]] += 1
        group_of[node.index] = index[key]
    flows: dict[tuple[int, int], list[int]] = {}
    for info in graph.tensors.values():
        src = group_of.get(info.producer)
        if src is None:
            continue
        for dst in sorted({group_of[c] for c in info.consumers if c in group_of} - {src}):
            entry = flows.setdefault((src, dst), [0, 0])
            entry[0] += info.nbytes
            entry[1] += 1
    groups = [Group(s, b, n) for (s, b), n in zip(keys, counts)]
    return groups, [Flow(u, v, b, t) for (u, v), (b, t) in sorted(flows.items())]


def graphviz_available() -> bool:
    try:
        import graphviz  # noqa: F401
    except ImportError:
        return False
    return shutil.which("dot") is not None


def draw(groups: list[Group], flows: list[Flow]) -> tuple[str, str]:
    """An inline ``<svg>`` of the condensed graph and the engine that drew it."""
    if graphviz_available():
        try:
            return _dot(groups, flows), "graphviz dot"
        except Exception:  # a broken graphviz install: fall back to the built-in layout
            pass
    nodes = [DagNode(f"{g.block} ({g.ops})", f"stage {g.stage}: {g.block}, {g.ops} operators",
                     stage_colour(g.stage)) for g in groups]
    edges = [(f.src, f.dst, groups[f.src].stage != groups[f.dst].stage) for f in flows]
    legend = [(f"stage {s}", stage_colour(s)) for s in sorted({g.stage for g in groups})][:16]
    return layered_dag(nodes, edges, legend_items=legend), "built-in layered layout"


def _dot(groups: list[Group], flows: list[Flow]) -> str:
    import graphviz

    dot = graphviz.Digraph(graph_attr={"rankdir": "TB", "fontname": "Helvetica",
                                       "fontsize": "11", "nodesep": "0.25", "ranksep": "0.35"},
                           node_attr={"shape": "box", "style": "rounded,filled",
                                      "fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    dot.attr(label="operator graph, condensed: one box per stage and block (operators in "
                   "brackets); edges: bytes per micro-batch", labelloc="t")
    for stage in sorted({g.stage for g in groups}):
        with dot.subgraph(name=f"cluster_{stage}") as sub:
            sub.attr(label=f"stage {stage}", color=stage_colour(stage), style="dashed")
            for i, g in enumerate(groups):
                if g.stage == stage:
                    colour = stage_colour(stage)
                    sub.node(f"g{i}", f"{g.block} ({g.ops})", fillcolor=colour,
                             fontcolor="#ffffff" if text_on(colour) == "#fff" else "#222222",
                             tooltip=f"stage {stage}: {g.block}, {g.ops} operators")
    for f in flows:
        cross = groups[f.src].stage != groups[f.dst].stage
        dot.edge(f"g{f.src}", f"g{f.dst}", label=fmt_bytes(f.nbytes),
                 color="#c0392b" if cross else "#8a96a3", penwidth="1.6" if cross else "1",
                 tooltip=f"{f.tensors} tensor{'s' * (f.tensors != 1)}, {fmt_bytes(f.nbytes)}")
    svg = dot.pipe(format="svg", encoding="utf-8")
    start = svg.index("<svg")
    body = svg[start:]
    # an accessible name and title like the report's other charts
    head_end = body.index(">") + 1
    return (body[:head_end].replace("<svg", '<svg role="img" aria-label="operator graph"', 1)
            + f"<title>{esc('operator graph, condensed')}</title>" + body[head_end:])
