"""The signature model: the nodes still to measure, each once (or K times), in one small model.

It holds their real initializers (external data resolved from the model's folder), copies of
the constant nodes they need, and their computed inputs as graph inputs (random floats of the
right shape; integer, boolean and unknown-shape values captured from one run of the whole model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from onnx_partition.cost.profile.harness import Context, input_feeds, random_array
from onnx_partition.errors import PartitionError, one_line
from onnx_partition.graph.protos import shape_of

__all__ = ["flow_values", "signature_model"]

_RANDOM_FLOATS = (np.float16, np.float32, np.float64)


def signature_model(ctx: Context, reps: Sequence[int], copies: int,
                    values: Mapping[str, np.ndarray]) -> tuple[onnx.ModelProto,
                                                                dict[str, np.ndarray]]:
    """A model running each node of ``reps`` ``copies`` times, and its feeds.

    Inputs keep their names: initializers are the real ones, constant-only nodes are copied in,
    computed values become graph inputs. Outputs are renamed (``<name>#p<copy>``) so that no
    node's output collides with another's input, and are not graph outputs (a graph output
    would be copied where in the model it is a view, as for Reshape); onnxruntime still runs
    nodes whose outputs nobody reads when optimizations are off. The one graph output is a
    constant.
    """
    graph = ctx.graph
    src = graph.model
    protos = graph.protos()
    inits = {t.name: t for t in src.graph.initializer}
    needed = [name for r in reps for name in graph.nodes[r].inputs]
    closure = graph.free_closure(needed)
    flow = list(dict.fromkeys(n for n in needed
                              if n not in graph.free_outputs and n not in inits))
    used_inits = dict.fromkeys(
        name for i in (*closure, *reps) for name in graph.nodes[i].initializers)

    nodes: list[onnx.NodeProto] = [protos[graph.nodes[i].key] for i in closure]
    done = "#profile_done"
    nodes.append(helper.make_node("Constant", [], [done], name=done,
                                  value=helper.make_tensor(done, onnx.TensorProto.FLOAT, [], [0])))
    for r in reps:
        for c in range(copies):
            node = onnx.NodeProto()
            node.CopyFrom(protos[graph.nodes[r].key])
            if c:
                node.name = f"{node.name}#copy{c}"
            for k, out in enumerate(node.output):
                if out:
                    node.output[k] = f"{out}#p{c}"
            nodes.append(node)
    feeds = {name: values[name] for name in flow}
    inputs = [helper.make_tensor_value_info(
        name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
        for name, value in feeds.items()]
    outputs = [helper.make_tensor_value_info(done, onnx.TensorProto.FLOAT, [])]
    body = helper.make_graph(nodes, "onnx-partition-profile", inputs, outputs,
                             initializer=[inits[n] for n in used_inits])
    model = helper.make_model(body, opset_imports=list(src.opset_import),
                              ir_version=max(src.ir_version, 4))
    model.functions.extend(src.functions)
    return model, feeds


def flow_values(ctx: Context, reps: Sequence[int]) -> dict[str, np.ndarray]:
    """Values for the computed tensors ``reps`` read: graph inputs' random feeds, random floats
    of the concrete shape, and values captured from one run of the whole model for the rest
    (integers, booleans, unknown shapes)."""
    graph = ctx.graph
    names = [n for r in reps for n in graph.nodes[r].inputs if n not in graph.free_outputs]
    names = list(dict.fromkeys(n for n in names if n not in graph.initializer_bytes))
    rng = np.random.default_rng(1)
    feeds = input_feeds(graph)
    values: dict[str, np.ndarray] = {}
    capture = []
    for name in names:
        if name in feeds:
            values[name] = feeds[name]
            continue
        ttype = graph.concrete_types.get(name)
        shape = shape_of(graph.concrete_types, name)
        elem = ttype.tensor_type.elem_type if ttype and ttype.HasField("tensor_type") else 0
        dtype = helper.tensor_dtype_to_np_dtype(elem) if elem else None
        if shape is not None and dtype is not None and dtype in _RANDOM_FLOATS:
            values[name] = random_array(rng, dtype, shape, 2)
        else:
            capture.append(name)
    if capture:
        values.update(_capture(ctx, capture, feeds))
    ctx.settings.captured_values = len(capture)
    return values


def _capture(ctx: Context, names: Sequence[str],
             feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Values of intermediate tensors, from one CPU run of the model with them as outputs."""
    model = onnx.ModelProto()
    model.CopyFrom(ctx.graph.model)
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in present)
    cpu = Context(ctx.graph, "cpu", None, ctx.threads, 0, 1)
    session = cpu.session(model, cpu.options(optimize=False), "the model (capturing inputs)")
    try:
        values = session.run(list(names), dict(feeds))
    except Exception as exc:  # onnxruntime raises its own exception types
        first = one_line(exc)
        raise PartitionError(f"onnxruntime failed to run the model: {first}") from None
    result = {}
    for name, value in zip(names, values):
        if not isinstance(value, np.ndarray):
            raise PartitionError(f"value {name!r} is not a tensor; cannot profile its readers")
        result[name] = value
    return result
