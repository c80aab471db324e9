"""The norm prologue as a graph rewrite: a ``loopcast.ResidualRMSNorm`` whose normed output feeds
only input A of one projection (``BatchInvariantMatMul`` or ``BatchInvariantMatMulNBits``, not
the SwiGLU form) becomes that projection's prologue, one node and one kernel instead of two:

    ResidualRMSNorm(branch, residual, bw, lw, ow) -> sum, h;  Proj(h, W...) -> y
        =>  Proj(branch, W..., residual, bw, lw, norm_weight=ow) -> y, sum

The projection's kernel forms ``h`` as it loads its input, with the norm kernel's bits (on the
CPU and on CUDA: custom_ops/src/norm_prologue_io.h), so the rewrite changes no output bit. In the
fused decoder stack (``blocks.decoder_stack``) every norm that opens a QKV or gate/up projection
is folded: a layer is 5 kernels instead of 7. Off unless LOOPCAST_NORM_PROLOGUE=1 at export
(``enabled``): on the H200 the fused chain measured slower than the 7 kernels (docs/perf.md,
"Norm prologue"), so the exported graphs keep the separate norms by default.

Matched like an onnxscript rewrite rule (a pattern over one producer and its single consumer,
checked, then replaced in place), without the rewriter package, which the runtime does not need.
"""

from __future__ import annotations

import os

import onnx_ir as ir
from loopcast.graphs.builder import LOOPCAST_DOMAIN

# The projections that take the prologue, and where its four inputs start (after the weights).
PROLOGUE_INPUT = {"BatchInvariantMatMul": 2, "BatchInvariantMatMulNBits": 4}
NORM = "ResidualRMSNorm"


def _match(norm: ir.Node) -> ir.Node | None:
    """The projection that ``norm`` can be folded into, or None."""
    if norm.domain != LOOPCAST_DOMAIN or norm.op_type != NORM or len(norm.outputs) < 2:
        return None
    h = norm.outputs[1]
    uses = list(h.uses())
    if h.is_graph_output() or len(uses) != 1:
        return None
    proj, index = uses[0]
    if proj.domain != LOOPCAST_DOMAIN or proj.op_type not in PROLOGUE_INPUT or index != 0:
        return None
    attr = proj.attributes.get("swiglu")
    if attr is not None and attr.as_int() != 0:
        return None
    if len(proj.inputs) > PROLOGUE_INPUT[proj.op_type] or len(proj.outputs) != 1:
        return None  # already carries a prologue
    return proj


def _fuse(graph: ir.Graph, norm: ir.Node, proj: ir.Node) -> None:
    first = PROLOGUE_INPUT[proj.op_type]
    weights = list(proj.inputs[1:]) + [None] * (first - len(proj.inputs))
    norm_in = list(norm.inputs) + [None] * (5 - len(norm.inputs))  # branch, residual, bw, lw, ow
    attributes = [a for name, a in proj.attributes.items()]
    eps = norm.attributes.get("epsilon")
    if eps is not None:
        attributes.append(ir.AttrFloat32("epsilon", eps.as_float()))
    old_y, old_sum = proj.outputs[0], norm.outputs[0]
    # an unused sum (the stack's first norm: no residual) is not declared, so it is not written
    olds = (old_y, old_sum) if old_sum.uses() or old_sum.is_graph_output() else (old_y,)
    fused = ir.Node(
        LOOPCAST_DOMAIN,
        proj.op_type,
        [norm_in[0], *weights, *norm_in[1:]],
        attributes=attributes,
        num_outputs=len(olds),
        name=proj.name,
    )
    graph.insert_after(norm, fused)
    for old, new in zip(olds, fused.outputs):
        new.type, new.shape = old.type, old.shape
        for i, out in enumerate(graph.outputs):  # first: onnx-ir refuses to move a graph output's uses
            if out is old:
                graph.outputs[i] = new
        ir.convenience.replace_all_uses_with(old, new)
    graph.remove([norm, proj], safe=True)
    for old, new in zip(olds, fused.outputs):
        name = old.name
        old.name = None
        new.name = name


def enabled() -> bool:
    """LOOPCAST_NORM_PROLOGUE=1: export with the norms folded (a measurement switch, read at
    each graph build, like the kernels' LOOPCAST_PDL)."""
    return os.environ.get("LOOPCAST_NORM_PROLOGUE") == "1"


def fuse_norm_prologues(graph: ir.Graph) -> int:
    """Fold every matching ResidualRMSNorm into its projection, in place; returns how many."""
    fused = 0
    for node in list(graph):
        proj = _match(node)
        if proj is not None:
            _fuse(graph, node, proj)
            fused += 1
    return fused
