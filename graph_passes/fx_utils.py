"""Reading and writing custom-op calls in post-grad FX graphs, whatever their functional form.

A mutating op appears as ``auto_functionalized`` (vLLM forces v1: mutated args as kwargs, outputs
= returns then mutated args) or ``auto_functionalized_v2`` (plain torch.compile: mutated args via
``_all_bases`` / ``_<arg>_base_index``, outputs = returns then new bases). Pure ops are direct
calls with positional args.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node

AF_V1 = torch.ops.higher_order.auto_functionalized
AF_V2 = torch.ops.higher_order.auto_functionalized_v2


def op_of(node: Node) -> Any:
    """The OpOverload a node calls, looking through auto_functionalized wrappers."""
    if node.op != "call_function":
        return None
    if node.target in (AF_V1, AF_V2):
        return node.args[0]
    return node.target


def is_op(node: Any, op: Any) -> bool:
    return isinstance(node, Node) and op_of(node) is op


def arg(node: Node, name: str) -> Any:
    """An op argument by schema name, in any of the three forms."""
    op = op_of(node)
    schema = op._schema
    if node.target in (AF_V1, AF_V2):
        if name in node.kwargs:
            return node.kwargs[name]
        key = f"_{name}_base_index"
        if key in node.kwargs:
            return node.kwargs["_all_bases"][node.kwargs[key]]
        default = next(a for a in schema.arguments if a.name == name)
        return default.default_value if default.has_default_value() else None
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, a.default_value if a.has_default_value() else None)
    raise KeyError(f"{op} has no argument {name!r}")


def outputs(node: Node) -> dict[int, Node]:
    """getitem users by index (one per index after CSE)."""
    return {u.args[1]: u for u in node.users if u.target is operator.getitem}


def mutated_output(node: Node, name: str) -> Node | None:
    """The getitem holding the new value of mutated argument ``name`` of a functionalized call."""
    op = op_of(node)
    returns = len(op._schema.returns)
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if node.target is AF_V2:
        index = returns + node.kwargs[f"_{name}_base_index"]
    else:
        index = returns + mutable.index(name)
    return outputs(node).get(index)


def only_users(node: Node, allowed: set[Node]) -> bool:
    return all(u in allowed for u in node.users)


def insert_functional_call(graph: Graph, like: Node, op: Any, kwargs: dict[str, Any], mutated: dict[str, Node],
                           num_returns: int) -> tuple[Node, list[Node]]:
    """Call a mutating op in the same functional form as ``like`` (v1 or v2); returns the call and
    its getitems: the op's returns, then the new values of ``mutated`` in schema order."""
    order = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if like.target is AF_V2:
        kw = dict(kwargs)
        for i, name in enumerate(order):
            kw[f"_{name}_base_index"] = i
        kw["_all_bases"] = [mutated[name] for name in order]
        call = graph.call_function(AF_V2, (op,), kw)
    else:
        call = graph.call_function(AF_V1, (op,), {**kwargs, **{name: mutated[name] for name in order}})
    items = [graph.call_function(operator.getitem, (call, i)) for i in range(num_returns + len(order))]
    return call, items
