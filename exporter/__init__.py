"""Build and check artifacts: torch reference model, checkpoint I/O, ONNX export."""
