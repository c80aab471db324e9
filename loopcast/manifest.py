"""The artifact manifest (docs/architecture.md §4): everything a runtime — Python or C — needs to run it.

Torch-free: written by the exporter, read and validated by ``ort_runtime`` and the C example.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loopcast.config import ModelConfig
from loopcast.confined_files import (  # noqa: F401  (resolve_inside: re-exported)
    MANIFEST_MAX_BYTES,
    open_regular,
    read_confined_text,
    resolve_inside,
)
from loopcast.errors import ArtifactError
from loopcast.quant import QuantScheme
from loopcast.vocab import (  # noqa: F401  (re-exported: the manifest's vocabulary)
    BATCH_KINDS,
    CYCLE_KINDS,
    TREE_KINDS,
    GraphKind,
    OpSet,
    can_tree_verify,
    has_cycle,
)

# 3: every field written by the exporter is required (op_set, exact_verify, files, genai_files,
# max_batch, ...), and an artifact has exactly the graphs of loopcast.vocab.graph_plan. Older
# artifacts are refused with one line that says to re-export.
# 4: `quantization` (required; null for float weights: loopcast/quant.py).
# 5: `exit_depths` (required; the static depths k < R with graphs `prefill@k`, `decode@k`,
# `verify@k`: loopcast.vocab.graph_plan).
# 6: `loop_embed`, `loop_step`, `exit_head` beside `exits` (the exit gate's loop-skipping path).
# 7: `recurrent_cycle` in recurrent-depth artifacts built with the loopcast attention op (the
# pipeline's graph: graphs/recurrent_cycles.py); the cycle graph's `exit_gates_BR` (each row's
# exit-gate logit) where the model has the gate. Later in 7, optional (absent or null in older
# artifacts: heads of head_dim): `attention_head_size`, the padded size each attention head is
# stored in (q, k, v and the KV buffers; exporter/head_padding.py); `exact_verify_cpu`, the
# signature of the CPU the CPU exactness was measured on (loopcast/cpu_features.py).
SCHEMA_VERSION = 7
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"

# The vocabularies live in loopcast/vocab.py; these names are kept for the modules that import
# them from here.
OP_SETS = tuple(OpSet)
PREFILL, DECODE, VERIFY = GraphKind.PREFILL, GraphKind.DECODE, GraphKind.VERIFY
DRAFT, VERIFY_TAIL = GraphKind.DRAFT, GraphKind.VERIFY_TAIL
CYCLE, CYCLE_RUN = GraphKind.CYCLE, GraphKind.CYCLE_RUN
TREE_DRAFT, TREE_TAIL = GraphKind.TREE_DRAFT, GraphKind.TREE_TAIL
DECODE_BATCH, VERIFY_BATCH = GraphKind.DECODE_BATCH, GraphKind.VERIFY_BATCH
DRAFT_BATCH, VERIFY_TAIL_BATCH = GraphKind.DRAFT_BATCH, GraphKind.VERIFY_TAIL_BATCH
CYCLE_BATCH = GraphKind.CYCLE_BATCH
GRAPH_KINDS = tuple(k for k in GraphKind if k not in BATCH_KINDS)  # the single-sequence kinds
# prefill's overridable input: minus how many last rows get logits (default -1, the last row)
LOGIT_START = "logit_start"
LOGIT_ROWS = "logit_rows"  # the same as a positive count, in prefill graphs exported before logit_start


def lane_state_length(rows: int) -> int:
    """cycle_run's lane state: each row's position and token, the limit, the exit depth."""
    return 2 * rows + 2


# recurrent_cycle's lanes_N: the entering token and the leaving row, then one position per row
RECURRENT_LANE_HEADER = 2


def lane_record_length(rows: int) -> int:
    """One cycle's record in cycle_run's log (custom_ops/src/lane_step.h): positions, argmax per
    row, entering token, committed position and token, full-depth token, verified, accepted,
    discarded, drafted."""
    return 2 * rows + 8


def lane_log_length(rows: int, cycles: int) -> int:
    return cycles * lane_record_length(rows) + lane_state_length(rows)


@dataclass(frozen=True)
class GraphSpec:
    """One ONNX file: which rows it takes, which loops it runs and which KV slots it binds."""

    kind: GraphKind
    file: str
    rows: int | None  # None = dynamic (prefill)
    first_loop: int  # loops first_loop .. last_loop-1 are run
    last_loop: int
    kv_slots: list[int]  # slots bound as past_key.{s}/present_key.{s} (and value)
    inputs: list[str]
    outputs: list[str]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> GraphSpec:
        fields = {k: raw[k] for k in cls.__dataclass_fields__}
        return cls(**{**fields, "kind": GraphKind(fields["kind"])})


@dataclass(frozen=True)
class FileRecord:
    """Size and SHA-256 of one artifact file, written by the exporter. Sizes are checked on every
    load (a stat); hashes by ``loopcast inspect --verify`` and before loading native code."""

    size: int
    sha256: str
    sampled_sha256: str | None = None  # see sampled_sha256(): checked on every load
    hash: str = "sha256"  # how ``sha256`` was computed: one of HASH_SCHEMES


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    exporter_version: str
    model: dict[str, Any]  # Hugging Face style config (ModelConfig.to_hf_dict)
    dtype: str  # fp32 | fp16 | bf16
    max_length: int  # S_max of every KV buffer
    verify_width: int | None
    draft_depth: int | None
    kv_layout: dict[str, Any]
    graphs: dict[str, GraphSpec]  # by name: the kind, or ``kind@k`` at static depth k (vocab.depth_key)
    weights_file: str = WEIGHTS_FILE
    custom_ops: list[str] = field(default_factory=list)  # ops of the `loopcast` domain used
    custom_op_library: str | None = None
    tokenizer_files: list[str] = field(default_factory=list)
    eos_token_ids: list[int] = field(default_factory=list)
    # ``export --genai``: the ONNX Runtime GenAI graph and genai_config.json (exporter/genai.py)
    genai_files: list[str] = field(default_factory=list)
    # file name -> size and SHA-256; device -> whether verify rows are bit-identical to the M=1
    # decode rows there (declared, never sniffed: docs/architecture.md §4, §6). Speculation
    # returns plain greedy's tokens by construction only where exact_verify is true.
    files: dict[str, FileRecord] = field(default_factory=dict)
    exact_verify: dict[str, bool] = field(default_factory=dict)
    op_set: OpSet = OpSet.STOCK
    # ``export --max-batch B``: the batched kinds (BATCH_KINDS) exist and take up to B sequences.
    max_batch: int | None = None
    # weight-only block quantization of the projections (and maybe the head); None: float weights
    quantization: QuantScheme | None = None
    # static depths k < R whose prefill/decode/verify graphs exist (``loops=k``); R is always there
    exit_depths: list[int] = field(default_factory=list)
    # what the weights were exported from: "safetensors" (a Hugging Face directory) or "gguf"
    source_format: str = "safetensors"
    # The size each attention head is stored in when the exporter padded the heads to one the CUDA
    # attention kernels take (Huginn-0125: 96 -> 128; exporter/head_padding.py): the graphs' q, k,
    # v and every KV buffer's last dimension (kv_layout.shape). None: head_dim, unpadded.
    attention_head_size: int | None = None
    # The CPU exact_verify["cpu"] was measured on (loopcast/cpu_features.py: the vector features
    # that pick MLAS's kernels), for op sets whose CPU rows depend on them (not batch-invariant);
    # the declaration holds on CPUs of this signature only. None: every CPU (the loopcast ops), or
    # an artifact written before the field.
    exact_verify_cpu: str | None = None

    @property
    def kv_head_size(self) -> int:
        """The last dimension of every KV buffer: the stored head size."""
        return self.attention_head_size or self.config.head_dim

    @property
    def device_lengths(self) -> bool:
        """The attention op reads both lengths on the device, so a step can be captured and
        replayed at any position (GroupQueryAttention reads total_sequence_length on the host)."""
        return OpSet(self.op_set).loopcast_attention

    @functools.cached_property
    def config(self) -> ModelConfig:
        # parsed once: generations read it on their set-up path (~10 us a parse)
        return ModelConfig.from_hf_dict(self.model)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def read(cls, artifact_dir: Path) -> Manifest:
        """Read and validate ``manifest.json``: schema (types, ranges, cross-field consistency),
        every named file confined to the artifact directory and present, and recorded sizes.
        Anything wrong is an ArtifactError naming the file and field."""
        from loopcast.manifest_schema import check_files, parse_manifest

        path = Path(artifact_dir) / MANIFEST_FILE
        if not Path(artifact_dir).exists():
            from loopcast.swap import recover

            recover(Path(artifact_dir), clean=False)  # an export killed mid-swap left a backup
        if not Path(artifact_dir).is_dir():
            raise ArtifactError(f"{artifact_dir}: artifact directory not found")
        # confined like every other file: a manifest.json that is a symlink leaving the
        # artifact, a FIFO or an oversized file is refused before it is read
        text = read_confined_text(
            artifact_dir, MANIFEST_FILE, "manifest", max_bytes=MANIFEST_MAX_BYTES, required=False
        )
        if text is None:
            raise ArtifactError(f"{path}: manifest.json not found (not an exported artifact?)")
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ArtifactError(f"{path}: corrupt manifest ({exc})") from None
        if not isinstance(raw, dict):
            raise ArtifactError(f"{path}: corrupt manifest (expected a JSON object)")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ArtifactError(
                f"{path}: manifest schema version {version!r}, this loopcast reads "
                f"version {SCHEMA_VERSION}; re-export the artifact"
            )
        manifest = parse_manifest(raw, path)
        check_files(manifest, Path(artifact_dir))
        return manifest


# Record hash schemes (FileRecord.hash): the file's SHA-256, or for big files the SHA-256 of its
# size (8 bytes, little endian) followed by the SHA-256 digests of its consecutive 64 MiB chunks,
# which threads compute in parallel (the weights of a 1.4B model: 2 s of one core's SHA-256).
CHUNKED_SHA256, CHUNK_BYTES = "sha256-chunks-64MiB", 64 << 20
HASH_SCHEMES = ("sha256", CHUNKED_SHA256)


def file_digest(path: Path, scheme: str = "sha256") -> str:
    if scheme == CHUNKED_SHA256:
        return chunked_sha256(path)
    if scheme != "sha256":
        raise ValueError(f"unknown hash scheme {scheme!r}")
    return sha256_file(path)


def chunked_sha256(path: Path) -> str:
    from concurrent.futures import ThreadPoolExecutor

    size = Path(path).stat().st_size
    with open_regular(path) as f:
        fd = f.fileno()
        # os.pread and hashlib release the GIL: the chunks are read and hashed in parallel
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            digests = list(
                pool.map(
                    lambda at: hashlib.sha256(os.pread(fd, CHUNK_BYTES, at)).digest(),
                    range(0, size, CHUNK_BYTES),
                )
            )
    return hashlib.sha256(size.to_bytes(8, "little") + b"".join(digests)).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


SAMPLE_CHUNKS, SAMPLE_BYTES = 16, 64 * 1024


def sampled_sha256(path: Path) -> str:
    """SHA-256 of 16 chunks of 64 KiB spread evenly over the file (the whole file when it is at
    most 1 MiB). Reading 1 MiB at most, every load can tell a zeroed, swapped or partly
    overwritten file of the right size; ``inspect --verify`` hashes everything."""
    digest = hashlib.sha256()
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size <= SAMPLE_CHUNKS * SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(SAMPLE_CHUNKS):
                f.seek(i * (size - SAMPLE_BYTES) // (SAMPLE_CHUNKS - 1))
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()
