"""The tree reads as the data flow: every import runs down the layers, and no module imports
itself back through others. Imports are read from the source (also those inside functions and
under ``TYPE_CHECKING``), so a lazy import cannot hide a layer violation."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "onnx_partition"

#: Lowest first. A module may import modules of its own layer or of a lower one. The entries
#: (the console script, ``python -m`` aliases kept for torchrun, the package root) sit on top.
LAYERS: list[set[str]] = [
    # base: no project imports but each other
    {"errors", "values", "progress", "fileio", "dag", "safe_tensors", "mfu"},
    {"plan", "settings"},  # the contracts (plan.json, cluster.json, ...); the settings types
    {"pipeline", "graph"},  # the pipeline model (no ONNX); the ONNX adapter
    {"cost"},  # per-node costs, devices
    {"request"},  # a verb's request resolved (the CLI and the API resolve alike)
    {"solve"},  # the solvers
    # the partitioner's driver (and its calibration on the stages it wrote); the runtimes; the
    # recipes
    {"partition", "pricing", "graph_arrays", "assemble", "calibrate", "runtime", "models"},
    {"report"},  # presentation
    {"cli", "train", "runtime.distributed", ""},  # entries
]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "models":
        parts = [PACKAGE, *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*(ROOT / PACKAGE).rglob("*.py"), *(ROOT / "models").rglob("*.py")]
    return {_module_of(f): f for f in files}


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Project modules ``module`` imports (``from a import b`` counts ``a.b`` when it is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def _layer(module: str) -> int:
    rel = module[len(PACKAGE) + 1:] if module != PACKAGE else ""
    best = None
    for i, layer in enumerate(LAYERS):
        for key in layer:
            inside = rel == key or (key and rel.startswith(key + "."))
            if inside and (best is None or len(key) > len(best[1])):
                best = (i, key)  # the longest key wins (runtime.distributed over runtime)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[0]


def _graph() -> nx.DiGraph:
    sources = _sources()
    graph = nx.DiGraph()
    for module, path in sources.items():
        graph.add_node(module)
        for target in _imports(module, path, set(sources)):
            if target != module and not module.startswith(target + "."):
                graph.add_edge(module, target)  # a package's own __init__ is not an import up
    return graph


def test_every_import_runs_down_the_layers() -> None:
    up = [f"{a} (layer {_layer(a)}) imports {b} (layer {_layer(b)})"
          for a, b in _graph().edges if _layer(b) > _layer(a)]
    assert not up, "\n".join(up)


def test_no_import_circle() -> None:
    circles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not circles, circles


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    """The checker itself bites: an import up from the base layer is reported."""
    path = tmp_path / "values.py"
    path.write_text("from onnx_partition.cli import main\nimport onnx_partition.solve.dp\n")
    found = _imports("onnx_partition.values", path,
                     {"onnx_partition.cli", "onnx_partition.solve.dp"})
    assert found == {"onnx_partition.cli", "onnx_partition.solve.dp"}
    assert _layer("onnx_partition.cli") > _layer("onnx_partition.values")
    assert _layer("onnx_partition.runtime.distributed") > _layer("onnx_partition.runtime.infer")
