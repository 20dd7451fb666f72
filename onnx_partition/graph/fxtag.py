"""The FX node tag the dynamo exporter writes on every ONNX node (read without importing torch).

``pkg.torch.onnx.fx_node`` holds the FX node as printed, e.g. ``%linear_3 : [num_users=1] =
call_function[target=torch.ops.aten.linear.default](...)``; its name is the word after ``%``.
"""

from __future__ import annotations

import re

import onnx

__all__ = ["FX_NODE_KEY", "fx_node_name", "fx_unit"]

#: Node metadata key the dynamo exporter writes: the FX node an ONNX node came from.
FX_NODE_KEY = "pkg.torch.onnx.fx_node"


def fx_node_name(node: onnx.NodeProto) -> str | None:
    """Name of the FX node ``node`` was exported from, or None when it carries no tag."""
    for entry in node.metadata_props:
        if entry.key == FX_NODE_KEY:
            text = entry.value.strip()
            if text.startswith("%"):
                name = text[1:].split(" ", 1)[0].split(":", 1)[0].strip()
                return name or None
            return None
    return None


_GETITEM = re.compile(r"target=operator\.getitem\]\(args = \(%([^\s,)]+)")


def fx_unit(node: onnx.NodeProto) -> str | None:
    """The unit ``node`` belongs to: its FX node, or for an FX ``getitem`` (an element of a
    tuple-valued op, e.g. ``split``) the op it reads from, since a tuple cannot cross a cut."""
    for entry in node.metadata_props:
        if entry.key == FX_NODE_KEY:
            match = _GETITEM.search(entry.value)
            if match:
                return match.group(1)
            break
    return fx_node_name(node)
