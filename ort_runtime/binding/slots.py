"""An artifact's batch of sequence slots: the family's generator behind ``BatchSlots``.

A looped (or Llama-family) artifact's slots are a ``BatchGenerator`` (decode_batch and the
speculative batched kinds), a recurrent-depth artifact's a ``RecurrentBatchGenerator``
(prelude_batch, core_step_batch, coda_batch): the server and the load generator open them here,
so the choice is made once (ort_runtime/binding/batch_slots.py).
"""

from __future__ import annotations

from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.binding.batch_slots import BatchSlots
from loopcast.ort_runtime.binding.recurrent_batch_generator import RecurrentBatchGenerator
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.manifest import DECODE_BATCH
from loopcast.vocab import GraphKind


def has_batch_slots(loaded: LoadedModel) -> bool:
    """Whether the artifact was exported with the batched kinds of its family (--max-batch)."""
    kind = GraphKind.PRELUDE_BATCH if loaded.config.recurrent_depth else DECODE_BATCH
    return kind in loaded.manifest.graphs


def open_batch_slots(
    loaded: LoadedModel,
    max_batch: int | None = None,
    *,
    cuda_graphs: bool | str = False,
    prefill_rows: int | None = None,
) -> BatchSlots:
    """The artifact's slots (``max_batch``: None for the artifact's --max-batch)."""
    family = RecurrentBatchGenerator if loaded.config.recurrent_depth else BatchGenerator
    return family(loaded, max_batch, cuda_graphs=cuda_graphs, prefill_rows=prefill_rows)
