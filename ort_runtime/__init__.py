"""Deployable runtime: onnxruntime + numpy + tokenizers only (no torch, no exporter)."""
