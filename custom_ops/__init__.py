"""Custom ONNX Runtime operators (the `loopcast` op domain)."""
