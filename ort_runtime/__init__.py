"""Deployable runtime: onnxruntime + numpy + tokenizers only (no torch, no exporter).

``load(artifact_dir)`` returns a :class:`LoopcastModel`; see ``ort_runtime/api.py``.
"""

from loopcast.ort_runtime.api import GenerationResult, LoopcastModel, StreamPiece, load
from loopcast.ort_runtime.decoding.sampling import SamplingParams

__all__ = ["GenerationResult", "LoopcastModel", "SamplingParams", "StreamPiece", "load"]
