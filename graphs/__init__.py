"""ONNX graph builders: one function per block, composed into graph kinds."""
