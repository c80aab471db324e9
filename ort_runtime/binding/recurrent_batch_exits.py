"""The KL exit of a batched verify step (ort_runtime/binding/recurrent_batch_generator.py): each
KL request's rows take the output a one-sequence verify gives them (``RecurrentGenerator.verify``
with ``kl_exit``, ``full`` KV only).

Every row has run all of its request's r core steps (what ``full`` does for the skipped steps'
KV) and the call's coda has run on the step-r states. Then, row by row (j = 0..S-1), every KL
request still deciding row j takes the coda after each checked step in order, until the first
whose KL to the previous step's distribution is below its threshold; the rows of all slots are
one ``coda_batch`` call per (row, step), a row per slot at n_b + j:

    KL slot deciding row j at step t   its state after t core steps (writes its coda KV)
    KL slot that left row j            its exit state: the same coda KV bits again
    any other slot                     its row j's step-r state: the same bits again (rows of a
                                       call are one-row calls bit for bit: exact_verify)

So when row j is checked, rows < j of its slot hold their exits' coda KV, and row j reads them,
as the one-sequence verify's row-by-row codas do; row j's own coda KV is its exit's at the end.
Rows past a slot's given ones are padding at positions its next step rewrites.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loopcast.kl_exit import KLExit, step_kl, uniform_log_probs


def frozen_states(host: np.ndarray, exited: dict[int, tuple[int, np.ndarray]]) -> np.ndarray:
    """``host`` states with each exited row's state at its exit (a one-row step's KL exit)."""
    for s, (_, state) in exited.items():
        host[s] = state
    return host


def kl_verify_rows(
    coda_rows: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    kl: dict[int, KLExit],
    given: dict[int, int],
    states: dict[int, np.ndarray],
    final: np.ndarray,
    depth: np.ndarray,
    first: np.ndarray,
    out_ids: np.ndarray,
    out_logits: np.ndarray,
    vocab: int,
) -> dict[int, list[int]]:
    """``coda_rows(state_W1H, positions_W)`` runs coda_batch on one row a slot and returns its
    ids ``[W, 1]`` and logits ``[W, 1, V]`` on the host; ``kl``: slot -> its KL exit; ``given``:
    slot -> its given rows; ``states[t]``: the call's states ``[W, S, H]`` after t core steps;
    ``final``: the states the call's coda read; ``depth``: each slot's r; ``first``: each slot's
    first position. Overwrites the KL slots' given rows of ``out_ids`` / ``out_logits`` with
    their exit outputs; returns slot -> each given row's exit step count."""
    exits = {s: [int(depth[s])] * given[s] for s in kl}
    for j in range(int(final.shape[1])):
        deciding = {s for s in kl if j < given[s]}
        if not deciding:
            break
        frozen = final[:, j].copy()  # [W, H]: what every slot's row j rewrites unless deciding
        previous = {s: uniform_log_probs(vocab) for s in deciding}
        # the checked steps: from min_loops (only step r, unchecked, when min_loops > r)
        start = {s: min(kl[s].min_loops, int(depth[s])) for s in deciding}
        for t in range(1, int(max(depth[s] for s in deciding)) + 1):
            active = [s for s in deciding if start[s] <= t <= depth[s]]
            if not active:
                continue
            state = frozen.copy()
            for s in active:
                state[s] = states[t][s, j]
            ids, logits = coda_rows(state[:, None, :], first + j)
            for s in active:
                row_logits = logits[s, 0]
                left = t == depth[s]  # the last step: its output whatever the KL
                if t >= kl[s].min_loops:
                    value, previous[s] = step_kl(previous[s], row_logits)
                    left = left or value < kl[s].threshold
                if left:
                    exits[s][j] = t
                    out_ids[s, j], out_logits[s, j] = ids[s, 0], row_logits
                    frozen[s] = state[s]
                    deciding.discard(s)
            if not deciding:
                break
    return exits
