"""Open an artifact: validate the manifest, create one ORT session per graph kind.

Weights: every graph references the one ``weights.safetensors`` as external data. Left to
itself, ORT gives every session its own copy: on CUDA a device copy per session, on the CPU a
mapping per session plus, for the stock MatMul, a private *prepacked* copy per session (the
shared prepacked-weights container is in ORT's C API only). Two mechanisms keep one copy:
- shared initializers (``ort_runtime/loading/shared_weights.py``): one OrtValue per weight, handed to
  every session with ``add_initializer``: on CUDA always, on the CPU where nothing prepacks
  (the loopcast op set, or ``share_weights=True``);
- fewer sessions where prepacking must stay: on the CPU, decode and verify run on prefill's
  session (prefill returns logits for its last ``-logit_start`` rows, default 1, and fed the
  kind's row count it is the same computation), so one packed copy serves the three kinds;
  the rows are bit-identical to the decode and verify graphs' own
  (tests/ort_runtime/test_weight_sharing.py) at the same speed. Prepacking is kept because
  without it an M=1 MatMul takes MLAS's GEMV path and an M>1 one repacks per call, so decode
  rows would no longer be verify rows bit for bit and verify runs 2-3x slower
  (``share_weights=True`` turns it off: ``exact_verify`` is then false for the stock MatMul).
Numbers and commands: docs/perf.md ("Run-time memory").

Several sessions alternate on the same cores; whether their intra-op threads spin between ops
is ``open_artifact(spin=...)``'s choice (``ort_runtime/loading/thread_pool.py`` says why).

CUDA graphs (docs/architecture.md §5): every fixed-width kind (decode, verify, draft, verify_tail) gets a
session with ``enable_cuda_graph``; each generator takes its own ``gpu_graph_id`` per kind from
the kind's ``GraphIdPool`` (a captured graph bakes in the addresses of that generator's
buffers). Prefill has dynamic rows and runs in an ordinary session. A kind whose graph session
cannot be made falls back to an eager session; the reason is kept in ``graph_fallbacks``.

Only graphs whose every per-step input lives on the device are captured: GroupQueryAttention
reads ``total_sequence_length`` on the host, and a captured graph freezes that host value, so
stock graphs replayed at later positions gave wrong logits on the H200 (verify rows off by up
to 15, speculative tokens diverging; docs/perf.md). Stock graphs therefore run eagerly on CUDA;
``export --batch-invariant`` graphs (the loopcast attention op reads both lengths on the
device) are captured. ``cuda_graphs="always"`` captures anyway, for timing a step replayed
at one fixed position only.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime as ort
from loopcast.ort_runtime.loading import thread_pool
from loopcast.ort_runtime.loading.graph_ids import GraphIdPool
from loopcast.ort_runtime.loading.op_attributes import check_cuda_shapes, check_op_attributes
from loopcast.ort_runtime.loading.pinned_files import check_unchanged
from loopcast.ort_runtime.loading.session_table import SessionTable
from loopcast.ort_runtime.loading.shared_weights import SharedWeights, load_shared_weights
from loopcast.ort_runtime.loading.trust import op_library_to_load

from loopcast.confined_files import TOKENIZER_MAX_BYTES, read_confined_text
from loopcast.cpu_features import same_cpu_kernels
from loopcast.devices import CUDA_INSTALL_ADVICE
from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import (
    BATCH_KINDS,
    CYCLE,
    CYCLE_RUN,
    DECODE,
    LOGIT_ROWS,
    LOGIT_START,
    PREFILL,
    VERIFY,
    Manifest,
)
from loopcast.vocab import (
    LOOP_STEP_KINDS,
    RECURRENT_BATCH_KINDS,
    RECURRENT_KINDS,
    GraphKind,
    OpSet,
    depth_key,
    parse_graph_key,
)

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
BATCH_DIM = "batch"  # the symbolic batch dimension of the batched kinds' inputs and outputs


@dataclass
class LoadedModel:
    """An opened artifact: manifest, sessions (shared by every generator) and tokenizer."""

    path: Path
    manifest: Manifest
    device: str
    sessions: Mapping[str, ort.InferenceSession]  # a SessionTable: some kinds made on first use
    tokenizer: object | None = None
    load_seconds: float = 0.0
    graph_kinds: frozenset[str] = frozenset()  # kinds whose session captures CUDA graphs
    graph_fallbacks: dict[str, str] = field(default_factory=dict)  # kind -> why it runs eager
    # kind -> the kind whose session (and packed weights) it runs on, e.g. {"decode": "prefill"}
    shared_sessions: dict[str, str] = field(default_factory=dict)
    prepacked: bool = True  # False under share_weights=True
    # the one copy of the weights every session uses (ort_runtime/loading/shared_weights.py);
    # None: each its own
    shared_weights: SharedWeights | None = None
    _graph_ids: dict[str, GraphIdPool] = field(default_factory=dict, repr=False)  # kind -> its pool
    _eager: dict[str, ort.InferenceSession] = field(default_factory=dict, repr=False)
    _captured: dict[str, ort.InferenceSession | None] = field(default_factory=dict, repr=False)
    _session_factory: object = field(default=None, repr=False)
    # Generators may be made from several threads (LoopcastModel's pool): ids and lazily made
    # eager sessions are handed out under this lock. ORT sessions themselves are thread-safe.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def config(self):
        return self.manifest.config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.manifest.eos_token_ids)

    @property
    def exact_verify(self) -> bool:
        """Whether this artifact's verify rows equal its decode rows bit for bit on this device
        (declared by the exporter in the manifest; missing means no). The CPU declaration was
        measured with prepacked weights; without prepacking (``share_weights=True``) MLAS runs
        one-row MatMuls on its GEMV path and the rows differ, so it does not hold there for the
        op sets that use the stock MatMul (the loopcast MatMul never prepacks). Nor on a CPU whose
        vector features pick other MLAS kernels than the exporting CPU's (the manifest's
        ``exact_verify_cpu``; loopcast/cpu_features.py)."""
        if self.device == "cpu" and not OpSet(self.manifest.op_set).batch_invariant:
            if not self.prepacked or not same_cpu_kernels(self.manifest.exact_verify_cpu):
                return False
        return bool(self.manifest.exact_verify.get(self.device, False))

    def has(self, kind: str) -> bool:
        return kind in self.sessions

    def graph_ids(self, kind: str) -> GraphIdPool:
        """The ``gpu_graph_id`` pool of ``kind``'s capture session (one per kind: a kind has one
        capture session, ``sessions[kind]`` or, for the batched kinds, ``capture_session(kind)``)."""
        with self._lock:
            pool = self._graph_ids.get(kind)
            if pool is None:
                pool = self._graph_ids[kind] = GraphIdPool()
            return pool

    def capture_session(self, kind: str) -> ort.InferenceSession | None:
        """A CUDA-graph session of a batched kind (opened eagerly by default, docs/serving.md),
        made on first use and shared; None where it cannot be made (then run eagerly)."""
        with self._lock:
            if kind not in self._captured:
                try:
                    self._captured[kind] = self._session_factory(kind, True)
                except ArtifactError as exc:
                    self.graph_fallbacks[kind] = str(exc)
                    self._captured[kind] = None
            return self._captured[kind]

    def eager_session(self, kind: str) -> ort.InferenceSession:
        """An uncaptured session of ``kind``, for slots whose capture failed (made on first use)."""
        if kind not in self.graph_kinds:
            return self.sessions[kind]
        with self._lock:
            if kind not in self._eager:
                self._eager[kind] = self._session_factory(kind, False)
            return self._eager[kind]


def _session_options(
    library: Path | None, threads: int | None, share_weights: bool, spin: bool | None = None
) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    thread_pool.configure(so, threads, spin)
    prefix = os.environ.get("LOOPCAST_ORT_PROFILE")
    if prefix:  # ONNX Runtime's profiler, one JSON per session (tools/bench/profile_ops.py reads them)
        so.enable_profiling = True
        so.profile_file_prefix = prefix
    if share_weights:
        so.add_session_config_entry("session.disable_prepacking", "1")
    if library is not None:  # already passed the trust rule (ort_runtime/loading/trust.py)
        try:
            so.register_custom_ops_library(str(library))
        except Exception as exc:  # ORT raises a generic error type
            raise ArtifactError(f"{library}: custom-op library could not be loaded ({exc})") from None
    return so


_ORT_TYPES = {"fp32": "tensor(float)", "fp16": "tensor(float16)", "bf16": "tensor(bfloat16)"}


def check_session_io(session: ort.InferenceSession, spec, manifest: Manifest, file: Path) -> None:
    """The ONNX file really is the manifest's graph of that kind: same input/output names, KV
    buffers of the manifest's shape and dtype, the manifest's rows and vocabulary. Catches a graph
    swapped for another kind's or for one exported with another max length."""
    inputs = {v.name: v for v in session.get_inputs()}
    outputs = {v.name: v for v in session.get_outputs()}
    for label, got, want in (("inputs", inputs, spec.inputs), ("outputs", outputs, spec.outputs)):
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise ArtifactError(
                f"{file}: the graph's {label} do not match the manifest's '{spec.kind}' graph "
                f"(missing {missing[:4]}, unexpected {extra[:4]}); is it another kind's graph?"
            )
    cfg = manifest.config
    # batched kinds (graphs/batched.py) take a symbolic batch of sequences
    kv_shape = [
        BATCH_DIM if spec.kind in BATCH_KINDS else 1,
        cfg.num_kv_heads,
        manifest.max_length,
        manifest.kv_head_size,
    ]
    for slot in spec.kv_slots:
        for name in (f"past_key.{slot}", f"past_value.{slot}"):
            if list(inputs[name].shape) != kv_shape or inputs[name].type != _ORT_TYPES[manifest.dtype]:
                raise ArtifactError(
                    f"{file}: input {name} is {inputs[name].type} {inputs[name].shape}, the manifest "
                    f"says {_ORT_TYPES[manifest.dtype]} {kv_shape} (exported with another max "
                    "length or dtype?)"
                )
    if spec.kind == CYCLE:  # [entering token, one position per row]
        first = "lanes_W1"
        rows = inputs[first].shape[0] - 1 if len(inputs[first].shape) == 1 else None
    elif spec.kind == CYCLE_RUN:  # one lane state per row, carried between calls
        first = "carried_BWH"
        rows = inputs[first].shape[1] if len(inputs[first].shape) == 3 else None
    elif spec.kind == GraphKind.CYCLE_BATCH:  # graphs/batched_cycle.py: one address per row
        first = "row_address_W2"  # a symbolic row count; the manifest's rows are the most a call takes
        shape = inputs[first].shape
        rows = (
            spec.rows
            if len(shape) == 2 and isinstance(shape[0], str)
            else f"a fixed {shape[0]} (an older layout: re-export)"
        )
    elif spec.kind == GraphKind.RECURRENT_CYCLE:  # one row per core step, carried between calls
        first = "carried_BW2H"
        rows = inputs[first].shape[1] if len(inputs[first].shape) == 3 else None
    elif spec.kind in RECURRENT_KINDS or spec.kind in RECURRENT_BATCH_KINDS:  # graphs/recurrent.py
        # tokens or states: dynamic rows, or one row per batch entry
        first = "input_ids_BS" if spec.kind in (GraphKind.PRELUDE, GraphKind.PRELUDE_BATCH) else "state_BSH"
        rows = inputs[first].shape[1] if len(inputs[first].shape) >= 2 else None
    elif spec.kind in LOOP_STEP_KINDS:  # graphs/loop_steps.py: a token (loop_embed) or a state
        first = "input_ids_BS" if spec.kind == GraphKind.LOOP_EMBED else "hidden_BSH"
        rows = inputs[first].shape[1] if len(inputs[first].shape) >= 2 else None
    else:
        first = "input_ids_BS" if spec.first_loop == 0 else "hidden_BSH"
        rows = inputs[first].shape[1] if len(inputs[first].shape) >= 2 else None
    if (spec.rows is None) != (not isinstance(rows, int)) or (spec.rows is not None and rows != spec.rows):
        raise ArtifactError(
            f"{file}: {first} takes {rows} rows, the manifest's '{spec.kind}' graph "
            f"takes {spec.rows or 'a dynamic number of'}"
        )
    logits = outputs["logits_BSV"].shape if "logits_BSV" in outputs else [cfg.vocab_size]  # cycle_run: none
    if not logits or logits[-1] != cfg.vocab_size:
        raise ArtifactError(
            f"{file}: logits_BSV has shape {logits}, the manifest's vocabulary is {cfg.vocab_size}"
        )
    for name, value in (
        ("hidden_BSH", inputs.get("hidden_BSH")),
        ("hidden_BSH_out", outputs.get("hidden_BSH_out")),
    ):
        if value is not None and (not value.shape or value.shape[-1] != cfg.hidden_size):
            raise ArtifactError(
                f"{file}: {name} has shape {value.shape}, the manifest's hidden size is {cfg.hidden_size}"
            )


def open_artifact(
    artifact_dir: str | os.PathLike,
    device: str = "cpu",
    *,
    threads: int | None = None,
    spin: bool | None = None,
    kinds: tuple[str, ...] | None = None,
    share_weights: bool = False,
    cuda_graphs: bool | str = True,
    trust_ops: bool = False,
    share_sessions: bool | tuple[str, ...] = True,
    shared_initializers: bool | None = None,
    defer_sessions: bool = True,
) -> LoadedModel:
    """Validate and open an artifact. ``threads``: ONNX Runtime's intra-op threads per session
    (None: its default, one per core); ``spin``: whether they spin between ops
    (ort_runtime/loading/thread_pool.py; None: yes). ``trust_ops`` allows loading its custom-op library even
    when it is not one this user built (ort_runtime/loading/trust.py states the whole rule).
    ``share_sessions=False`` gives every kind its own CPU session, as before decode and verify
    shared prefill's (a tuple: only those kinds share it); ``shared_initializers`` (default:
    wherever no kernel prepacks, see ``uses_shared_initializers``) hands every session the same
    weight values (ort_runtime/loading/shared_weights.py); False gives each session its own copy (for
    measurements: tools/bench/bench_weight_sharing.py). ``defer_sessions`` makes the sessions of the
    speculative-only kinds on first use where each session prepacks its own copy of the weights
    (ort_runtime/loading/session_table.py); their graphs are checked at load either way."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise RequestError(
            f"threads must be a positive integer (intra-op threads per session), got {threads!r}"
        )
    import time

    start = time.perf_counter()
    path = Path(artifact_dir)
    manifest = Manifest.read(path)
    if device not in PROVIDERS:
        raise RequestError(f"unknown device {device!r}; choose cpu or cuda")
    provider = PROVIDERS[device]
    # the artifact's own limits before this machine's: no GPU could run these
    q = manifest.quantization
    if device == "cuda" and q is not None and q.float_zero_points and OpSet(manifest.op_set).batch_invariant:
        raise ArtifactError(
            f"{path}: fp32 zero points (a GGUF's Q4_1 blocks) run on the CPU kernels only; load it "
            "with device 'cpu' (the CUDA kernels take uint8 zero points)"
        )
    if provider not in ort.get_available_providers():
        raise RequestError(
            f"device {device!r} needs {provider}, which this onnxruntime lacks (a CPU-only install): "
            f"{CUDA_INSTALL_ADVICE}, or use the CPU"
        )
    if device == "cpu" and manifest.dtype != "fp32":
        raise ArtifactError(
            f"{path}: {manifest.dtype} artifacts need the CUDA device; the CPU execution "
            f"provider lacks {manifest.dtype} kernels for these graphs (export --dtype fp32)"
        )
    if device == "cuda" and manifest.quantization is not None and not OpSet(manifest.op_set).batch_invariant:
        raise ArtifactError(
            f"{path}: quantized {manifest.op_set} artifacts ({manifest.quantization.layers}, MatMulNBits "
            "with fp32 activations) run on the CPU only; load it with device 'cpu', or export with "
            "--target cuda (BatchInvariantMatMulNBits)"
        )
    if kinds is not None:
        unknown = sorted(set(kinds) - set(manifest.graphs))
        if unknown:
            raise RequestError(
                f"unknown graph kind(s) {', '.join(unknown)}; this artifact has {', '.join(manifest.graphs)}"
            )
    if device == "cuda" and manifest.dtype == "fp32" and not OpSet(manifest.op_set).loopcast_attention:
        # Refused, not warned: the CPU fallback between device-resident buffers gives wrong
        # logits (tests/ort_runtime/test_cuda.py checks the refusal).
        raise ArtifactError(
            f"{path}: fp32 stock graphs do not run correctly on CUDA: GroupQueryAttention has "
            "no fp32 CUDA kernel, so ONNX Runtime runs it on the CPU between the device-resident "
            "KV buffers and the logits come out wrong; export with --batch-invariant (the loopcast "
            "attention has fp32 CUDA kernels) or with --dtype fp16/bf16"
        )
    library = op_library_to_load(path, manifest, trust_ops=trust_ops, kinds=kinds)
    wanted = [kind for kind in manifest.graphs if kinds is None or kind in kinds]
    if library is not None:  # the loopcast ops' KV indices, before any session runs them
        for kind in wanted:
            check_op_attributes(path / manifest.graphs[kind].file, manifest.graphs[kind], manifest)
    if device == "cuda" and library is not None:
        _check_cuda_custom_ops(path, manifest, library)
    if device == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    if shared_initializers is None:
        shared_initializers = uses_shared_initializers(manifest, device, share_weights)
    weights, weight_names = None, {}
    if shared_initializers:
        weights, names = load_shared_weights(path, [path / manifest.graphs[k].file for k in wanted], device)
        weight_names = dict(zip(wanted, names))

    def make_session(
        kind: str, capture: bool, check_only: bool = False, deferred: bool = False
    ) -> ort.InferenceSession:
        spec = manifest.graphs[kind]
        if deferred:  # made after load: the files must still be the ones loaded (pinned_files.py)
            check_unchanged(path, manifest, kind, library)
        # check_only: the graph loads and has the manifest's IO; no packed copy of the weights
        options = _session_options(library, threads, share_weights or check_only, spin)
        if weights is not None:
            weights.add_to(options, weight_names[kind])
        cuda_options = {"enable_cuda_graph": "1"} if capture else {}
        if device == "cuda" and manifest.dtype == "fp32":
            cuda_options["use_tf32"] = "0"  # an fp32 artifact means fp32 math, not TF32 matmuls
        providers = [(provider, cuda_options)] if cuda_options else [provider]
        file = path / spec.file
        try:
            session = ort.InferenceSession(str(file), options, providers=providers)
        except ArtifactError:
            raise
        except Exception as exc:
            first_line = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            raise ArtifactError(
                f"{file}: ONNX Runtime could not load the '{kind}' graph ({first_line})"
            ) from None
        check_session_io(session, spec, manifest, file)
        return session

    if cuda_graphs not in (True, False, "always"):
        raise RequestError(f"cuda_graphs must be True, False or 'always', got {cuda_graphs!r}")
    host_lengths = not manifest.device_lengths
    shared = _cpu_shared_sessions(manifest, wanted) if device == "cpu" and share_sessions else {}
    if isinstance(share_sessions, tuple):
        shared = {kind: host for kind, host in shared.items() if kind in share_sessions}
    sessions, graph_kinds, fallbacks = {}, set(), {}
    eager = []
    deferred = (
        _deferred_kinds(wanted, shared)
        if device == "cpu" and defer_sessions and not shared_initializers and not share_weights
        else []
    )
    for kind in wanted:
        spec = manifest.graphs[kind]
        if kind in shared or kind in deferred:
            continue
        if kind in BATCH_KINDS or kind in LOOP_STEP_KINDS:
            # a symbolic batch (docs/serving.md, "CUDA"), or one session under R bindings (the
            # loop-skipping kinds, ort_runtime/binding/loop_steps.py): run eagerly
            sessions[kind] = make_session(kind, False)
            continue
        if (
            device == "cuda"
            and cuda_graphs
            and spec.rows is not None
            and host_lengths
            and cuda_graphs != "always"
        ):
            fallbacks[kind] = (
                "GroupQueryAttention reads total_sequence_length on the host, which a captured "
                "graph would freeze; export --batch-invariant for captured graphs"
            )
        elif device == "cuda" and cuda_graphs and spec.rows is not None:
            try:
                sessions[kind] = make_session(kind, True)
                graph_kinds.add(kind)
                continue
            except ArtifactError as exc:  # e.g. a node left on the CPU: run this kind eagerly
                fallbacks[kind] = str(exc)
        eager.append(kind)
    # The static-depth graphs (prefill@k, ...) and the exit gate's run only when a request asks
    # for a depth: they are checked when a generation first makes their session, not at every load.
    checked = [
        kind
        for kind in deferred
        if parse_graph_key(kind)[1] is None and kind != GraphKind.EXITS and kind not in LOOP_STEP_KINDS
    ]
    if device == "cpu" and len(eager) > 1:
        # Session creation is mostly weight prepacking, which ORT does with the GIL released:
        # one thread per session and core (2 cores: 1.32 s -> 0.72 s for two 513 MiB sessions).
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=min(len(eager) + len(checked), os.cpu_count() or 1)) as pool:
            made = dict(zip(eager, pool.map(lambda k: make_session(k, False), eager)))
            list(pool.map(lambda k: make_session(k, False, check_only=True), checked))
    else:
        made = {kind: make_session(kind, False) for kind in eager}
        for kind in checked:
            make_session(kind, False, check_only=True)
    sessions.update(made)
    if VERIFY in shared and not {LOGIT_START, LOGIT_ROWS} & {
        v.name for v in sessions[PREFILL].get_overridable_initializers()
    }:  # verify runs on prefill's session through that input
        raise ArtifactError(
            f"{path / manifest.graphs[PREFILL].file}: the prefill graph takes no {LOGIT_START} input "
            "(exported by an older loopcast); re-export the artifact"
        )
    for kind, host in shared.items():
        if host in sessions:
            sessions[kind] = sessions[host]
    factories = {kind: (lambda k=kind: make_session(k, False, deferred=True)) for kind in deferred}
    # a kind sharing a deferred host's session (decode@k on prefill@k's) is made with it
    factories |= {kind: (lambda h=host: table[h]) for kind, host in shared.items() if host not in sessions}
    table = SessionTable({kind: sessions[kind] for kind in wanted if kind in sessions}, factories, wanted)
    sessions = table
    tokenizer = None
    tokenizer_text = read_confined_text(
        path, "tokenizer.json", "tokenizer", max_bytes=TOKENIZER_MAX_BYTES, required=False
    )
    if tokenizer_text is not None:
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_str(tokenizer_text)
        except Exception as exc:
            raise ArtifactError(f"{path / 'tokenizer.json'}: unreadable tokenizer ({exc})") from None
    return LoadedModel(
        path,
        manifest,
        device,
        sessions,
        tokenizer,
        time.perf_counter() - start,
        graph_kinds=frozenset(graph_kinds),
        graph_fallbacks=fallbacks,
        shared_sessions=shared,
        prepacked=not share_weights,
        shared_weights=weights,
        _session_factory=make_session,
    )


def uses_shared_initializers(manifest: Manifest, device: str, share_weights: bool) -> bool:
    """Whether sessions get one shared copy of the weights by default: on CUDA (no kernel there
    prepacks), and on the CPU where nothing prepacks (the loopcast op set, or prepacking turned
    off); a prepacking CPU MatMul would keep the shared mapping resident besides its own packed
    copy per session (docs/perf.md, "Run-time memory")."""
    return device == "cuda" or OpSet(manifest.op_set).batch_invariant or share_weights


def _deferred_kinds(kinds: list[str], shared: dict[str, str]) -> list[str]:
    """The kinds whose CPU session waits for first use: those only speculation runs (plain
    decoding and prompt lookup need prefill, decode and verify), each with its own session, and
    the static-depth graphs (only a generation at that depth runs them)."""
    return [
        kind
        for kind in kinds
        if (kind not in (PREFILL, DECODE, VERIFY) or parse_graph_key(kind)[1] is not None)
        and kind not in shared
        and kind not in BATCH_KINDS
    ]


def _cpu_shared_sessions(manifest: Manifest, kinds: list[str]) -> dict[str, str]:
    """Kinds that run on another kind's CPU session: decode and verify on prefill's when the
    graphs are the same computation (same loops, KV slots and IO names; prefill's slice of its
    last ``logit_rows`` rows is the identity when it is fed the kind's row count). Every session
    holds its own prepacked copy of the weights (ORT's Python API cannot share one), so one
    session fewer is one copy fewer."""
    hosts = {}
    for key in kinds:
        kind, depth = parse_graph_key(key)
        host = PREFILL if depth is None else depth_key(PREFILL, depth)
        if kind in (DECODE, VERIFY) and host in kinds and _same_computation(manifest, host, key):
            hosts[key] = host
    return hosts


def _same_computation(manifest: Manifest, host: str, kind: str) -> bool:
    # verify runs on prefill's session through prefill's LOGIT_START input (graphs/kinds.py)
    prefill, spec = manifest.graphs[host], manifest.graphs[kind]
    return (
        prefill.rows is None
        and spec.rows is not None
        and prefill.first_loop == spec.first_loop
        and prefill.last_loop == spec.last_loop
        and list(prefill.kv_slots) == list(spec.kv_slots)
        and set(prefill.inputs) == set(spec.inputs)
        and set(prefill.outputs) == set(spec.outputs)
    )


def _check_cuda_custom_ops(path: Path, manifest: Manifest, library: Path) -> None:
    """The loopcast ops must have CUDA kernels, and the shapes must be ones they take; otherwise
    ORT would quietly run them on the CPU with copies every step, or fail on the first step."""
    import ctypes

    try:
        has_cuda = bool(ctypes.CDLL(str(library)).loopcast_ops_has_cuda())
    except (OSError, AttributeError) as exc:
        raise ArtifactError(f"{library}: custom-op library could not be loaded ({exc})") from None
    if not has_cuda:
        raise ArtifactError(
            f"{library}: built without CUDA kernels (no nvcc at export time); "
            "re-export with nvcc on the PATH to run on cuda"
        )
    check_cuda_shapes(path, manifest)
