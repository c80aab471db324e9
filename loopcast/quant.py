"""The weight quantization scheme of an artifact, as data (docs/architecture.md, "Quantized weights").

Weight-only round-to-nearest (RTN) block quantization: each output column of a linear layer is
cut into blocks of ``block_size`` along K, each block stored as ``bits``-bit integers with one
fp32 scale (and, asymmetric, one zero point). Norms, the exit gate and rope stay float. The
embedding and the head have their own choice (an int8 head under int4 layers is the usual mixed
recipe). The manifest records the scheme (``quantization``: null for float artifacts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from loopcast.errors import ExportError

BLOCK_SIZES = (32, 64, 128)


class WeightFormat(StrEnum):
    """How one group of weight matrices is stored."""

    FLOAT = "float"  # the artifact's dtype
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return {WeightFormat.INT8: 8, WeightFormat.INT4: 4}[self]


class QuantMethod(StrEnum):
    RTN = "rtn"  # round to nearest, per block (absmax scale, or min/max scale and zero point)
    GGUF = "gguf"  # a GGUF file's Q4_0/Q4_1/Q8_0 blocks, copied (exporter/gguf_blocks.py)


@dataclass(frozen=True)
class QuantScheme:
    """Which weights are quantized and how. ``layers``: every projection of every decoder layer
    (fused q|k|v and gate|up quantized after fusion); ``head``: the lm_head (a tied head gets a
    quantized copy of the embedding, or reads the float embedding when ``head`` is float);
    ``embedding``: the token embedding (quantized: GatherBlockQuantized dequantizes the rows it
    gathers)."""

    layers: WeightFormat
    block_size: int = 32
    symmetric: bool = True
    head: WeightFormat = WeightFormat.FLOAT
    embedding: WeightFormat = WeightFormat.FLOAT
    method: QuantMethod = QuantMethod.RTN
    # MatMulNBits' accuracy_level: 0 and 1 compute in fp32 on the CPU (within 1e-4 of the
    # dequantized reference, but an M=1 row differs from the same row among M>1), 4 quantizes the
    # activations to int8 per block (faster; row-invariant at block 32, and at 64 for int8:
    # tools/probes/check_matmulnbits_rows.py, docs/architecture.md "Quantized weights").
    accuracy_level: int = 4
    # fp32 zero points (MatMulNBits' T1 type) instead of uint8 ones: a GGUF Q4_1 block's
    # ``q·d + m`` is ``(q - z)·d`` with ``z = -m/d``, rarely an integer. Asymmetric only.
    float_zero_points: bool = False

    def __post_init__(self) -> None:
        fields = {"--quantize": self.layers, "--quantize-head": self.head}
        fields["--quantize-embedding"] = self.embedding
        for option, value in fields.items():
            if value not in tuple(WeightFormat):
                raise ExportError(f"{option} must be one of int4, int8 (or float), got {value!r}")
        for name in ("layers", "head", "embedding"):
            object.__setattr__(self, name, WeightFormat(getattr(self, name)))
        if self.layers is WeightFormat.FLOAT:
            raise ExportError("--quantize must be int4 or int8 (float is no quantization)")
        if self.embedding is not WeightFormat.FLOAT and self.float_zero_points:
            raise ExportError(
                "--quantize-embedding needs uint8 zero points (GatherBlockQuantized): keep the "
                "embedding float for fp32-zero-point blocks"
            )
        if self.block_size not in BLOCK_SIZES:
            raise ExportError(f"--block-size must be one of 32, 64, 128, got {self.block_size}")
        if self.method not in tuple(QuantMethod):
            raise ExportError(f"quantization method must be rtn, got {self.method!r}")
        object.__setattr__(self, "method", QuantMethod(self.method))
        if self.accuracy_level not in (0, 1, 4):
            raise ExportError(f"--accuracy-level must be 0, 1 or 4, got {self.accuracy_level}")
        if self.float_zero_points and self.symmetric:
            raise ExportError("float zero points need an asymmetric scheme")
        if self.method is QuantMethod.GGUF and self.block_size != 32:
            raise ExportError(f"GGUF blocks hold 32 values, got block_size {self.block_size}")

    def to_dict(self) -> dict:
        return {
            "method": str(self.method),
            "layers": str(self.layers),
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "head": str(self.head),
            "embedding": str(self.embedding),
            "accuracy_level": self.accuracy_level,
            "float_zero_points": self.float_zero_points,
        }

    @classmethod
    def from_dict(cls, d: dict) -> QuantScheme:
        return cls(
            layers=d["layers"],
            block_size=d["block_size"],
            symmetric=d["symmetric"],
            head=d["head"],
            embedding=d["embedding"],
            method=d["method"],
            accuracy_level=d["accuracy_level"],
            float_zero_points=d.get("float_zero_points", False),
        )

    def describe(self) -> str:
        """One line for ``loopcast inspect``."""
        zp = "symmetric" if self.symmetric else "asymmetric"
        if self.float_zero_points:
            zp += " (fp32 zero points)"
        return (
            f"{self.method} {self.layers} block {self.block_size} {zp}, head {self.head}, "
            f"embedding {self.embedding}, accuracy_level {self.accuracy_level}"
        )


def parse_format(option: str, value: str, layers: WeightFormat) -> WeightFormat:
    """A CLI choice of float|int8|int4|same (``same``: the layers' format)."""
    if value == "same":
        return layers
    if value not in tuple(WeightFormat):
        raise ExportError(f"{option} must be one of float, int8, int4, same, got {value!r}")
    return WeightFormat(value)


EMBEDDING = "embed_tokens.weight"


@dataclass(frozen=True)
class QuantLinear:
    """One quantized matrix of the graphs: ``x @ W`` with ``W`` [K, N] stored as MatMulNBits
    tensors ``{base}.weight_q`` (uint8 [N, blocks, blob]), ``{base}.scales`` (fp32) and, when
    asymmetric, ``{base}.zero_points`` (uint8), where ``weight`` is ``{base}.weight_T``. The
    embedding (``weight`` = EMBEDDING, [V, H] read by rows: N = V, K = H) is stored the same way
    in GatherBlockQuantized's shapes (``gathered``: packed [V, H·b/8], scales [V, blocks], zero
    points [V, ceil(blocks·b/8)]; the same bytes)."""

    weight: str  # the float name it replaces ("layers.0.qkv_proj.weight_T")
    k: int
    n: int
    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int
    float_zero_points: bool = False

    @property
    def base(self) -> str:
        return self.weight.removesuffix(".weight_T").removesuffix(".weight")

    @property
    def gathered(self) -> bool:
        return self.weight == EMBEDDING

    @property
    def stored(self) -> dict[str, str]:
        """Role → stored tensor name."""
        out = {"packed": f"{self.base}.weight_q", "scales": f"{self.base}.scales"}
        if not self.symmetric:
            out["zero_points"] = f"{self.base}.zero_points"
        return out


def quantized_linears(
    config, scheme: QuantScheme | None, head_size: int | None = None
) -> dict[str, QuantLinear]:
    """Every matrix ``scheme`` quantizes in an artifact of ``config`` (a ``ModelConfig``), by the
    float name the graphs know it by; the exporter's weights and every graph builder use this one
    map, so the twin of the exactness probe and a re-widened artifact see the same weights.
    ``head_size``: the stored attention head size of padded heads (exporter/head_padding.py; the
    attention matrices are quantized in the padded layout)."""
    if scheme is None:
        return {}
    h, d, inter = config.hidden_size, head_size or config.head_dim, config.intermediate_size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    shapes = {"qkv_proj": (h, qkv), "o_proj": (config.num_heads * d, h)}
    shapes |= {"gate_up_proj": (h, 2 * inter), "down_proj": (inter, h)}
    layers = [f"layers.{i}" for i in range(config.num_layers)]
    layers += [f"prelude_layers.{i}" for i in range(config.num_prelude_layers)]
    layers += [f"coda_layers.{i}" for i in range(config.num_coda_layers)]

    def entry(weight: str, k: int, n: int, fmt: WeightFormat) -> QuantLinear:
        # fp32 zero points are a Q4_1 block's; an 8-bit matrix beside them (a GGUF's Q8_0 head
        # under Q4_1 layers) keeps uint8 ones (128): MatMulNBits refuses 8 bits with fp32 ones
        float_zp = scheme.float_zero_points and fmt.bits == 4
        return QuantLinear(
            weight,
            k,
            n,
            fmt.bits,
            scheme.block_size,
            scheme.symmetric,
            scheme.accuracy_level,
            float_zp,
        )

    out = {}
    for layer in layers:
        for proj, (k, n) in shapes.items():
            name = f"{layer}.{proj}.weight_T"
            out[name] = entry(name, k, n, scheme.layers)
    if scheme.head is not WeightFormat.FLOAT:
        out["lm_head.weight_T"] = entry("lm_head.weight_T", h, config.vocab_size, scheme.head)
    if scheme.embedding is not WeightFormat.FLOAT:
        if config.tie_word_embeddings and scheme.head is WeightFormat.FLOAT:
            raise ExportError(
                "--quantize-embedding with a tied float head: the head reads the float embedding; "
                "quantize the head too (--quantize-head int8|int4)"
            )
        if scheme.embedding is WeightFormat.INT4 and h % 2:
            raise ExportError(f"--quantize-embedding int4 needs an even hidden size, got {h}")
        out[EMBEDDING] = entry(EMBEDDING, h, config.vocab_size, scheme.embedding)
    return out


def quant_scheme_from_options(
    quantize: str | None,
    block_size: int = 32,
    asymmetric: bool = False,
    head: str = "same",
    embedding: str = "float",
    accuracy_level: int = 4,
) -> QuantScheme | None:
    """The scheme ``loopcast export``'s options ask for (None: no --quantize, and then the other
    quantization options must keep their defaults)."""
    if quantize is None:
        changed = [
            option
            for option, value, default in (
                ("--block-size", block_size, 32),
                ("--asymmetric", asymmetric, False),
                ("--quantize-head", head, "same"),
                ("--quantize-embedding", embedding, "float"),
                ("--accuracy-level", accuracy_level, 4),
            )
            if value != default
        ]
        if changed:
            raise ExportError(f"{changed[0]} needs --quantize int4|int8")
        return None
    if quantize not in (WeightFormat.INT4, WeightFormat.INT8):
        raise ExportError(f"--quantize must be one of int4, int8, got {quantize!r}")
    layers = WeightFormat(quantize)
    return QuantScheme(
        layers,
        block_size,
        not asymmetric,
        parse_format("--quantize-head", head, layers),
        parse_format("--quantize-embedding", embedding, layers),
        accuracy_level=accuracy_level,
    )
