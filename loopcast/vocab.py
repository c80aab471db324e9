"""The project's vocabularies as enums, and the one plan of which graphs an artifact gets.

Values are the strings the manifest, the CLI and the JSON output use (``StrEnum``: a member
equals, hashes and formats as its string), so a manifest key read from JSON finds the member's
entry and a member written to JSON is its string.

- :class:`GraphKind`: the graph kinds (docs/architecture.md §3).
- :class:`OpSet`: the op sets a graph can be built with, each declaring its capabilities
  (graphs/ops.py gives each its block builders).
- :class:`SpeculativeMode`, :class:`GateKind`: who drafts, and when a step speculates.
- :func:`graph_plan`: which graphs an artifact of a model, op set and export options has, with
  each graph's rows and loops. The exporter builds exactly these, the manifest schema accepts
  exactly these (loopcast/manifest_schema.py), nothing else decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from loopcast.config import ModelConfig
from loopcast.errors import RequestError

E = TypeVar("E", bound=StrEnum)


class GraphKind(StrEnum):
    """One ONNX file of an artifact (docs/architecture.md §3)."""

    PREFILL = "prefill"  # dynamic rows, all loops
    DECODE = "decode"  # 1 row, all loops
    VERIFY = "verify"  # W rows, all loops
    DRAFT = "draft"  # 1 row, loops 0..d-1, + the hidden state at depth d
    VERIFY_TAIL = "verify_tail"  # W hidden states at depth d, loops d..R-1
    # The pipeline (graphs/cycles.py): R rows, row r runs loop r; cycle_run is K cycles in one
    # call with the lane schedule (loopcast.LaneStep) on the device between them.
    CYCLE = "cycle"
    CYCLE_RUN = "cycle_run"
    # Tree verify (``export --tree-verify``; docs/architecture.md §5 "Alternate suffix"): draft
    # and verify_tail with row-addressed attention, each row at its own cache position with a
    # masked key range, so a branch's rows can sit at scratch positions past the other branch.
    TREE_DRAFT = "tree_draft"
    TREE_TAIL = "tree_tail"
    # Batched (graphs/batched.py, docs/serving.md; ``export --max-batch B``): the rows of one
    # call belong to different sequences (1 row each for decode_batch, verify_width rows each
    # for verify_batch), batch entry b reading and writing batch entry b of every KV buffer.
    # The recurrent-depth family (Huginn): the host composes prelude → r core steps → coda.
    PRELUDE = "prelude"  # dynamic rows: embed and the prelude blocks
    CORE_STEP = "core_step"  # dynamic rows: one core step with the injection, run r times
    CODA = "coda"  # dynamic rows: ln_f, the coda blocks, ln_f, the head
    # The recurrent-depth pipeline (graphs/recurrent_cycles.py): R rows, row k a lane at core
    # step k, the entering lane's prelude and the leaving lane's coda in the same call.
    RECURRENT_CYCLE = "recurrent_cycle"
    # The recurrent-depth kinds over a batch of sequences (``export --max-batch B``): dynamic rows
    # per sequence, batch entry b reading and writing batch entry b of every KV buffer; core_step_batch
    # keeps the state of a row whose request runs fewer core steps (``active_B``).
    PRELUDE_BATCH = "prelude_batch"
    CORE_STEP_BATCH = "core_step_batch"
    CODA_BATCH = "coda_batch"
    DECODE_BATCH = "decode_batch"
    VERIFY_BATCH = "verify_batch"
    # Self-speculation of several sequences (with --max-batch and a draft depth d): the draft
    # graph's rows (loops 0..d-1, + the depth-d state) and verify_tail's (loops d..R-1), batched.
    DRAFT_BATCH = "draft_batch"
    VERIFY_TAIL_BATCH = "verify_tail_batch"
    # The pipeline of several sequences (with --max-batch, where the cycle exists;
    # graphs/batched_cycle.py): R·P rows, P lanes per depth, each row at its own (sequence, position).
    CYCLE_BATCH = "cycle_batch"
    # The exit gate (docs/adaptive-depth.md): 1 row through every loop, with the argmax and the
    # exit-gate logit after each loop ([1, R] each), so the host picks the token at the exit.
    EXITS = "exits"
    # The gate's loop-skipping path (graphs/loop_steps.py): the host runs a token's loops one
    # call at a time and stops at its exit. loop_step is one core loop, named for loop 0's KV
    # slots and rebound to loop r's for its r-th call (the loops share their weights, so one
    # session, one prepacked copy, serves every loop); loop_embed and exit_head hold the
    # embedding and the head, so no weight is in two of the three.
    LOOP_EMBED = "loop_embed"  # 1 row: the token's embedding
    LOOP_STEP = "loop_step"  # 1 row: one core loop on a state, + its normed state's gate logit
    EXIT_HEAD = "exit_head"  # 1 row: the head and argmax on a normed state


CYCLE_KINDS = (GraphKind.CYCLE, GraphKind.CYCLE_RUN)
TREE_KINDS = (GraphKind.TREE_DRAFT, GraphKind.TREE_TAIL)
# Added after the first batched artifacts: both or neither (an older artifact has neither).
SELF_BATCH_KINDS = (GraphKind.DRAFT_BATCH, GraphKind.VERIFY_TAIL_BATCH)
# Added after the self-speculation ones: an older batched artifact has no cycle_batch.
RECURRENT_KINDS = (GraphKind.PRELUDE, GraphKind.CORE_STEP, GraphKind.CODA)
RECURRENT_BATCH_KINDS = (GraphKind.PRELUDE_BATCH, GraphKind.CORE_STEP_BATCH, GraphKind.CODA_BATCH)
BATCH_KINDS = (
    GraphKind.DECODE_BATCH,
    GraphKind.VERIFY_BATCH,
    *SELF_BATCH_KINDS,
    GraphKind.CYCLE_BATCH,
    *RECURRENT_BATCH_KINDS,
)
LOOP_STEP_KINDS = (GraphKind.LOOP_EMBED, GraphKind.LOOP_STEP, GraphKind.EXIT_HEAD)


class OpSet(StrEnum):
    """The ops a graph is built with (docs/architecture.md, "Op sets and exactness"). Code asks
    an op set what it can do (the properties below), never which one it is."""

    # ONNX + com.microsoft ops only (GroupQueryAttention, MatMul)
    STOCK = "stock"
    # the loopcast attention op (row-invariant, lengths read on the device), stock MatMul and
    # norms: exact on the CPU at stock MatMul speed
    LOOPCAST_ATTENTION = "loopcast-attention"
    # every hot op from the loopcast library (batch-invariant on the CPU and CUDA)
    LOOPCAST = "loopcast"

    @property
    def loopcast_attention(self) -> bool:
        """Attention is the loopcast op (BatchInvariantAttention, RowAttention): a row's result
        does not depend on the other rows of the call, it reads both lengths on the device (a
        step can be captured and replayed at any position), and it can address rows one by one
        (the pipeline's cycle, the tree kinds)."""
        return self is not OpSet.STOCK

    @property
    def batch_invariant(self) -> bool:
        """Every hot op (MatMul, norms, attention) is a loopcast op: rows are bit-identical to
        the M=1 decode rows on the CPU and on CUDA; the MatMul never prepacks its weights and
        takes no bias input."""
        return self is OpSet.LOOPCAST

    @property
    def needs_library(self) -> bool:
        """Whether the graphs use ops of the loopcast custom-op library."""
        return self is not OpSet.STOCK


# The head sizes the loopcast attention ops' CUDA kernels take (custom_ops/src/cuda_ops.cc). The
# exporter pads other heads to the next of them (exporter/head_padding.py); loading on CUDA
# checks the stored size.
CUDA_ATTENTION_HEAD_DIMS = (16, 32, 64, 128)


def has_cycle(config: ModelConfig, op_set: OpSet | str) -> bool:
    """Whether an artifact carries the pipeline's cycle graphs: a looped model without prelude
    or coda (a lane runs one core loop per cycle), built with the row-addressed attention op."""
    return (
        config.num_loops > 1
        and config.num_prelude_layers == 0
        and config.num_coda_layers == 0
        and OpSet(op_set).loopcast_attention
    )


def has_recurrent_cycle(config: ModelConfig, op_set: OpSet | str) -> bool:
    """Whether a recurrent-depth artifact carries the pipeline's ``recurrent_cycle`` graph: its
    rows sit at their own (step, position) addresses, which needs the row-addressed attention op."""
    return config.recurrent_depth and OpSet(op_set).loopcast_attention


def has_exits(config: ModelConfig) -> bool:
    """Whether an artifact carries the exits graph: a looped model with an exit gate (Ouro) and
    no prelude or coda (each loop's normed state feeds the gate and the head)."""
    return (
        config.num_loops > 1
        and config.has_exit_gate
        and config.num_prelude_layers == 0
        and config.num_coda_layers == 0
    )


def can_tree_verify(config: ModelConfig, op_set: OpSet | str) -> str | None:
    """Why an artifact of ``config`` and ``op_set`` cannot carry the tree kinds (None: it can):
    they split a looped model's stack at the draft depth, with the row-addressed attention op."""
    if config.num_loops < 2:
        return "tree verify needs a looped model (R > 1): its branches are drafted by the shallow loops"
    if not OpSet(op_set).loopcast_attention:
        return (
            "tree verify needs the loopcast attention op (--ops loopcast-attention or loopcast), "
            "not stock graphs"
        )
    return None


@dataclass(frozen=True)
class GraphPlan:
    """One graph of an artifact: its kind, rows per sequence (None: dynamic) and the loops
    ``first_loop .. last_loop-1`` it runs. ``depth``: a static-depth graph (``depth_key``):
    the kind's graph stopped after that many loops."""

    kind: GraphKind
    rows: int | None
    first_loop: int
    last_loop: int
    depth: int | None = None

    @property
    def key(self) -> str:
        """The graph's name in the manifest, the sessions and the bindings."""
        return self.kind.value if self.depth is None else depth_key(self.kind, self.depth)


# Static depth (``loops=k``, docs/adaptive-depth.md): an artifact exported with exit depths has,
# for each depth k < R, the prefill, decode and verify graphs stopped after k loops, named
# ``prefill@k``, ``decode@k``, ``verify@k``; the full-depth graphs keep their plain names.
DEPTH_KINDS = (GraphKind.PREFILL, GraphKind.DECODE, GraphKind.VERIFY)


def depth_key(kind: GraphKind | str, depth: int) -> str:
    """The manifest name of ``kind``'s graph at static depth ``depth`` (< R)."""
    return f"{GraphKind(kind).value}@{depth}"


def parse_graph_key(key: str) -> tuple[GraphKind, int | None]:
    """A manifest graph name as (kind, static depth or None); ValueError if it is neither."""
    kind, sep, depth = key.partition("@")
    if not sep:
        return GraphKind(kind), None
    if GraphKind(kind) not in DEPTH_KINDS or not depth.isdigit() or depth != str(int(depth)):
        raise ValueError(key)
    return GraphKind(kind), int(depth)


def graph_plan(
    config: ModelConfig,
    op_set: OpSet | str,
    *,
    verify_width: int | None,
    draft_depth: int | None,
    tree: bool = False,
    max_batch: int | None = None,
    exit_depths: tuple[int, ...] | list[int] = (),
    self_batch: bool = True,
    pipeline_batch: bool = True,
) -> tuple[GraphPlan, ...]:
    """The graphs an artifact has, in the order the exporter writes them:

    prefill, decode                       always
    verify                                with a verify width W
    draft, verify_tail                    with a draft depth d (verify_tail: and W)
    tree_draft, tree_tail                 ``tree``, with d and W, where can_tree_verify allows
    cycle, cycle_run                      where has_cycle (the model and the op set)
    decode_batch, verify_batch            with ``max_batch`` (verify_batch: and W)
    draft_batch, verify_tail_batch        ``self_batch``, with ``max_batch``, d and W
    cycle_batch                           ``pipeline_batch``, with ``max_batch``, where has_cycle
                                          (R·max_batch rows: max_batch lanes per depth)
    prefill@k, decode@k, verify@k         for each exit depth k < R (verify@k: with W)
    exits, loop_embed, loop_step, exit_head   where has_exits (a looped model with an exit gate)

    A recurrent-depth model has prelude, core_step and coda, and recurrent_cycle where
    has_recurrent_cycle (the op set); with ``max_batch``, prelude_batch, core_step_batch and
    coda_batch (one row per sequence).
    """
    R = config.num_loops
    if config.recurrent_depth:
        # prelude, core_step (named for step 0; run as steps 0..r-1 with their KV), coda:
        # every one with dynamic rows; no verify/draft kinds (their rows are these graphs').
        # recurrent_cycle: the pipeline's, one row per core step up to max_recurrence.
        recurrent = [
            GraphPlan(GraphKind.PRELUDE, None, 0, 0),
            GraphPlan(GraphKind.CORE_STEP, None, 0, 1),
            GraphPlan(GraphKind.CODA, None, R, R),
        ]
        if has_recurrent_cycle(config, op_set):
            recurrent.append(GraphPlan(GraphKind.RECURRENT_CYCLE, R, 0, R))
        if max_batch is not None:
            recurrent += [  # dynamic rows per sequence: decode and verify steps
                GraphPlan(GraphKind.PRELUDE_BATCH, None, 0, 0),
                GraphPlan(GraphKind.CORE_STEP_BATCH, None, 0, 1),
                GraphPlan(GraphKind.CODA_BATCH, None, R, R),
            ]
        return tuple(recurrent)
    plans = [GraphPlan(GraphKind.PREFILL, None, 0, R), GraphPlan(GraphKind.DECODE, 1, 0, R)]
    if verify_width is not None:
        plans.append(GraphPlan(GraphKind.VERIFY, verify_width, 0, R))
    if draft_depth is not None:
        plans.append(GraphPlan(GraphKind.DRAFT, 1, 0, draft_depth))
        if verify_width is not None:
            plans.append(GraphPlan(GraphKind.VERIFY_TAIL, verify_width, draft_depth, R))
    if (
        tree
        and draft_depth is not None
        and verify_width is not None
        and can_tree_verify(config, op_set) is None
    ):
        plans += [
            GraphPlan(GraphKind.TREE_DRAFT, 1, 0, draft_depth),
            GraphPlan(GraphKind.TREE_TAIL, verify_width, draft_depth, R),
        ]
    if has_cycle(config, op_set):
        plans += [GraphPlan(GraphKind.CYCLE, R, 0, R), GraphPlan(GraphKind.CYCLE_RUN, R, 0, R)]
    if max_batch is not None:
        plans.append(GraphPlan(GraphKind.DECODE_BATCH, 1, 0, R))
        if verify_width is not None:
            plans.append(GraphPlan(GraphKind.VERIFY_BATCH, verify_width, 0, R))
        if self_batch and draft_depth is not None and verify_width is not None:
            plans += [
                GraphPlan(GraphKind.DRAFT_BATCH, 1, 0, draft_depth),
                GraphPlan(GraphKind.VERIFY_TAIL_BATCH, verify_width, draft_depth, R),
            ]
        if pipeline_batch and has_cycle(config, op_set):
            plans.append(GraphPlan(GraphKind.CYCLE_BATCH, R * max_batch, 0, R))
    for k in exit_depths:
        plans += [GraphPlan(GraphKind.PREFILL, None, 0, k, k), GraphPlan(GraphKind.DECODE, 1, 0, k, k)]
        if verify_width is not None:
            plans.append(GraphPlan(GraphKind.VERIFY, verify_width, 0, k, k))
    if has_exits(config):
        plans += [
            GraphPlan(GraphKind.EXITS, 1, 0, R),
            GraphPlan(GraphKind.LOOP_EMBED, 1, 0, 0),
            GraphPlan(GraphKind.LOOP_STEP, 1, 0, 1),  # run as loops 0..R-1 (loop 0's slot names)
            GraphPlan(GraphKind.EXIT_HEAD, 1, R, R),
        ]
    return tuple(plans)


# -- Speculation: the modes a request can ask for and the gates that decide per step ----------


class SpeculativeMode(StrEnum):
    """Who drafts: nobody (plain decoding), prompt lookup, the model's shallow loops (self), the
    pipeline's lanes, or a caller's own proposer (custom)."""

    NONE = "none"
    PROMPT_LOOKUP = "prompt-lookup"
    SELF = "self"
    PIPELINE = "pipeline"
    CUSTOM = "custom"


class GateKind(StrEnum):
    """When a step speculates (ort_runtime/decoding/gates.py). ``ALWAYS`` speculates on every
    step a proposer has drafts for (measurements); ``AUTO`` is the calibrated cost gate."""

    AUTO = "auto"
    ALWAYS = "always"
    HIT_DENSITY = "hit-density"
    COST = "cost"


class KVPolicy(StrEnum):
    """What a token that exits the loops early leaves in the KV slots of the loops it skipped
    (docs/adaptive-depth.md). ``FULL``: every loop still runs for the KV (Ouro's own
    semantics: exact to the model); ``LAST_EXITED``: its exit loop's K/V is copied into the
    deeper loops' slots at its position (an approximation whose quality is measured)."""

    FULL = "full"
    LAST_EXITED = "last-exited"


def parse(enum: type[E], value: object, parameter: str) -> E:
    """``value`` as a member of ``enum``, or a RequestError that names ``parameter`` and the choices."""
    try:
        return enum(value if isinstance(value, str) else str(value))
    except ValueError:
        raise RequestError(f"{parameter} must be one of {', '.join(choices(enum))}, got {value!r}") from None


def choices(enum: type[StrEnum]) -> list[str]:
    """The choice list of an enum, in declaration order (the CLI's click.Choice lists)."""
    return [member.value for member in enum]
