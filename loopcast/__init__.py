"""loopcast: export looped transformers to ONNX and run them with ONNX Runtime.

Subpackages: ``loopcast.exporter`` (torch reference, checkpoints, ONNX export),
``loopcast.graphs`` (graph builders), ``loopcast.ort_runtime`` (the deployable runtime:
onnxruntime + numpy + tokenizers only) and ``loopcast.custom_ops``.
"""

__version__ = "0.1.0"
