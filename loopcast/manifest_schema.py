"""Validation of an artifact manifest (docs/architecture.md §4: an artifact is untrusted input).

``parse_manifest`` checks every field's type and range and the fields against each other
(model config vs graph loops and KV slots, verify width vs verify rows, KV shape vs max
length), and that each graph kind lists exactly the inputs and outputs its kind must have.
``check_files`` confines every named file to the artifact directory and compares recorded
sizes and sampled hashes (at most 1 MiB read per file, so start-up stays cheap on gigabyte
weights; the full hashes are ``inspect --verify``'s job). The runtime then
compares each ONNX session's real inputs and outputs with the spec (ort_runtime/loading/artifact.py).

Everything raises ArtifactError naming the manifest and the field; nothing here lets a
TypeError or KeyError out, because a corrupt manifest is input, not a bug.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from loopcast.config import ModelConfig
from loopcast.confined_files import confined_file, open_regular
from loopcast.errors import ArtifactError, LoopcastError
from loopcast.manifest import (
    HASH_SCHEMES,
    FileRecord,
    GraphSpec,
    Manifest,
    sampled_sha256,
)
from loopcast.quant import QuantScheme
from loopcast.vocab import (
    BATCH_KINDS,
    RECURRENT_BATCH_KINDS,
    RECURRENT_KINDS,
    SELF_BATCH_KINDS,
    TREE_KINDS,
    GraphKind,
    OpSet,
    graph_plan,
    parse_graph_key,
)

DTYPES = ("fp32", "fp16", "bf16")
MAX_HEAD_SIZE = 1024  # a stored attention head's size at most (attention_head_size)
_SHA256 = re.compile(r"[0-9a-f]{64}")


class _Fields:
    """Typed access to one JSON object of the manifest; errors name the dotted field path."""

    def __init__(self, raw: Any, where: str, manifest: Path) -> None:
        self.manifest, self.where = manifest, where
        if not isinstance(raw, dict):
            self.fail(f"must be a JSON object, got {type(raw).__name__}")
        self.raw = raw

    def fail(self, message: str, name: str | None = None):
        at = f"{self.where}.{name}" if self.where and name else (name or self.where)
        raise ArtifactError(f"{self.manifest}: corrupt manifest ({at} {message})")

    def get(self, name: str, kind, *, optional: bool = False, nullable: bool = False, default=None):
        """The field's value, of type ``kind``. ``optional``: it may be absent or null (then
        ``default``); ``nullable``: it must be present and may be null (then None)."""
        if name not in self.raw:
            if optional:
                return default
            self.fail("is missing", name)
        value = self.raw[name]
        if value is None and (optional or nullable):
            return default if optional else None
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            self.fail(f"must be an integer, got {value!r:.80}", name)
        if kind is not int and not isinstance(value, kind):
            self.fail(f"must be a {kind.__name__}, got {value!r:.80}", name)
        return value

    def int_in(
        self, name: str, lo: int, hi: int, *, optional: bool = False, nullable: bool = False
    ) -> int | None:
        value = self.get(name, int, optional=optional, nullable=nullable)
        if value is not None and not lo <= value <= hi:
            self.fail(f"must be in {lo}..{hi}, got {value}", name)
        return value

    def int_list(self, name: str, lo: int, hi: int, *, optional: bool = False) -> list[int]:
        values = self.get(name, list, optional=optional, default=[])
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                self.fail(f"must hold integers in {lo}..{hi}, got {v!r:.80}", name)
        return values

    def str_list(self, name: str, *, optional: bool = False) -> list[str]:
        values = self.get(name, list, optional=optional, default=[])
        if not all(isinstance(v, str) for v in values):
            self.fail("must be a list of strings", name)
        return values


def expected_io(
    kind: str, first_loop: int, slots: list[int], *, exit_gate: bool = False
) -> tuple[set[str], set[str]]:
    """The input and output names a graph of ``kind`` must have (graphs/kinds.py builds them);
    ``exit_gate``: the model has Ouro's exit gate (the cycle graph then gives each row's gate)."""
    inputs = {"input_ids_BS" if first_loop == 0 else "hidden_BSH", "seqlens_k", "total_sequence_length"}
    outputs = {"next_token_ids_BS", "logits_BSV"}
    if kind in RECURRENT_KINDS or kind in RECURRENT_BATCH_KINDS:  # graphs/recurrent.py
        inputs, outputs = {
            GraphKind.PRELUDE: ({"input_ids_BS"}, {"embedded_BSH"}),
            GraphKind.CORE_STEP: ({"state_BSH", "embedded_BSH"}, {"state_BSH_out"}),
            GraphKind.CODA: ({"state_BSH"}, outputs),
            GraphKind.PRELUDE_BATCH: ({"input_ids_BS"}, {"embedded_BSH"}),
            GraphKind.CORE_STEP_BATCH: ({"state_BSH", "embedded_BSH", "active_B"}, {"state_BSH_out"}),
            GraphKind.CODA_BATCH: ({"state_BSH"}, outputs),
        }[GraphKind(kind)]
        inputs = inputs | {"seqlens_k", "total_sequence_length"}
    if kind == GraphKind.RECURRENT_CYCLE:  # graphs/recurrent_cycles.py
        inputs = {"lanes_N", "state_0_BSH", "carried_BW2H"}
        outputs |= {"carried_BW2H_out"}
    if kind == GraphKind.CYCLE:
        inputs = {"lanes_W1", "carried_BWH"}
        outputs |= {"carried_BWH_out"} | ({"exit_gates_BR"} if exit_gate else set())
    if kind == GraphKind.CYCLE_RUN:  # writes its KV in place: no present outputs
        inputs = {"lane_state_N", "carried_BWH"} | {
            f"past_{kv}.{s}" for s in slots for kv in ("key", "value")
        }
        return inputs, {"carried_BWH_out", "lane_log_N"}
    if kind == GraphKind.CYCLE_BATCH:  # graphs/batched_cycle.py
        inputs = {"input_ids_BS", "carried_BWH", "row_address_W2"}
        outputs |= {"hidden_BWH_out"}
    if kind == GraphKind.DRAFT:
        outputs |= {"top2_gap_BS", "hidden_BSH_out"}
    if kind == GraphKind.DRAFT_BATCH:
        outputs |= {"hidden_BSH_out"}
    if kind == GraphKind.EXITS:
        outputs |= {"exit_gates_BR"}
    if kind == GraphKind.LOOP_EMBED:
        return {"input_ids_BS"}, {"embedded_BSH"}
    if kind == GraphKind.LOOP_STEP:  # graphs/loop_steps.py
        inputs = {"hidden_BSH", "seqlens_k", "total_sequence_length"}
        outputs = {"hidden_BSH_out", "exit_gates_BR"}
    if kind == GraphKind.EXIT_HEAD:
        inputs = {"hidden_BSH"}
    if kind in TREE_KINDS:  # per row: cache position, masked key range [lo, hi)
        inputs = {"input_ids_BS" if first_loop == 0 else "hidden_BSH", "row_address_S3"}
    if kind == GraphKind.TREE_DRAFT:
        outputs |= {"hidden_BSH_out", "top2_probs_BS2", "top2_ids_BS2"}
    for s in slots:
        inputs |= {f"past_key.{s}", f"past_value.{s}"}
        outputs |= {f"present_key.{s}", f"present_value.{s}"}
    return inputs, outputs


def expected_slots(
    config: ModelConfig, first_loop: int, last_loop: int, kind: str | None = None
) -> list[int]:
    """KV slots a graph running loops first..last-1 binds: those loops' core layers, the prelude
    when it starts from tokens, and the coda (docs/architecture.md §2 slot numbering). The
    recurrent kinds bind their part's slots only (core_step: step 0's, rebound per step)."""
    if kind in (GraphKind.PRELUDE, GraphKind.PRELUDE_BATCH):
        return [config.prelude_slot(l) for l in range(config.num_prelude_layers)]
    if kind in (GraphKind.CORE_STEP, GraphKind.CORE_STEP_BATCH):
        return [config.core_slot(0, l) for l in range(config.num_layers)]
    if kind in (GraphKind.CODA, GraphKind.CODA_BATCH):
        return [config.coda_slot(l) for l in range(config.num_coda_layers)]
    slots = {config.core_slot(r, l) for r in range(first_loop, last_loop) for l in range(config.num_layers)}
    if first_loop == 0:
        slots |= {config.prelude_slot(l) for l in range(config.num_prelude_layers)}
    slots |= {config.coda_slot(l) for l in range(config.num_coda_layers)}
    return sorted(slots)


def parse_manifest(raw: dict[str, Any], path: Path) -> Manifest:
    top = _Fields(raw, "", path)
    exporter_version = top.get("exporter_version", str)
    model = top.get("model", dict)
    try:
        config = ModelConfig.from_hf_dict(model)
    except LoopcastError as exc:
        raise ArtifactError(f"{path}: corrupt manifest (model: {exc})") from None
    except Exception as exc:  # any malformed value the config parser did not anticipate
        raise ArtifactError(f"{path}: corrupt manifest (model: {type(exc).__name__}: {exc})") from None
    dtype = top.get("dtype", str)
    if dtype not in DTYPES:
        top.fail(f"must be one of {', '.join(DTYPES)}, got {dtype!r:.40}", "dtype")
    R = config.num_loops
    max_length = top.int_in("max_length", 1, config.max_position_embeddings)
    verify_width = top.int_in("verify_width", 2, max_length, nullable=True)
    draft_depth = top.int_in("draft_depth", 1, R - 1, nullable=True) if R > 1 else None
    if R == 1 and top.get("draft_depth", int, nullable=True) is not None:
        top.fail("must be null for a model of one loop", "draft_depth")

    kv = _Fields(top.get("kv_layout", dict), "kv_layout", path)
    if kv.get("slots", int) != config.num_kv_slots:
        kv.fail(f"must be {config.num_kv_slots} (the model's KV slots), got {kv.raw['slots']}", "slots")
    # padded heads (exporter/head_padding.py): an even size above head_dim; absent: head_dim
    head_size = top.int_in("attention_head_size", config.head_dim + 1, MAX_HEAD_SIZE, optional=True)
    if head_size is not None and head_size % 2:
        top.fail(f"must be even (each rotary half is padded alike), got {head_size}", "attention_head_size")
    shape = [1, config.num_kv_heads, max_length, head_size or config.head_dim]
    if kv.get("shape", list) != shape:
        what = "attention_head_size" if head_size else "head_dim"
        kv.fail(f"must be {shape} (1, KV heads, max_length, {what}), got {kv.raw['shape']!r:.80}", "shape")

    op_set = top.get("op_set", str)
    if op_set not in tuple(OpSet):
        top.fail(f"must be one of {', '.join(OpSet)}, got {op_set!r:.40}", "op_set")
    op_set = OpSet(op_set)
    max_batch = top.int_in("max_batch", 1, MAX_BATCH, nullable=True)
    graphs_raw = top.get("graphs", dict)
    exit_depths = top.int_list("exit_depths", 1, max(R - 1, 1))
    if R == 1 and exit_depths:
        top.fail("must be empty for a model of one loop", "exit_depths")
    if exit_depths != sorted(set(exit_depths)):
        top.fail(f"must be increasing without repeats, got {exit_depths!r:.80}", "exit_depths")

    def known(key: str) -> bool:
        try:
            parse_graph_key(key)
        except ValueError:
            return False
        return True

    unknown = sorted(k for k in graphs_raw if not known(k))
    if unknown:
        top.fail(
            f"has unknown kind(s) {', '.join(map(repr, unknown))}; kinds are {', '.join(GraphKind)}",
            "graphs",
        )
    # The graphs are exactly those of graph_plan (the tree kinds, an export option, both or neither).
    tree = any(kind in graphs_raw for kind in TREE_KINDS)
    self_batch = any(kind in graphs_raw for kind in SELF_BATCH_KINDS)
    pipeline_batch = GraphKind.CYCLE_BATCH in graphs_raw  # an older batched artifact has none
    plans = graph_plan(
        config,
        op_set,
        verify_width=verify_width,
        draft_depth=draft_depth,
        tree=tree,
        max_batch=max_batch,
        exit_depths=exit_depths,
        self_batch=self_batch,
        pipeline_batch=pipeline_batch,
    )
    plan = {p.key: (p.rows, p.first_loop, p.last_loop) for p in plans}
    for kind in graphs_raw:
        if kind not in plan:
            top.fail(
                f"has a '{kind}' graph but verify_width/draft_depth/max_batch (or, for cycle and the tree "
                "kinds, the model and op_set) say there is none",
                "graphs",
            )
    for kind in plan:
        if kind not in graphs_raw:
            if kind in TREE_KINDS:
                top.fail(f"has one of the tree kinds ({', '.join(TREE_KINDS)}) without the other", "graphs")
            if kind in (GraphKind.PREFILL, GraphKind.DECODE):
                why = "every artifact needs"
            elif kind in BATCH_KINDS:
                why = f"max_batch {max_batch} declares"
            elif "@" in kind:
                why = f"exit_depths {exit_depths} declares"
            else:
                why = "the model, op_set, verify_width and draft_depth declare"
            top.fail(f"lacks the '{kind}' graph, which {why}", "graphs")
    graphs = {
        key: _parse_graph(key, spec_raw, plan[key], config, path) for key, spec_raw in graphs_raw.items()
    }

    weights_file = top.get("weights_file", str)
    custom_ops = top.str_list("custom_ops")
    library = top.get("custom_op_library", str, nullable=True)
    if custom_ops and library is None:
        raise ArtifactError(
            f"{path}: the graphs use custom ops {custom_ops} but the manifest names no custom_op_library"
        )
    if library is not None and ("/" in library or library in ("", ".", "..")):
        top.fail(f"must be a plain file name inside the artifact, got {library!r:.80}", "custom_op_library")
    tokenizer_files = top.str_list("tokenizer_files")
    eos = top.int_list("eos_token_ids", 0, config.vocab_size - 1)
    files = {}
    for name, record in top.get("files", dict).items():
        entry = _Fields(record, f"files[{name!r:.60}]", path)
        size = entry.int_in("size", 0, 2**62)
        digest = entry.get("sha256", str)
        sampled = entry.get("sampled_sha256", str, optional=True)
        for label, value in (("sha256", digest), ("sampled_sha256", sampled)):
            if value is not None and not _SHA256.fullmatch(value):
                entry.fail("must be 64 lowercase hex digits", label)
        scheme = entry.get("hash", str, optional=True, default="sha256")
        if scheme not in HASH_SCHEMES:
            entry.fail(f"must be one of {', '.join(HASH_SCHEMES)}, got {scheme!r:.40}", "hash")
        files[name] = FileRecord(size, digest, sampled, scheme)
    exact = top.get("exact_verify", dict)
    if not all(isinstance(k, str) and isinstance(v, bool) for k, v in exact.items()):
        top.fail("must map device names to true/false", "exact_verify")
    exact_cpu = top.get("exact_verify_cpu", str, optional=True)
    if exact_cpu is not None and len(exact_cpu) > 1024:
        top.fail(f"must be at most 1024 characters, got {len(exact_cpu)}", "exact_verify_cpu")
    genai_files = top.str_list("genai_files")
    quantization = _quantization(top, dtype, op_set)
    source_format = top.get("source_format", str, optional=True, default="safetensors")
    if source_format not in SOURCE_FORMATS:
        top.fail(f"must be one of {', '.join(SOURCE_FORMATS)}, got {source_format!r:.40}", "source_format")
    return Manifest(
        schema_version=raw["schema_version"],
        exporter_version=exporter_version,
        model=model,
        dtype=dtype,
        max_length=max_length,
        verify_width=verify_width,
        draft_depth=draft_depth,
        kv_layout=kv.raw,
        graphs=graphs,
        weights_file=weights_file,
        custom_ops=custom_ops,
        custom_op_library=library,
        tokenizer_files=tokenizer_files,
        eos_token_ids=eos,
        files=files,
        exact_verify=exact,
        op_set=op_set,
        genai_files=genai_files,
        max_batch=max_batch,
        quantization=quantization,
        exit_depths=exit_depths,
        source_format=source_format,
        attention_head_size=head_size,
        exact_verify_cpu=exact_cpu,
    )


SOURCE_FORMATS = ("safetensors", "gguf")


def _quantization(top: _Fields, dtype: str, op_set: OpSet) -> QuantScheme | None:
    """The ``quantization`` record (loopcast/quant.py): null, or a scheme the exporter writes."""
    raw = top.get("quantization", dict, nullable=True)
    if raw is None:
        return None
    q = _Fields(raw, "quantization", top.manifest)
    keys = ("method", "layers", "block_size", "symmetric", "head", "embedding", "accuracy_level")
    fields = {
        k: q.get(k, bool if k == "symmetric" else int if k in ("block_size", "accuracy_level") else str)
        for k in keys
    }
    fields["float_zero_points"] = q.get("float_zero_points", bool, optional=True, default=False)
    keys += ("float_zero_points",)
    if set(raw) - set(keys):
        q.fail(f"unknown fields {sorted(set(raw) - set(keys))!r:.80}")
    try:
        scheme = QuantScheme.from_dict(fields)
    except LoopcastError as exc:
        q.fail(str(exc))
    if dtype != "fp32" and scheme.embedding != "float":
        q.fail(f"a quantized embedding needs fp32 (GatherBlockQuantized's fp32 rows), got {dtype}")
    if dtype != "fp32" and op_set is not OpSet.LOOPCAST:
        q.fail(
            f"quantized {dtype} weights need the loopcast op set (BatchInvariantMatMulNBits), got {op_set}"
        )
    return scheme


MAX_BATCH = 1024  # sequences of a batched graph (docs/serving.md); KV memory is max_batch x one sequence's


def _parse_graph(key: str, raw: Any, plan: tuple, config: ModelConfig, path: Path) -> GraphSpec:
    g = _Fields(raw, f"graphs.{key}", path)
    kind = parse_graph_key(key)[0].value
    rows, first, last = plan
    if g.get("kind", str) != kind:
        g.fail(f"must be {kind!r}, got {raw['kind']!r:.40}", "kind")
    file = g.get("file", str)
    got_rows = g.get("rows", int, optional=True)
    if got_rows != rows:
        g.fail(
            f"must be {rows if rows is not None else 'null (dynamic)'} for this kind, got {got_rows!r}",
            "rows",
        )
    got_first, got_last = g.get("first_loop", int), g.get("last_loop", int)
    if (got_first, got_last) != (first, last):
        g.fail(
            f"loops must be {first}..{last} (R={config.num_loops}), got {got_first}..{got_last}",
            "first_loop/last_loop",
        )
    slots = g.int_list("kv_slots", 0, config.num_kv_slots - 1)
    if sorted(slots) != expected_slots(config, first, last, kind) or len(set(slots)) != len(slots):
        want = expected_slots(config, first, last, kind)
        g.fail(f"must be {want} for loops {first}..{last - 1}, got {slots!r:.120}", "kv_slots")
    inputs, outputs = g.str_list("inputs"), g.str_list("outputs")
    want_in, want_out = expected_io(kind, first, slots, exit_gate=config.has_exit_gate)
    for label, got, want in (("inputs", inputs, want_in), ("outputs", outputs, want_out)):
        if set(got) != want or len(got) != len(want):
            extra, missing = sorted(set(got) - want), sorted(want - set(got))
            g.fail(f"do not match a {kind} graph (missing {missing[:4]}, unexpected {extra[:4]})", label)
    return GraphSpec(
        kind=kind,
        file=file,
        rows=got_rows,
        first_loop=first,
        last_loop=last,
        kv_slots=slots,
        inputs=inputs,
        outputs=outputs,
    )


def check_files(manifest: Manifest, artifact_dir: Path) -> None:
    """Every file the manifest names is a regular file inside the artifact, of its recorded size."""
    named = [(spec.file, f"graph file for '{kind}'") for kind, spec in manifest.graphs.items()]
    named.append((manifest.weights_file, "weights file"))
    if manifest.custom_op_library:
        named.append((manifest.custom_op_library, "custom-op library"))
    named += [(name, "tokenizer file") for name in manifest.tokenizer_files]
    named += [(name, "GenAI file") for name in manifest.genai_files]
    named += [(name, "recorded file") for name in manifest.files]
    for name, what in named:
        target = confined_file(artifact_dir, name, what)  # a regular file inside; stat only
        assert target is not None
        record = manifest.files.get(name)
        if record is not None and target.stat().st_size != record.size:
            raise ArtifactError(
                f"{target}: {what} has {target.stat().st_size} bytes, the manifest records "
                f"{record.size} (truncated or replaced; re-export the artifact)"
            )
        if (
            record is not None
            and record.sampled_sha256 is not None
            and sampled_sha256(target) != record.sampled_sha256
        ):
            raise ArtifactError(
                f"{target}: {what} does not match the manifest (sampled SHA-256 differs: corrupted, "
                "zeroed or replaced; loopcast inspect --verify checks every byte)"
            )
    check_weights_header(artifact_dir / manifest.weights_file)


def check_weights_header(weights: Path) -> None:
    """A safetensors file at least as long as its own header says: catches a truncated weights
    file even in an artifact that records no sizes, by reading only the header."""
    import json
    import struct

    try:
        with open_regular(weights, "weights file") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
            if length is None or length > 100 * 2**20:
                raise ValueError("no valid header length")
            header = json.loads(f.read(length))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        need = 8 + length + max(ends, default=0)
    except OSError as exc:
        raise ArtifactError(f"{weights}: weights file unreadable ({exc.strerror})") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise ArtifactError(
            f"{weights}: weights file is not a safetensors file ({type(exc).__name__}: {str(exc)[:120]})"
        ) from None
    if weights.stat().st_size < need:
        raise ArtifactError(
            f"{weights}: weights file is truncated ({weights.stat().st_size} bytes, its header "
            f"needs {need}); re-export the artifact"
        )


def verify_hashes(manifest: Manifest, artifact_dir: Path) -> list[str]:
    """Hash every recorded file (slow on big weights: ``inspect --verify``). Returns the lines of
    a report; raises ArtifactError on the first mismatch."""
    from loopcast.manifest import file_digest

    if not manifest.files:
        raise ArtifactError(f"{artifact_dir}: the manifest records no hashes; re-export to verify it")
    named = [spec.file for spec in manifest.graphs.values()] + [manifest.weights_file]
    named += [manifest.custom_op_library] if manifest.custom_op_library else []
    unrecorded = [name for name in named if name not in manifest.files]
    if unrecorded:
        raise ArtifactError(f"{artifact_dir}: the manifest records no hash for {', '.join(unrecorded)}")
    lines = []
    for name, record in manifest.files.items():
        target = confined_file(artifact_dir, name, "recorded file", max_bytes=record.size)
        assert target is not None
        digest = file_digest(target, record.hash)
        if digest != record.sha256:
            raise ArtifactError(
                f"{target}: SHA-256 {digest[:16]}… does not match the manifest's "
                f"{record.sha256[:16]}… (corrupted or replaced; re-export the artifact)"
            )
        lines.append(f"  ok  {name:<24} {record.size:>12} bytes  sha256 {digest[:16]}…")
    return lines
