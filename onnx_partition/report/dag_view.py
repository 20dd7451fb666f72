"""The operator graph of a large model, condensed for the report: stage by stage, the stage's
operators in topological order cut into runs of one repeated block (a transformer layer, a
ResNet stage), edges labelled with the bytes they carry.

Blocks come from the exporter's module scopes: torch.onnx records each node's
``pkg.torch.onnx.name_scopes`` (``['', 'blocks.3', 'blocks.3.attn', ...]``); the TorchScript
exporter names nodes ``/blocks.3/attn/MatMul``. A node's block is its first scope ending in a
number (``blocks.3``), else its innermost scope (``transformer.ln_f``), else ``top level``;
the exporter's own scopes (those starting with ``_``, such as
``_empty_nn_module_stack_from_metadata_hook``) are not the model's and are skipped.

**Acyclic by construction.** Grouping by (stage, block) alone can make a cycle (GPT-2's
``transformer`` scope holds both the embeddings before the layers and the final norm after
them). Here a group is a run of consecutive operators in one topological order of the plan
(stage by stage, a valid order since every edge runs to the same or a later stage), so every
edge between groups runs from an earlier run to a later one. Runs of at most :data:`SMALL`
operators join a neighbour in the same stage, and the smallest neighbours are merged until at
most :data:`MAX_GROUPS` remain. Labels lose the prefix every block shares
(``model.transformer.``) and are shortened from the left where they must be.

Drawn with Graphviz ``dot`` where the ``graphviz`` package and binary are installed, with the
report's own column layout otherwise; either way the stages run left to right in pipeline
order and the drawing scales down to the page's width.
"""

from __future__ import annotations

import ast
import itertools
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass

from onnx_partition.graph import OpGraph
from onnx_partition.report.svg import ColumnBox, esc, stage_colour, stage_columns, text_on
from onnx_partition.values import fmt_bytes

__all__ = ["MAX_GROUPS", "SMALL", "TOP", "Flow", "Group", "block_of", "condense", "draw",
           "graphviz_available", "short_label"]

TOP = "top level"
#: Runs of at most this many operators join a neighbour of their stage.
SMALL = 2
#: At most this many boxes in the condensed graph.
MAX_GROUPS = 48
_NUMBERED = re.compile(r"(^|[._])\d+$")


@dataclass(frozen=True)
class Group:
    stage: int
    block: str  # the label drawn: the run's block, or "first … last" for merged runs
    ops: int


@dataclass(frozen=True)
class Flow:
    src: int  # group index
    dst: int
    nbytes: int
    tensors: int


def _ours(scope: str) -> bool:
    """A scope of the model's modules, not the exporter's own (``_empty_nn_module...``)."""
    return bool(scope) and not scope.split(".")[-1].startswith("_")


def block_of(name: str, scopes: list[str]) -> str:
    """The repeated block a node belongs to (see the module docstring)."""
    if scopes:  # the last scope is the node's own (its torch.fx name)
        parts = [s for s in scopes[:-1] if _ours(s)]
    else:  # "/blocks.3/attn/MatMul": the path, cumulative
        path = [p for p in name.split("/")[:-1] if p]
        parts = [".".join(path[: i + 1]) for i in range(len(path))]
        parts = [p for p in parts if _ours(p)]
    for scope in parts:
        if _NUMBERED.search(scope):
            return scope
    return parts[-1] if parts else TOP


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


@dataclass
class _Run:
    stage: int
    blocks: list[str]  # first and last block, in order
    ops: int


def condense(graph: OpGraph, stage_of: Mapping[str, int]) -> tuple[list[Group], list[Flow]]:
    """Groups in pipeline order (stage, then topological) and the tensors between them (bytes
    summed over distinct tensors); every flow runs from a lower group index to a higher one.
    Free (constant-only) nodes are left out."""
    scopes = _scopes(graph)
    kept = [n for n in graph.nodes if not n.free and n.key in stage_of]
    position = {n.index: i for i, n in enumerate(kept)}
    stage = {n.index: stage_of[n.key] for n in kept}
    forward = all(stage[info.producer] <= stage[c]
                  for info in graph.tensors.values() if info.producer in stage
                  for c in info.consumers if c in stage)
    if forward:  # stage by stage: a topological order (an invalid plan keeps the file's)
        kept.sort(key=lambda n: (stage[n.index], position[n.index]))
    runs: list[_Run] = []
    run_of: dict[int, int] = {}
    for n in kept:
        block = block_of(n.key, scopes.get(n.key, []))
        last = runs[-1] if runs else None
        if last is None or last.stage != stage[n.index] or last.blocks[-1] != block:
            runs.append(_Run(stage[n.index], [block], 0))
        runs[-1].ops += 1
        run_of[n.index] = len(runs) - 1
    merged = _merge(runs)
    group_of = {node: merged[run] for node, run in run_of.items()}
    groups = _groups(runs, merged)
    flows: dict[tuple[int, int], list[int]] = {}
    for info in graph.tensors.values():
        src = group_of.get(info.producer)
        if src is None:
            continue
        for dst in sorted({group_of[c] for c in info.consumers if c in group_of} - {src}):
            entry = flows.setdefault((src, dst), [0, 0])
            entry[0] += info.nbytes
            entry[1] += 1
    return groups, [Flow(u, v, b, t) for (u, v), (b, t) in sorted(flows.items())]


def _merge(runs: list[_Run]) -> list[int]:
    """Run index -> group index: small runs join a neighbour of their stage, then the
    smallest neighbouring pair of a stage merges until at most MAX_GROUPS are left."""
    spans = [[i, i, r.ops] for i, r in enumerate(runs)]  # first run, last run, operators

    def join(k: int) -> None:  # spans k and k + 1 become one
        spans[k] = [spans[k][0], spans[k + 1][1], spans[k][2] + spans[k + 1][2]]
        del spans[k + 1]

    def same_stage(k: int) -> bool:
        return runs[spans[k][1]].stage == runs[spans[k + 1][0]].stage

    k = 0
    while k < len(spans):
        if spans[k][2] <= SMALL:
            left = k > 0 and same_stage(k - 1)
            right = k + 1 < len(spans) and same_stage(k)
            if left or right:
                if left and (not right or spans[k - 1][2] <= spans[k + 1][2]):
                    join(k - 1)
                    k -= 1
                else:
                    join(k)
                continue
        k += 1
    while len(spans) > MAX_GROUPS:
        pairs = [k for k in range(len(spans) - 1) if same_stage(k)]
        if not pairs:
            break
        join(min(pairs, key=lambda k: spans[k][2] + spans[k + 1][2]))
    out = [0] * len(runs)
    for g, (first, last, _) in enumerate(spans):
        for i in range(first, last + 1):
            out[i] = g
    return out


def _groups(runs: list[_Run], merged: list[int]) -> list[Group]:
    members: dict[int, list[_Run]] = {}
    for run, g in zip(runs, merged):
        members.setdefault(g, []).append(run)
    blocks = [b for r in runs for b in r.blocks if b != TOP]
    prefix = _common_prefix(blocks)
    groups = []
    for g in range(len(members)):
        rs = members[g]
        names = list(dict.fromkeys(_strip(b, prefix) for r in rs for b in r.blocks))
        named = [b for b in names if b != TOP] or names
        label = named[0] if len(named) == 1 else f"{named[0]} … {named[-1]}"
        groups.append(Group(rs[0].stage, label, sum(r.ops for r in rs)))
    return groups


def _common_prefix(blocks: list[str]) -> list[str]:
    """The dotted components every innermost block starts with (``model`` of
    ``model.transformer.h.0`` and ``model.lm_head``); a block enclosing others
    (``model``) does not count."""
    split = [b.split(".") for b in dict.fromkeys(blocks)]
    inner = [s for s in split if not any(len(o) > len(s) and o[: len(s)] == s for o in split)]
    prefix: list[str] = []
    for parts in zip(*inner):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    if any(len(s) == len(prefix) for s in inner):  # keep a name for every innermost block
        prefix = prefix[:-1]
    return prefix


def _strip(block: str, prefix: list[str]) -> str:
    if block == TOP or not prefix:
        return block
    parts = block.split(".")
    if parts[: len(prefix)] == prefix:
        return ".".join(parts[len(prefix):])
    if prefix[: len(parts)] == parts:  # the prefix or a scope enclosing it: the top level
        return TOP
    return block


def short_label(text: str, limit: int) -> str:
    """``text`` shortened from the left to at most ``limit`` characters, whole dotted
    components first (``transformer.h.11`` -> ``…h.11``): the end of a module path names the
    block. Each side of a ``first … last`` label is shortened alike."""
    if len(text) <= limit:
        return text
    if " … " in text:
        first, last = text.split(" … ", 1)
        half = max((limit - 3) // 2, 2)
        return f"{short_label(first, half)} … {short_label(last, half)}"
    parts = text.split(".")
    while len(parts) > 1 and len(".".join(parts)) + 1 > limit:
        parts = parts[1:]
    tail = ".".join(parts)
    if len(tail) + 1 <= limit:
        return "…" + tail
    return "…" + text[len(text) - max(limit - 1, 1):]


def graphviz_available() -> bool:
    try:
        import graphviz  # noqa: F401
    except ImportError:
        return False
    return shutil.which("dot") is not None


def _box_label(g: Group) -> str:
    return f"{short_label(g.block, 28)} ({g.ops})"


def draw(groups: list[Group], flows: list[Flow]) -> tuple[str, str]:
    """An inline ``<svg>`` of the condensed graph and the engine that drew it."""
    if graphviz_available():
        try:
            return _dot(groups, flows), "graphviz dot"
        except Exception:  # a broken graphviz install: fall back to the built-in layout
            pass
    boxes = [ColumnBox(g.stage, g.block, g.ops,
                       f"stage {g.stage}: {g.block}, {g.ops} operator{'s' * (g.ops != 1)}")
             for g in groups]
    edges = [(f.src, f.dst, groups[f.src].stage != groups[f.dst].stage,
              f"{fmt_bytes(f.nbytes)} in {f.tensors} tensor{'s' * (f.tensors != 1)}")
             for f in flows]
    return stage_columns(boxes, edges, shorten=short_label), "built-in column layout"


def _dot(groups: list[Group], flows: list[Flow]) -> str:
    """Stages as columns left to right in pipeline order (one rank each, consecutive stages
    chained by invisible edges), each stage's boxes top to bottom in order; bytes are written
    on the edges that cross a stage."""
    import graphviz

    dot = graphviz.Digraph(graph_attr={"rankdir": "LR", "newrank": "true",
                                       "fontname": "Helvetica", "fontsize": "11",
                                       "nodesep": "0.2", "ranksep": "0.6"},
                           node_attr={"shape": "box", "style": "rounded,filled",
                                      "fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    stages = sorted({g.stage for g in groups})
    firsts: list[str] = []
    for stage in stages:
        members = [i for i, g in enumerate(groups) if g.stage == stage]
        firsts.append(f"g{members[0]}")
        with dot.subgraph(name=f"cluster_{stage}") as sub:
            sub.attr(label=f"stage {stage}", color=stage_colour(stage), style="dashed",
                     rank="same")
            for i in members:
                g = groups[i]
                colour = stage_colour(stage)
                sub.node(f"g{i}", _box_label(g), fillcolor=colour,
                         fontcolor="#ffffff" if text_on(colour) == "#fff" else "#222222",
                         tooltip=f"stage {stage}: {g.block}, "
                                 f"{g.ops} operator{'s' * (g.ops != 1)}")
    for a, b in itertools.pairwise(firsts):  # left to right in pipeline order
        dot.edge(a, b, style="invis", weight="100")
    for f in flows:
        cross = groups[f.src].stage != groups[f.dst].stage
        tip = f"{f.tensors} tensor{'s' * (f.tensors != 1)}, {fmt_bytes(f.nbytes)}"
        if cross:
            dot.edge(f"g{f.src}", f"g{f.dst}", xlabel=fmt_bytes(f.nbytes), color="#c0392b",
                     penwidth="1.6", tooltip=tip)
        else:
            # a flat edge of one rank: its tail is drawn below its head, so reversed
            dot.edge(f"g{f.dst}", f"g{f.src}", dir="back", color="#8a96a3", tooltip=tip)
    svg = dot.pipe(format="svg", encoding="utf-8")
    body = svg[svg.index("<svg"):]
    # an accessible name and title like the report's other charts; scaled to the page's width
    head_end = body.index(">") + 1
    head = re.sub(r'\s(width|height)="[^"]*"', "", body[:head_end])
    width = re.search(r'viewBox="[-\d.]+ [-\d.]+ ([\d.]+)', head)
    size = f"width:{float(width.group(1)):.0f}px;" if width else ""
    head = head.replace("<svg", f'<svg role="img" aria-label="operator graph" '
                               f'style="{size}max-width:100%;height:auto"', 1)
    return head + f"<title>{esc('operator graph, condensed')}</title>" + body[head_end:]
