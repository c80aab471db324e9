"""The op library's device copies of KV positions (kv_move_cuda.cu), ``cudaMemcpy2DAsync`` over
``planes`` rows of ``capacity`` positions each.

- ``loopcast_cuda_move_positions`` (load_device_move): positions src..src+count-1 of every plane
  go to dst.. of the same plane (disjoint ranges, inside the capacity). A generator moves a
  surviving branch's rows into place with it (one plane per head of a ``[1, H_kv, S_max, D]``
  buffer); a batch generator copies a cached prefix from one sequence entry of a
  ``[B, H_kv, S_max, D]`` buffer to another (the buffer as one plane of B·H_kv·S_max positions,
  one call per head).
- ``loopcast_cuda_copy_positions`` (load_device_copy): positions p..p+count-1 of every plane of
  one buffer into the same positions of another: the last-exited KV policy's deeper slots.
"""

from __future__ import annotations

import ctypes

from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import ArtifactError, RequestError


def _library_function(model: LoadedModel, name: str, what: str, argtypes: list):
    """The library's function (already loaded by the sessions: the graphs need the library, so it
    passed the trust rule, docs/trust.md); RequestError when the artifact has none."""
    from loopcast.manifest import resolve_inside

    manifest = model.manifest
    if not manifest.custom_op_library:
        raise RequestError(f"{what} on the device needs the artifact's custom-op library")
    path = resolve_inside(model.path, manifest.custom_op_library, "custom-op library").resolve()
    fn = getattr(ctypes.CDLL(str(path)), name, None)
    if fn is None:
        raise RequestError(
            f"{path}: this op library has no {name}; re-export the artifact with this loopcast"
        )
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def load_device_move(model: LoadedModel):
    """``move(buffer, planes, capacity, position_bytes, src, dst, count, stream) -> CUDA error``."""
    argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
    return _library_function(model, "loopcast_cuda_move_positions", "moving KV", argtypes)


def load_device_copy(model: LoadedModel):
    """``copy(dst, src, planes, capacity, position_bytes, position, count, stream) -> CUDA error``."""
    argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p]
    return _library_function(model, "loopcast_cuda_copy_positions", "copying KV", argtypes)


def copy_kv_positions(
    copy,
    pairs,
    *,
    entry: int | None,
    entry_bytes: int,
    heads: int,
    capacity: int,
    row_bytes: int,
    n: int,
    m: int,
) -> None:
    """Positions n..n+m-1 of every plane of each ``(src, dst)`` KV buffer pair into the same
    positions of ``dst`` (the last-exited policy's deeper steps): a host copy where ``copy`` is
    None (the CPU), else ``copy`` (load_device_copy). ``entry``: one batch entry's block
    (``entry_bytes`` each) of ``[B, H_kv, S_max, D]`` buffers; None for ``[1, ...]`` buffers."""
    for src, dst in pairs:
        if copy is None:
            at = slice(None) if entry is None else entry
            dst.host[at, :, n : n + m] = src.host[at, :, n : n + m]
            continue
        offset = (entry or 0) * entry_bytes
        code = copy(
            dst.value.data_ptr() + offset,
            src.value.data_ptr() + offset,
            heads,
            capacity,
            row_bytes,
            n,
            m,
            None,
        )
        if code:
            raise ArtifactError(f"copying KV on the device failed (CUDA error {code})")
