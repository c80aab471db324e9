"""The options of ``loopcast export`` (``ExportOptions``): defaults resolved against the model's
config and every combination checked before anything is written (docs/architecture.md §3)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from loopcast.config import ModelConfig
from loopcast.errors import ExportError
from loopcast.manifest_schema import MAX_BATCH
from loopcast.quant import QuantScheme, WeightFormat
from loopcast.vocab import CUDA_ATTENTION_HEAD_DIMS, OpSet

DTYPES = ("fp32", "fp16", "bf16")
MAX_VERIFY_WIDTH = 32


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp32"
    max_length: int | None = None  # default: min(config max positions, 4096)
    verify_width: int = 5
    draft_depth: int | None = None  # default: 1 when R > 1
    batch_invariant: bool = False  # shorthand for ops="loopcast"
    # auto: "loopcast-attention" for fp32 (exact on the CPU at stock speed) when the custom-op
    # library can be had, else "stock"; fp16/bf16 stay "stock" unless asked (--target cuda).
    ops: str = "auto"
    genai: bool = False  # also write the ONNX Runtime GenAI graph + genai_config.json
    max_batch: int | None = None  # also write the batched kinds for up to this many sequences
    tree_verify: bool = False  # also write tree_draft and tree_tail (the alternate suffix)
    # weight-only block quantization (loopcast/quant.py); None: float weights
    quantization: QuantScheme | None = None
    # static depths k < R that get their own prefill/decode/verify graphs (``loops=k``,
    # docs/adaptive-depth.md); None: every k in 1..R-1 (none for R = 1)
    exit_depths: tuple[int, ...] | None = None
    # MatMulNBits accuracy_level of weights that arrive quantized (a GGUF's blocks)
    source_accuracy_level: int = 4
    # The stored attention head size (exporter/head_padding.py); None: the model's head_dim, or
    # with the loopcast attention ops the next size their CUDA kernels take (head_size below).
    # An API option for tests that pad a head size the kernels already take.
    pad_heads_to: int | None = None

    @property
    def op_set(self) -> str:
        """An OpSet's value, or "auto"."""
        return OpSet.LOOPCAST if self.batch_invariant else self.ops

    def resolved(self, config: ModelConfig, generation_length: int | None = None) -> ExportOptions:
        """Defaults filled in and checked; ``generation_length`` is generation_config.json's
        max_length, which (capped by the model) replaces the default of 4096."""
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype must be one of fp32, fp16, bf16, got {self.dtype!r}")
        default = min(config.max_position_embeddings, generation_length or 4096)
        if config.sliding_window is not None:
            default = min(default, config.sliding_window)
        max_length = self.max_length if self.max_length is not None else default
        # Beyond max_position_embeddings, dynamic-NTK rope would change its frequencies with the
        # length (loopcast.rope); below it every supported rope type is static.
        if not 1 <= max_length <= config.max_position_embeddings:
            raise ExportError(
                f"--max-length {max_length} is outside 1..{config.max_position_embeddings} "
                "(the model's max_position_embeddings)"
            )
        if config.sliding_window is not None and max_length > config.sliding_window:
            raise ExportError(
                f"--max-length {max_length} exceeds the model's sliding_window "
                f"{config.sliding_window}: sliding-window attention is not supported, and only "
                "below the window does full attention compute the same thing"
            )
        if self.pad_heads_to is not None:
            _check_pad_heads_to(config, self)
        if config.recurrent_depth:  # no verify graphs: the width is not used
            return self._recurrent(max_length)
        if not 2 <= self.verify_width <= MAX_VERIFY_WIDTH:
            raise ExportError(f"--verify-width must be in 2..{MAX_VERIFY_WIDTH}, got {self.verify_width}")
        if self.verify_width > max_length:
            raise ExportError(f"--verify-width {self.verify_width} exceeds --max-length {max_length}")
        depth = self.draft_depth
        if config.num_loops == 1:
            if depth is not None:
                raise ExportError("--draft-depth needs a looped model; this one has R=1")
        else:
            depth = 1 if depth is None else depth
            if not 1 <= depth < config.num_loops:
                raise ExportError(
                    f"--draft-depth must be in 1..{config.num_loops - 1} (R={config.num_loops}), got {depth}"
                )
        if self.op_set not in ("auto", *OpSet):
            raise ExportError(f"--ops must be one of auto, {', '.join(OpSet)}, got {self.ops!r}")
        if self.max_batch is not None and not 1 <= self.max_batch <= MAX_BATCH:
            raise ExportError(f"--max-batch must be in 1..{MAX_BATCH}, got {self.max_batch}")
        if self.tree_verify and config.num_loops == 1:
            raise ExportError(
                "--tree-verify needs a looped model (R > 1): its branches are drafted by the "
                "shallow loops; this one has R=1"
            )
        if self.quantization is not None:
            _check_quantized(self)
        R = config.num_loops
        exit_depths = tuple(range(1, R)) if self.exit_depths is None else tuple(sorted(set(self.exit_depths)))
        bad = [k for k in exit_depths if not 1 <= k < R]
        if bad:
            raise ExportError(
                f"--exit-depths must be in 1..{R - 1} (R={R}: full depth needs no graphs of its "
                f"own), got {bad[0]}"
                if R > 1
                else "--exit-depths needs a looped model; this one has R=1"
            )
        return dataclasses.replace(self, max_length=max_length, draft_depth=depth, exit_depths=exit_depths)

    def _recurrent(self, max_length: int) -> ExportOptions:
        """A recurrent-depth model (Huginn) exports prelude, core_step and coda with float weights
        in any op set (with ``--max-batch``, their batched kinds too); the other kinds' options
        are refused, not ignored."""
        if self.op_set not in ("auto", *OpSet):
            raise ExportError(f"--ops must be one of auto, {', '.join(OpSet)}, got {self.ops!r}")
        if self.max_batch is not None and not 1 <= self.max_batch <= MAX_BATCH:
            raise ExportError(f"--max-batch must be in 1..{MAX_BATCH}, got {self.max_batch}")
        for on, flag in (
            (self.draft_depth is not None, "--draft-depth"),
            (self.tree_verify, "--tree-verify"),
            (self.genai, "--genai"),
        ):
            if on:
                raise ExportError(
                    f"{flag} is not supported for recurrent-depth (huginn_raven) models yet: they "
                    "export prelude, core_step and coda (recurrent_cycle, and the batched kinds "
                    "with --max-batch) with float weights"
                )
        if self.quantization is not None:
            _check_quantized(self)
        return dataclasses.replace(self, max_length=max_length, draft_depth=None)


def _check_pad_heads_to(config: ModelConfig, opts: ExportOptions) -> None:
    size = opts.pad_heads_to
    if isinstance(size, bool) or not isinstance(size, int) or size % 2 or not config.head_dim <= size <= 256:
        raise ExportError(
            f"pad_heads_to must be an even head size in {config.head_dim}..256 (head_dim "
            f"{config.head_dim}: the rotary halves get the zeros), got {size!r}"
        )


def _check_quantized(opts: ExportOptions) -> None:
    """What --quantize runs on (docs/architecture.md, "Quantized weights"): the loopcast op set's
    BatchInvariantMatMulNBits on the CPU and CUDA in any dtype; the stock and loopcast-attention
    op sets' MatMulNBits on the CPU in fp32 activations."""
    if opts.dtype != "fp32" and opts.op_set != OpSet.LOOPCAST:
        raise ExportError(
            f"--quantize with --dtype {opts.dtype} needs --ops loopcast (--target cuda): the stock "
            "MatMulNBits graphs run on the CPU with fp32 activations (--dtype fp32)"
        )
    if opts.quantization.embedding is not WeightFormat.FLOAT and opts.dtype != "fp32":
        raise ExportError(
            f"--quantize-embedding with --dtype {opts.dtype}: the quantized embedding is "
            "GatherBlockQuantized with fp32 output (--dtype fp32, the CPU)"
        )
    if opts.genai and opts.dtype != "fp32":
        raise ExportError(
            "--quantize with --genai needs --dtype fp32: the GenAI graph uses the stock MatMulNBits "
            "with fp32 activations (GenAI's sessions know no loopcast ops)"
        )


def check_half_precision_runs(opts: ExportOptions) -> None:
    """fp16/bf16 artifacts run on CUDA only (the CPU runs fp32, or int8/int4 weights): asked for
    with the default op set on an install without CUDA, one would only fail at load. An explicit
    --ops or --target cuda means another machine's GPU; --genai's graph runs in CPU GenAI."""
    if opts.dtype == "fp32" or opts.op_set != "auto" or opts.genai:
        return
    from loopcast.devices import cuda_available

    if not cuda_available():
        raise ExportError(
            f"--dtype {opts.dtype}: {opts.dtype} artifacts run on the CUDA device only, and this "
            "install has none; export --dtype fp32 for the CPU (--quantize int8|int4 for smaller "
            "weights), or pass --target cuda to build a CUDA artifact here"
        )


def head_size(config: ModelConfig, opts: ExportOptions, op_set: OpSet | str) -> int:
    """The size every attention head is stored in (q, k, v and the KV cache;
    exporter/head_padding.py): ``opts.pad_heads_to`` when given; with the loopcast attention ops
    and float weights, a head_dim their CUDA kernels lack is padded to the next size they take
    (Huginn-0125's 96 → 128), on every dtype, so that one artifact runs on the CPU and on CUDA;
    quantized weights only in fp16/bf16 artifacts (they run on CUDA only; an fp32 quantized
    artifact is the CPU's, kept unpadded); otherwise head_dim. Padding beyond 128 is not done
    (check_cuda_attention refuses what then cannot run on CUDA)."""
    d = config.head_dim
    if opts.pad_heads_to is not None and opts.pad_heads_to != d:
        if not OpSet(op_set).loopcast_attention:
            raise ExportError(
                f"pad_heads_to {opts.pad_heads_to} needs the loopcast attention ops (--ops "
                f"loopcast-attention or loopcast), got --ops {OpSet(op_set)}"
            )
        return opts.pad_heads_to
    if opts.pad_heads_to is not None or not OpSet(op_set).loopcast_attention:
        return d
    if opts.quantization is not None and opts.dtype == "fp32":
        return d
    return next((size for size in CUDA_ATTENTION_HEAD_DIMS if size >= d), d)


def check_cuda_attention(config: ModelConfig, opts: ExportOptions, op_set: OpSet | str | None) -> None:
    """An fp16/bf16 artifact runs on CUDA only: with the loopcast attention ops its stored head
    size must be one their CUDA kernels take, or the artifact would fail at its first step, after
    the whole export. Padding (head_size) makes most head sizes one (Huginn-0125's 96); what it
    cannot fix is refused here: a head_dim above 128."""
    if opts.dtype == "fp32" or op_set is None or op_set == "auto" or not OpSet(op_set).loopcast_attention:
        return
    size = head_size(config, opts, op_set)
    if size not in CUDA_ATTENTION_HEAD_DIMS:
        if opts.pad_heads_to is not None:
            why = f"pad_heads_to {opts.pad_heads_to}"
        else:
            why = f"heads are padded to at most {CUDA_ATTENTION_HEAD_DIMS[-1]}"
        raise ExportError(
            f"--dtype {opts.dtype} --ops {OpSet(op_set)}: head size {size} (head_dim "
            f"{config.head_dim}) is not supported by the loopcast attention ops' CUDA kernels "
            f"(16, 32, 64 or 128; {why}); export --ops stock (without --target cuda / "
            "--batch-invariant) for CUDA, or --dtype fp32 for the CPU"
        )


def check_supported(config: ModelConfig, op_set: OpSet | str = OpSet.STOCK) -> None:
    """Limits of the ORT ops the graphs use, beyond what the config itself validates."""
    op_set = OpSet(op_set)
    if config.head_dim % 2:
        raise ExportError(f"head_dim {config.head_dim} is not supported: rotary needs an even head_dim")
    if op_set.batch_invariant and config.has_biases and not config.recurrent_depth:
        # The loopcast MatMul op has no bias input; an Add after it would break the fused layer
        # (the recurrent-depth blocks are not fused across the projection: their q/k bias is an Add).
        raise ExportError(
            "--batch-invariant / --ops loopcast (and --target cuda) do not support projection "
            "biases (attention_bias, mlp_bias, Qwen2 q/k/v bias) yet; export without it"
        )
    if config.head_dim % 16 and not op_set.loopcast_attention:
        raise ExportError(
            f"head_dim {config.head_dim} is not supported: GroupQueryAttention's rotary "
            "needs a multiple of 16 (--batch-invariant graphs take any even head_dim on the "
            "CPU; their CUDA kernel takes 16, 32, 64 or 128)"
        )
