"""Structural checks of every exported graph: standard ONNX + com.microsoft, no control flow."""

from __future__ import annotations

import json
from collections import Counter

import onnx
import onnxruntime as ort
import pytest
from loopcast.graphs.cycles import CYCLE_RUN_LENGTH

from tests.artifacts import artifact, config_of
from tests.custom_ops.conftest import require_c_toolchain


def _graphs(path):
    manifest = json.loads((path / "manifest.json").read_text())
    for kind, spec in manifest["graphs"].items():
        yield kind, spec, path / spec["file"]


@pytest.mark.parametrize(
    "name,dtype",
    [
        ("ouro-r3", "fp32"),
        ("llama-tied-gqa", "fp32"),
        ("ouro-r2-gqa", "fp16"),
        ("ouro-r2-gqa", "bf16"),
        ("llama-untied", "bf16"),
    ],
)
def test_checker_and_shape_inference_pass(name: str, dtype: str) -> None:
    path = artifact(name, dtype=dtype, ops="stock")  # the stock op set: ONNX + com.microsoft only
    for kind, spec, file in _graphs(path):
        onnx.checker.check_model(str(file), full_check=True)  # path form: external data resolved lazily
        model = onnx.load(str(file), load_external_data=False)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
        ops = {(n.domain or "ai.onnx", n.op_type) for n in model.graph.node}
        assert not {op for _, op in ops} & {"Loop", "If", "Scan"}, f"{kind}: control flow blocks CUDA graphs"
        layerless = kind in ("loop_embed", "exit_head")  # the embedding, the head (graphs/loop_steps.py)
        assert layerless or ("com.microsoft", "GroupQueryAttention") in ops
        assert layerless or ("com.microsoft", "SkipSimplifiedLayerNormalization") in ops
        assert {d for d, _ in ops} <= {"ai.onnx", "com.microsoft"}
        assert all(n.name.startswith("/") for n in model.graph.node), "node names are paths"
        # weights are external references into the one shared file, never embedded copies
        for init in model.graph.initializer:
            if init.data_type != onnx.TensorProto.INT64:
                locations = {e.key: e.value for e in init.external_data}
                assert locations.get("location") == "weights.safetensors", init.name
        assert len(spec["kv_slots"]) > 0 or layerless


@pytest.mark.parametrize("name", ["ouro-r3", "llama-untied"])
def test_ort_loads_with_all_optimizations(name: str) -> None:
    path = artifact(name)
    library = json.loads((path / "manifest.json").read_text()).get("custom_op_library")
    for _kind, _, file in _graphs(path):
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if library:
            so.register_custom_ops_library(str(path / library))
        ort.InferenceSession(str(file), so, providers=["CPUExecutionProvider"])


def test_artifact_stores_weights_once() -> None:
    path = artifact("demo")
    weights = (path / "weights.safetensors").stat().st_size
    total = sum(f.stat().st_size for f in path.iterdir())
    tokenizer = sum((path / n).stat().st_size for n in ("tokenizer.json", "tokenizer_config.json"))
    library = sum(f.stat().st_size for f in path.glob("*.so"))  # the op library is code, not weights
    assert total - tokenizer - library <= 1.05 * weights


@pytest.mark.parametrize("name", ["ouro-r3", "llama-untied"])
def test_loopcast_op_layers_are_fused(name: str) -> None:
    """With the loopcast ops a layer is 7 nodes: qkv, attention, o_proj, ResidualRMSNorm,
    gate_up, down (with swiglu=1: the activation is applied as it loads [gate | up]),
    ResidualRMSNorm (which also carries the loop-norm and the next layer's input norm); the
    stack's first norm is one more ResidualRMSNorm, with no residual."""
    require_c_toolchain()  # the export builds the custom-op library
    cfg = config_of(name)
    path = artifact(name, draft_depth=1 if cfg.num_loops > 1 else None, batch_invariant=True)
    for kind, spec, file in _graphs(path):
        nodes = onnx.load(str(file), load_external_data=False).graph.node
        counts = Counter(n.op_type for n in nodes)
        layers = (
            (spec["last_loop"] - spec["first_loop"]) * cfg.num_layers
            + cfg.num_coda_layers
            + (cfg.num_prelude_layers if spec["first_loop"] == 0 else 0)
        )
        if kind == "cycle":  # one pass over the core layers, attention addressed per row
            layers = cfg.num_layers
            # the lanes input split into token and positions, the state shift, the entry concat;
            # Ouro's gate row by row (a slice, one stock MatMul and one Add per row, one concat)
            R = cfg.num_loops
            assert counts["RowAttention"] == layers and counts["Slice"] == 3 + R and counts["Concat"] == 2
            assert counts.pop("MatMul") == R and counts.pop("Add") == R
            counts.pop("Slice"), counts.pop("Concat")
        elif kind == "cycle_run":  # K cycles, each: one pass, the argmax, the lane schedule
            K = counts["LaneStep"]
            assert K == CYCLE_RUN_LENGTH and counts["ArgMax"] == K
            layers = K * cfg.num_layers
            assert counts["RowAttention"] == layers and counts["Slice"] == 2 + K and counts["Concat"] == K + 1
            assert all(
                a.i == 1
                for n in nodes
                if n.op_type == "RowAttention"
                for a in n.attribute
                if a.name == "kv_in_place"
            )
            assert sum(a.name == "kv_in_place" for n in nodes for a in n.attribute) == layers
        else:
            assert counts["BatchInvariantAttention"] == layers, kind
        stacks = counts.get("LaneStep", 1)  # each stack opens with one norm more (a cycle run: K stacks)
        if kind in ("exits", "loop_step"):  # a stack per loop; the gate: one stock MatMul, one Add
            stacks = cfg.num_loops if kind == "exits" else 1
            assert counts.pop("MatMul") == 1 and counts.pop("Add") == 1
        if kind in ("loop_embed", "exit_head"):  # no layers, no stack
            stacks = 0
        assert counts["ResidualRMSNorm"] == 2 * layers + stacks and counts["SwiGLU"] == 0, kind
        gated = [n for n in nodes if any(a.name == "swiglu" and a.i == 1 for a in n.attribute)]
        assert len(gated) == layers and all(n.name.endswith("/mlp/down_proj") for n in gated), kind
        assert counts["Split"] == (1 if kind == "draft" else 0), kind  # the draft's top-2 gap only
        assert not counts.keys() & {
            "Add",
            "Sigmoid",
            "Mul",
            "MatMul",
            "GroupQueryAttention",
            "RMSNormalization",
            "SkipSimplifiedLayerNormalization",
        }, kind


def test_norm_prologue_folds_the_norms_into_the_projections(tmp_path, monkeypatch) -> None:
    """LOOPCAST_NORM_PROLOGUE=1 (graphs/norm_prologue.py): a layer is 5 nodes, qkv and gate_up
    carrying the norm before them; each stack ends on one ResidualRMSNorm, which no projection
    follows. (The rewrite keeps every bit: tests/graphs/test_norm_prologue_rewrite.py.)"""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from tests.artifacts import checkpoint

    require_c_toolchain()
    monkeypatch.setenv("LOOPCAST_NORM_PROLOGUE", "1")
    cfg = config_of("ouro-r3")
    path = tmp_path / "fused"
    export_checkpoint(checkpoint("ouro-r3"), path, ExportOptions("fp32", None, 5, 1, True, "auto"))
    kinds = {kind: file for kind, _, file in _graphs(path)}
    for kind in ("decode", "verify", "draft", "verify_tail"):
        nodes = onnx.load(str(kinds[kind]), load_external_data=False).graph.node
        counts = Counter(n.op_type for n in nodes)
        layers = counts["BatchInvariantAttention"]
        assert layers % cfg.num_layers == 0 and layers > 0, kind
        assert counts["ResidualRMSNorm"] == 1, kind
        prologue = [n for n in nodes if n.op_type == "BatchInvariantMatMul" and len(n.input) > 2]
        assert len(prologue) == 2 * layers, kind
        assert all(n.name.endswith(("/attn/qkv_proj", "/mlp/gate_up_proj")) for n in prologue), kind
        assert sum(len(n.output) == 2 for n in prologue) == 2 * layers - 1, kind  # the first: no sum
