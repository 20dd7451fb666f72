"""The check that a default is written once: literal defaults found in source."""

from __future__ import annotations

import ast


def _literal(node: ast.expr | None) -> bool:
    """A default written as a value: a constant (not None), a signed number, a tuple of them."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_literal(e) for e in node.elts)
    return False


def literal_defaults(source: str, names: set[str], declaring_prefix: str = "_train"
                     ) -> list[tuple[str, str]]:
    """(where, name) of every parameter or dataclass field named in ``names`` whose default is
    a literal, and of every ``add_argument(..., default=<literal>)`` whose dest is named in a
    function declaring a verb's options (its name starts with ``declaring_prefix``: ``_train``
    for ``train``'s; other verbs' options of the same name are theirs)."""
    found = []
    tree = ast.parse(source)
    declaring = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and f.name.startswith(declaring_prefix) for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]
            found += [(node.name, a.arg) for a, d in pairs if a.arg in names and _literal(d)]
        elif isinstance(node, ast.ClassDef):
            found += [(node.name, s.target.id) for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                      and s.target.id in names and _literal(s.value)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "add_argument" and id(node) in declaring):
            flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
            dest = next((k.value.value for k in node.keywords if k.arg == "dest"
                         and isinstance(k.value, ast.Constant)), None)
            dest = dest or (flags[0].lstrip("-").replace("-", "_") if flags else None)
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if dest in names and _literal(default):
                found.append((f"--{dest}", dest))
    return found
