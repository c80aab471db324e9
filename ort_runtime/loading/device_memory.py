"""Exact-size CUDA allocations as ORT values: the shared weights' and the KV buffers' memory.

ORT's Python allocates device OrtValues from its CUDA arena, which grows in powers of two
(``kNextPowerOfTwo``): uploading 2.7 GiB of weights tensor by tensor left the arena holding
about 4 GiB, measured on the H200 (docs/perf.md, "Run-time memory"). Here each buffer is one
``cuMemAlloc`` of exactly its size, in the device's primary context (the one ORT's CUDA
provider runs in), handed to ORT as a DLPack tensor: ORT wraps it without copying, the value's
buffer is ours (so ``SessionOptions.add_initializer`` accepts it), and ORT calls the DLPack
deleter, which frees the memory, when the last OrtValue on it is released.

Only the CUDA driver library (``libcuda.so.1``, installed with the driver) is used; where it
cannot be loaded, ``available()`` is false and callers keep ORT's allocations.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import onnxruntime as ort

_KDL_CUDA = 2
# DLPack dtype (code, bits) per ONNX element type: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4
# ONNX element type -> (DLPack type code, bits); uint8 carries quantized weights' codes and zero points
_DL_TYPES = {1: (2, 32), 10: (2, 16), 16: (4, 16), 6: (0, 32), 7: (0, 64), 2: (1, 8)}
_ONNX_OF_NUMPY = {
    np.dtype(np.float32): 1,
    np.dtype(np.float16): 10,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.uint8): 2,
}


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_CAPSULE_NAME = b"dltensor"
_lock = threading.Lock()
_live: dict[int, tuple[_Managed, ctypes.Array, int]] = {}  # struct address -> (struct, shape, device pointer)
_driver: tuple[ctypes.CDLL, ctypes.c_void_p] | None = None
_driver_error: str | None = None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with error {code}")


def _cuda() -> ctypes.CDLL:
    """The driver library with device 0's primary context current on this thread."""
    global _driver, _driver_error
    with _lock:
        if _driver is None and _driver_error is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
                lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
                lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
                lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                _check(lib.cuInit(0), "cuInit")
                device, context = ctypes.c_int(), ctypes.c_void_p()
                _check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
                _check(
                    lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain"
                )
                _driver = (lib, context)
            except (OSError, AttributeError, RuntimeError) as exc:
                _driver_error = str(exc)
        if _driver is None:
            raise RuntimeError(f"CUDA driver library unusable: {_driver_error}")
        lib, context = _driver
    _check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    return lib


def available() -> bool:
    try:
        _cuda()
        return True
    except RuntimeError:
        return False


@_DELETER
def _release(managed) -> None:
    # ORT calls this when the last value on the buffer goes, possibly while the interpreter
    # shuts down: never raise (module globals may already be gone by then).
    try:
        with _lock:
            entry = _live.pop(ctypes.addressof(managed.contents), None)
        if entry is not None and _driver is not None:
            _driver[0].cuMemFree_v2(entry[2])
    except Exception:  # noqa: BLE001 - a deleter has no caller to report to
        pass


# The deleter must outlive every value ORT holds, including values freed during shutdown.
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_release))


def device_value(shape: tuple[int, ...], onnx_type: int, host: np.ndarray | None = None) -> ort.OrtValue:
    """A CUDA OrtValue of exactly ``shape`` (ONNX element type ``onnx_type``), zero-filled or
    holding ``host``'s bytes (same byte size; bf16 as uint16)."""
    lib = _cuda()
    count = int(np.prod(shape, dtype=np.int64))
    code, bits = _DL_TYPES[onnx_type]
    nbytes = count * bits // 8
    data = (
        np.zeros(nbytes, np.uint8) if host is None else np.ascontiguousarray(host).reshape(-1).view(np.uint8)
    )
    if data.nbytes != nbytes:
        raise ValueError(f"{data.nbytes} bytes do not fill shape {list(shape)} of element type {onnx_type}")
    pointer = ctypes.c_uint64()
    _check(lib.cuMemAlloc_v2(ctypes.byref(pointer), max(nbytes, 1)), f"cuMemAlloc({nbytes})")
    try:
        _check(lib.cuMemcpyHtoD_v2(pointer.value, data.ctypes.data, nbytes), "cuMemcpyHtoD")
    except RuntimeError:
        lib.cuMemFree_v2(pointer.value)
        raise
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = _Managed()
    managed.dl_tensor = _Tensor(
        ctypes.c_void_p(pointer.value),
        _Device(_KDL_CUDA, 0),
        len(shape),
        _DataType(code, bits, 1),
        dims,
        None,
        0,
    )
    managed.deleter = _release
    with _lock:
        _live[ctypes.addressof(managed)] = (managed, dims, pointer.value)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = (
        ctypes.py_object,
        [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p],
    )
    return ort.OrtValue.from_dlpack(new_capsule(ctypes.addressof(managed), _CAPSULE_NAME, None))


def onnx_type_of(dtype) -> int:
    return _ONNX_OF_NUMPY[np.dtype(dtype)]
