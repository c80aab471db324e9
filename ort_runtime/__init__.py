"""Deployable runtime: onnxruntime + numpy + tokenizers only (no torch, no exporter).

``load(artifact_dir)`` returns a :class:`LoopcastModel`; see ``ort_runtime/api.py``. A
generation's options are one :class:`GenerationConfig` (or its fields as keywords).
"""

from loopcast.ort_runtime.api import GenerationResult, LoopcastModel, StreamPiece, load
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.stats import GenerationStats

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "GenerationStats",
    "LoopcastModel",
    "SamplingParams",
    "SpeculationConfig",
    "StreamPiece",
    "load",
]
