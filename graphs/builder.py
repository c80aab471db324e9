"""A thin layer over onnx-ir's Tape: named ops, graph IO and external-data weights.

Block builders (``graphs/blocks.py``) take a :class:`GraphBuilder` and values, and return
values; the builder only records. Node names are paths (``/loop2/layer7/attn/qkv_proj``),
value names carry their shape (``qkv_BSQ``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx_ir as ir

from loopcast.manifest import GraphSpec
from loopcast.quant import QuantLinear

OPSET = 23  # RMSNormalization is standard from opset 23
MS_DOMAIN = "com.microsoft"
LOOPCAST_DOMAIN = "loopcast"  # the custom-op library's domain (custom_ops/)
IR_VERSION = 10


@dataclass(frozen=True)
class WeightRef:
    """Where a weight lives in the artifact's weights file."""

    name: str
    dtype: ir.DataType
    shape: tuple[int, ...]
    offset: int
    length: int


# A stored tensor's dtype name (exporter/weights.py) → its ONNX type
IR_DTYPES = {
    "fp32": ir.DataType.FLOAT,
    "fp16": ir.DataType.FLOAT16,
    "bf16": ir.DataType.BFLOAT16,
    "uint8": ir.DataType.UINT8,
}


def weight_refs(stored: Mapping) -> dict[str, WeightRef]:
    """References to the tensors of a weights file (``exporter/weights.py`` StoredTensor records:
    name, dtype name, shape, offset, length), each in its own stored type."""
    return {
        name: WeightRef(name, IR_DTYPES[t.dtype], tuple(t.shape), t.offset, t.length)
        for name, t in stored.items()
    }


@dataclass
class GraphBuilder:
    weights: Mapping[str, WeightRef]
    weights_file: str
    base_dir: Path
    # The matrices stored quantized (loopcast.quant.quantized_linears), by their float name:
    # the op sets' ``linear`` reads them through MatMulNBits.
    quantized: Mapping[str, QuantLinear] = field(default_factory=dict)
    # The size q, k, v and the KV buffers store each attention head in when the exporter padded the
    # heads (exporter/head_padding.py; the manifest's attention_head_size); None: head_dim.
    head_size: int | None = None
    tape: ir.tape.Tape = field(default_factory=ir.tape.Tape)
    inputs: list[ir.Value] = field(default_factory=list)
    outputs: list[ir.Value] = field(default_factory=list)
    _initializers: dict[str, ir.Value] = field(default_factory=dict)
    _overridable: list[ir.Value] = field(default_factory=list)
    # A repeated body (the cycle run's K cycles): node paths and value names of ops recorded
    # meanwhile get this prefix; inputs, weights and constants stay shared.
    scope: str = ""
    _built: ir.Model | None = None

    @property
    def activation_dtype(self) -> ir.DataType | None:
        """The activations' type: the stored type of the norms' weights, which stay float in every
        artifact (quantized ones included); None before any weights are known."""
        for name, ref in self.weights.items():
            if name.endswith("norm.weight"):
                return ref.dtype
        return None

    # -- values ------------------------------------------------------------------------------
    def input(self, name: str, dtype: ir.DataType, shape: Sequence[int | str]) -> ir.Value:
        """A graph input (asking twice for one name gives the same value: a repeated body's KV)."""
        for value in self.inputs:
            if value.name == name:
                return value
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(list(shape)))
        self.inputs.append(value)
        return value

    def output(
        self, value: ir.Value, dtype: ir.DataType, shape: Sequence[int | str], name: str | None = None
    ) -> ir.Value:
        """Declare a graph output (graph outputs carry their type and shape). A value a node makes
        takes the output's name itself (an Identity would copy it: 1.5 MB of logits a verify step);
        a graph input, or a value already declared, is copied under the name."""
        if name is not None and value.name != name:
            if value.producer() is not None and value not in self.outputs and value not in self.inputs:
                value.name = name
            else:
                value = self.op("Identity", [value], path=f"/outputs/{name}", out=name)
        value.type = ir.TensorType(dtype)
        value.shape = ir.Shape(list(shape))
        self.outputs.append(value)
        return value

    def weight(self, name: str) -> ir.Value:
        """The initializer for a stored weight (created once per graph, data stays external)."""
        if name not in self._initializers:
            ref = self.weights[name]
            tensor = ir.ExternalTensor(
                self.weights_file,
                ref.offset,
                ref.length,
                ref.dtype,
                shape=ir.Shape(list(ref.shape)),
                name=name,
                base_dir=str(self.base_dir),
            )
            self._initializers[name] = ir.Value(
                name=name, type=ir.TensorType(ref.dtype), shape=ir.Shape(list(ref.shape)), const_value=tensor
            )
        return self._initializers[name]

    def overridable_i64(self, name: str, values: Sequence[int]) -> ir.Value:
        """An int64 input with a default (an initializer listed among the graph inputs): callers
        that do not feed it get ``values``. ORT lists it under ``get_overridable_initializers``,
        not ``get_inputs``, so it stays out of the manifest's IO names."""
        value = self.const_i64(name, values)
        if value not in self._overridable:
            self._overridable.append(value)
        return value

    def const_i64(self, name: str, values: Sequence[int]) -> ir.Value:
        """A small int64 constant (shapes, axes), embedded in the graph."""
        if name not in self._initializers:
            tensor = ir.tensor(list(values), dtype=ir.DataType.INT64, name=name)
            self._initializers[name] = ir.Value(
                name=name,
                type=ir.TensorType(ir.DataType.INT64),
                shape=ir.Shape([len(values)]),
                const_value=tensor,
            )
        return self._initializers[name]

    def const_bool(self, name: str, values: Sequence[bool]) -> ir.Value:
        """A small bool constant (row patterns), embedded in the graph."""
        if name not in self._initializers:
            tensor = ir.tensor(np.array(values, dtype=np.bool_), name=name)
            self._initializers[name] = ir.Value(
                name=name,
                type=ir.TensorType(ir.DataType.BOOL),
                shape=ir.Shape([len(values)]),
                const_value=tensor,
            )
        return self._initializers[name]

    # -- ops ---------------------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        *,
        path: str,
        out: str,
        domain: str = "",
        **attributes,
    ) -> ir.Value:
        return self.tape.op(
            op_type,
            list(inputs),
            attributes or None,
            domain=domain,
            name=self._path(path),
            output=ir.Value(name=self._name(out)),
        )

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        *,
        path: str,
        outs: Sequence[str],
        domain: str = "",
        **attributes,
    ) -> Sequence[ir.Value]:
        return self.tape.op_multi_out(
            op_type,
            list(inputs),
            attributes or None,
            domain=domain,
            name=self._path(path),
            outputs=[ir.Value(name=self._name(n)) for n in outs],
        )

    def _path(self, path: str) -> str:
        return f"/{self.scope}{path}" if self.scope else path

    def _name(self, name: str) -> str:
        return f"{self.scope}.{name}" if self.scope else name

    def custom_ops(self) -> list[str]:
        """The ``loopcast``-domain op types of the graph (the manifest lists them): the built
        graph's, after its rewrites, else those recorded so far."""
        nodes = self._built.graph if self._built is not None else self.tape.nodes
        return sorted({n.op_type for n in nodes if n.domain == LOOPCAST_DOMAIN})

    # -- result ------------------------------------------------------------------------------
    def build(self, name: str, doc: str) -> ir.Model:
        opsets = {"": OPSET, MS_DOMAIN: 1}
        if any(node.domain == LOOPCAST_DOMAIN for node in self.tape.nodes):
            opsets[LOOPCAST_DOMAIN] = 1
        graph = ir.Graph(
            [*self.inputs, *self._overridable],
            self.outputs,
            nodes=self.tape.nodes,
            initializers=list(self._initializers.values()),
            opset_imports=opsets,
            name=name,
            doc_string=doc,
        )
        from loopcast.graphs import norm_prologue  # it imports this module

        if norm_prologue.enabled():  # the loopcast op set's norms into their projections
            norm_prologue.fuse_norm_prologues(graph)
        self._built = ir.Model(graph, ir_version=IR_VERSION, producer_name="loopcast")
        return self._built

    def spec(self, kind, file: str, rows, first_loop: int, last_loop: int) -> GraphSpec:
        """The manifest entry of the graph built here: its KV slots and input/output names."""
        slots = sorted(int(v.name.split(".")[1]) for v in self.inputs if v.name.startswith("past_key."))
        return GraphSpec(
            kind=kind,
            file=file,
            rows=rows,
            first_loop=first_loop,
            last_loop=last_loop,
            kv_slots=slots,
            inputs=[v.name for v in self.inputs],
            outputs=[v.name for v in self.outputs],
        )
