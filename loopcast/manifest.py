"""The artifact manifest (DESIGN §4): everything a runtime — Python or C — needs to run it.

Torch-free: written by the exporter, read and validated by ``ort_runtime`` and the C example.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopcast.config import ModelConfig
from loopcast.errors import ArtifactError

SCHEMA_VERSION = 2  # 2: op_set and exact_verify declared
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"

# Op sets a graph can be built with (docs/architecture.md, "Op sets and exactness"):
#   stock               ONNX + com.microsoft ops only (GroupQueryAttention, MatMul)
#   loopcast-attention  the loopcast attention op (row-invariant, lengths read on the device), stock
#                       MatMul and norms: exact on the CPU at stock MatMul speed
#   loopcast            every hot op from the loopcast library (batch-invariant on CPU and CUDA)
OP_SETS = ("stock", "loopcast-attention", "loopcast")

# Graph kinds (DESIGN §3).
PREFILL, DECODE, VERIFY, DRAFT, VERIFY_TAIL = "prefill", "decode", "verify", "draft", "verify_tail"
GRAPH_KINDS = (PREFILL, DECODE, VERIFY, DRAFT, VERIFY_TAIL)


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX file: which rows it takes, which loops it runs and which KV slots it binds."""

    kind: str
    file: str
    rows: int | None              # None = dynamic (prefill)
    first_loop: int               # loops first_loop .. last_loop-1 are run
    last_loop: int
    kv_slots: list[int]           # slots bound as past_key.{s}/present_key.{s} (and value)
    inputs: list[str]
    outputs: list[str]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GraphSpec:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    exporter_version: str
    model: dict[str, Any]                 # Hugging Face style config (ModelConfig.to_hf_dict)
    dtype: str                            # fp32 | fp16 | bf16
    max_length: int                       # S_max of every KV buffer
    verify_width: int | None
    draft_depth: int | None
    kv_layout: dict[str, Any]
    graphs: dict[str, GraphSpec]
    weights_file: str = WEIGHTS_FILE
    custom_ops: list[str] = field(default_factory=list)       # ops of the `loopcast` domain used
    custom_op_library: str | None = None
    tokenizer_files: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    # ``export --genai``: the ONNX Runtime GenAI graph and genai_config.json (exporter/genai.py)
    genai_files: list[str] = field(default_factory=list)
    # Per device ("cpu", "cuda"): are verify rows bit-identical to the M=1 decode rows there?
    # Speculation returns plain greedy's tokens by construction only where this is true.
    exact_verify: dict[str, bool] = field(default_factory=dict)
    op_set: str = "stock"

    @property
    def device_lengths(self) -> bool:
        """The attention op reads both lengths on the device, so a step can be captured and
        replayed at any position (GroupQueryAttention reads total_sequence_length on the host)."""
        return self.op_set != "stock"

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.model)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def read(cls, artifact_dir: Path) -> Manifest:
        path = Path(artifact_dir) / MANIFEST_FILE
        if not Path(artifact_dir).is_dir():
            raise ArtifactError(f"{artifact_dir}: artifact directory not found")
        if not path.is_file():
            raise ArtifactError(f"{path}: manifest.json not found (not an exported artifact?)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{path}: corrupt manifest ({exc})") from None
        if not isinstance(raw, dict):
            raise ArtifactError(f"{path}: corrupt manifest (expected a JSON object)")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(f"{path}: manifest schema version {version!r}, this loopcast reads "
                                f"version {SCHEMA_VERSION}; re-export the artifact")
        try:
            graphs = {k: GraphSpec.from_dict(v) for k, v in raw["graphs"].items()}
            fields = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw and k != "graphs"}
            manifest = cls(graphs=graphs, **fields)
            manifest.config  # validates the model config
        except (KeyError, TypeError, AttributeError) as exc:
            raise ArtifactError(f"{path}: corrupt manifest (bad or missing field {exc})") from None
        for spec in manifest.graphs.values():
            if not (Path(artifact_dir) / spec.file).is_file():
                raise ArtifactError(f"{Path(artifact_dir) / spec.file}: graph file for '{spec.kind}' is missing")
        if not (Path(artifact_dir) / manifest.weights_file).is_file():
            raise ArtifactError(f"{Path(artifact_dir) / manifest.weights_file}: weights file is missing")
        library = manifest.custom_op_library
        if manifest.custom_ops and not library:
            raise ArtifactError(f"{path}: the graphs use custom ops {manifest.custom_ops} but the manifest "
                                "names no custom_op_library")
        if library and (Path(library).name != library or not (Path(artifact_dir) / library).is_file()):
            raise ArtifactError(f"{Path(artifact_dir) / library}: custom-op library is missing (it must be a "
                                "file inside the artifact)")
        return manifest
