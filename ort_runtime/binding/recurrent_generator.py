"""One sequence of a recurrent-depth (Huginn) artifact: prelude → r core steps → coda per call.

The number of core steps r is chosen per generator (``loops``, 1..the artifact's
``max_recurrence``; default the release's ``mean_recurrence``), and may be changed per call, so
a request picks its depth at run time without ONNX control flow (graphs/recurrent.py). On CUDA
(fp16/bf16 artifacts) the state and the prelude output stay on the device between the calls;
only the coda's ids and logits come back. Every call over M new tokens at positions n..n+M-1:

    prelude(ids)                          writes the prelude slots         → e
    s_0 = initial_state(seed, positions)  (loopcast/recurrent_state.py)
    core_step k = 0..r-1 (s_k, e)         writes slots k·L + l (or shared) → s_k+1
    coda(s_r)                             writes the coda slots            → argmax, logits

The KV buffers (one K and one V ``[1, H_kv, S_max, D]`` per slot, docs/architecture.md §2) are
allocated once and bound as past and present of the graph that reads them; core_step has one
binding per step k, its step-0 KV names bound to step k's buffers. The host owns ``n``:
``rewind(n')`` only moves it, and a later call rewrites every slot it runs at the rewound
positions before any row reads them. A step at depth r reads steps 0..r-1's KV of earlier
positions; a shallower call leaves the deeper slots of its positions stale, which is why
every call that commits a position must run it at the generator's depth (``draft`` rows are
rewound and recomputed before they are committed); a call deeper than every committed position
holds is refused rather than reading the stale slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.bindings import _Buffer, host_copy, run_bound
from loopcast.ort_runtime.binding.device_move import copy_kv_positions, load_device_copy
from loopcast.ort_runtime.binding.recurrent_cycle import RecurrentCycleBinding
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import ConfigError, RequestError
from loopcast.kl_exit import KLExit, step_kl, uniform_log_probs
from loopcast.kv_sharing import core_kv_slot, parse_sharing
from loopcast.recurrent_state import initial_state
from loopcast.vocab import GraphKind

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
_ONNX_BFLOAT16 = 16


@dataclass(frozen=True)
class RecurrentStep:
    next_ids: np.ndarray  # [M] int64: each row's argmax
    logits: np.ndarray  # [M, V] float32
    exit_loops: int  # the core steps the output was taken after (r without a KL exit)
    row_exits: tuple[int, ...] = ()  # verify with a KL exit: each row's own exit step


class RecurrentGenerator:
    """KV buffers and bindings of one sequence; ``loops`` core steps per call, ``state_seed``
    draws the initial state (None: zero, the deterministic start)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        loops: int | None = None,
        state_seed: int | None = None,
        kv_sharing: str | None = None,
        max_loops: int | None = None,
    ) -> None:
        cfg = loaded.config
        if not cfg.recurrent_depth:
            raise RequestError(f"RecurrentGenerator runs recurrent-depth artifacts, not {cfg.model_type}")
        self.loaded, self.config, self.device = loaded, cfg, loaded.device
        # KV buffers and bindings for steps 0..max_loops-1 only (default: the artifact's maximum)
        self.max_loops = cfg.num_loops
        self.max_loops = self.check_loops(cfg.num_loops if max_loops is None else max_loops, "max_loops")
        default = cfg.loops_default if loops is None and cfg.loops_default <= self.max_loops else loops
        self.loops = self.check_loops(self.max_loops if default is None else default)
        if state_seed is not None and (not isinstance(state_seed, int) or state_seed < 0):
            raise RequestError(f"state_seed must be a non-negative integer or None, got {state_seed!r}")
        self.state_seed = state_seed
        # the release's compress-* lookups (loopcast/kv_sharing.py): fewer core slots, plain decoding
        try:
            self.sharing = parse_sharing(kv_sharing)
        except ConfigError as exc:
            raise RequestError(str(exc)) from None
        core_slot = {
            (k, l): core_kv_slot(cfg.num_layers, k, l, self.sharing)
            for k in range(self.max_loops)
            for l in range(cfg.num_layers)
        }
        self.max_length = loaded.manifest.max_length
        self.dtype = _NP_DTYPES[loaded.manifest.dtype]
        shape = (1, cfg.num_kv_heads, self.max_length, loaded.manifest.kv_head_size)  # padded: stored
        used = sorted(set(core_slot.values())) + [cfg.prelude_slot(l) for l in range(cfg.num_prelude_layers)]
        used += [cfg.coda_slot(l) for l in range(cfg.num_coda_layers)]
        self.kv = {
            slot: (_Buffer(shape, self.dtype, self.device), _Buffer(shape, self.dtype, self.device))
            for slot in used
        }
        self._device_copy = None  # the op library's KV copy, loaded on the first CUDA use
        self.n = 0
        self.tokens: list[int] = []  # the committed sequence (prompt lookup reads it)
        # the core steps each position's KV holds (a call at r reads steps < r of earlier positions)
        self._depth = np.zeros(self.max_length, np.int32)
        self.core_runs = 0  # core_step calls so far (whatever their rows): passes over the core
        prelude = {cfg.prelude_slot(l): cfg.prelude_slot(l) for l in range(cfg.num_prelude_layers)}
        coda = {cfg.coda_slot(l): cfg.coda_slot(l) for l in range(cfg.num_coda_layers)}
        self._prelude = self._bind(GraphKind.PRELUDE, prelude)
        self._steps = [
            self._bind(
                GraphKind.CORE_STEP, {cfg.core_slot(0, l): core_slot[k, l] for l in range(cfg.num_layers)}
            )
            for k in range(self.max_loops)
        ]
        self._coda = self._bind(GraphKind.CODA, coda)
        self._cycle: RecurrentCycleBinding | None = None  # the pipeline's, made on first use

    @property
    def cycle(self) -> RecurrentCycleBinding:
        """The pipeline's cycle binding (ort_runtime/binding/recurrent_cycle.py) on this
        generator's KV buffers; made on first use (only the pipeline runs it)."""
        if self._cycle is None:
            self._cycle = RecurrentCycleBinding(self.loaded, self.kv, self.dtype)
        return self._cycle

    def commit_lane(self, token: int) -> None:
        """A pipeline lane at position n left the coda after every one of the generator's
        ``loops`` core steps (the cycles wrote each slot it ran): n += 1."""
        if self.n >= self.max_length:
            raise RequestError(f"a lane at {self.n} is outside the KV capacity {self.max_length}")
        self._commit(self.n, [token], self.loops)
        self.n += 1

    @property
    def model(self) -> LoadedModel:
        """The loaded artifact (as ``Generator.model``)."""
        return self.loaded

    def configure(self, loops: int | None, state_seed: int | None) -> None:
        """One request's depth (None: the release's default r, or the most this generator holds)
        and initial-state seed; the KV already committed stays what it is."""
        default = self.config.loops_default if self.config.loops_default <= self.max_loops else self.max_loops
        self.loops = self.check_loops(default if loops is None else loops)
        if state_seed is not None and (not isinstance(state_seed, int) or state_seed < 0):
            raise RequestError(f"state_seed must be a non-negative integer or None, got {state_seed!r}")
        self.state_seed = state_seed

    def check_loops(self, loops: int, name: str = "loops") -> int:
        if isinstance(loops, bool) or not isinstance(loops, int) or not 1 <= loops <= self.max_loops:
            bound = (
                "the artifact's max_recurrence" if self.max_loops == self.config.num_loops else "max_loops"
            )
            raise RequestError(
                f"{name} must be an integer in 1..{self.max_loops} ({bound}), got {loops!r}", parameter=name
            )
        return loops

    def _bind(self, kind: GraphKind, slots: dict[int, int]) -> tuple[ort.InferenceSession, ort.IOBinding]:
        """``slots``: the graph's KV name → the buffer bound to it, as past and present."""
        session = self.loaded.sessions[kind]
        binding = session.io_binding()
        for name, slot in slots.items():
            for which, buffer in zip(("key", "value"), self.kv[slot]):
                binding.bind_ortvalue_input(f"past_{which}.{name}", buffer.value)
                binding.bind_ortvalue_output(f"present_{which}.{name}", buffer.value)
        return session, binding

    def _value(self, array: np.ndarray) -> ort.OrtValue:
        array = np.ascontiguousarray(array, dtype=self.dtype)
        if self.dtype == ml_dtypes.bfloat16:
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), _ONNX_BFLOAT16)
        return ort.OrtValue.ortvalue_from_numpy(array)

    def _run(self, graph, inputs: dict, outputs: list[str], on_host: bool = False) -> list[ort.OrtValue]:
        """Bind and run one call (bindings.run_bound): outputs on the generator's device, or the
        host (the coda's ids and logits)."""
        session, binding = graph
        device = "cpu" if on_host else self.device
        return run_bound(binding, lambda: session.run_with_iobinding(binding), inputs, outputs, device)

    def step(
        self, ids: list[int], *, loops: int | None = None, kl_exit: KLExit | None = None
    ) -> RecurrentStep:
        """Run ``ids`` at positions n.. through prelude, ``loops`` core steps (default the
        generator's) and coda; commits them (n += M) and returns each row's argmax and logits.
        ``kl_exit`` (loopcast/kl_exit.py) takes the output at the first step whose KL to the
        previous step's distribution (the last row's) is below its threshold; the skipped steps'
        slots are filled as its ``kv_policy`` says."""
        r = self.loops if loops is None else self.check_loops(loops)
        m, n = len(ids), self.n
        if m < 1:
            raise RequestError("step needs at least one token")
        if kl_exit is not None and self.sharing is not None:
            raise RequestError("the KL exit needs a KV slot per (step, layer): kv_sharing must be None")
        if n + m > self.max_length:
            raise RequestError(f"{n + m} tokens exceed the artifact's max length {self.max_length}")
        self.require_depth(r, n)
        lengths, embedded, state = self._enter(ids, n)
        out, exit_loops, previous = None, r, uniform_log_probs(self.config.vocab_size)
        for k in range(r):
            state = self._core_step(k, state, embedded, lengths)
            if kl_exit is not None and k + 1 >= kl_exit.min_loops:
                out = self._coda_outputs(state, lengths)  # the check writes the coda KV, as the release's
                kl, previous = step_kl(previous, out.logits[-1])
                if kl < kl_exit.threshold:
                    exit_loops = k + 1
                    break
        if out is None:
            out = self._coda_outputs(state, lengths)
        for k in range(exit_loops, r):  # the steps the rows skipped
            if kl_exit is not None and kl_exit.kv_policy == "full":
                state = self._core_step(k, state, embedded, lengths)  # for the KV only
            else:  # last-exited: the exit step's K/V, layer by layer
                self._copy_step_kv(exit_loops - 1, k, n, m)
        self.n = n + m
        self._commit(n, ids, r)
        return RecurrentStep(out.next_ids, out.logits, exit_loops)

    def _copy_step_kv(self, src_step: int, dst_step: int, n: int, m: int) -> None:
        """Core step ``src_step``'s K/V at positions n..n+m-1 into step ``dst_step``'s slots, every
        core layer: a host copy on the CPU, the op library's device copy on CUDA
        (loopcast_cuda_copy_positions, ort_runtime/binding/device_move.py)."""
        cfg = self.config
        if self.device != "cpu" and self._device_copy is None:
            self._device_copy = load_device_copy(self.loaded)
        row_bytes = self.loaded.manifest.kv_head_size * np.dtype(self.dtype).itemsize
        for l in range(cfg.num_layers):
            pairs = zip(self.kv[cfg.core_slot(src_step, l)], self.kv[cfg.core_slot(dst_step, l)])
            copy_kv_positions(
                self._device_copy,
                pairs,
                entry=None,
                entry_bytes=0,
                heads=cfg.num_kv_heads,
                capacity=self.max_length,
                row_bytes=row_bytes,
                n=n,
                m=m,
            )

    def _enter(self, ids: list[int], n: int) -> tuple[dict, ort.OrtValue, ort.OrtValue]:
        """Rows ids at positions n..: their lengths inputs, the prelude's embedding and the
        initial state (seeded or zero, by position)."""
        m = len(ids)
        lengths = {
            "seqlens_k": np.array([n + m - 1], np.int32),
            "total_sequence_length": np.array(n + m, np.int32),
        }
        (embedded,) = self._run(
            self._prelude, {"input_ids_BS": np.array([ids], np.int64), **lengths}, ["embedded_BSH"]
        )
        cfg = self.config
        state = self._value(
            initial_state(cfg.hidden_size, cfg.state_std, np.arange(n, n + m), self.state_seed)[None]
        )
        return lengths, embedded, state

    def _core_step(self, k: int, state: ort.OrtValue, embedded: ort.OrtValue, lengths: dict) -> ort.OrtValue:
        self.core_runs += 1
        (out,) = self._run(
            self._steps[k], {"state_BSH": state, "embedded_BSH": embedded, **lengths}, ["state_BSH_out"]
        )
        return out

    def _coda_outputs(self, state: ort.OrtValue, lengths: dict) -> RecurrentStep:
        next_ids, logits = self._run(
            self._coda, {"state_BSH": state, **lengths}, ["next_token_ids_BS", "logits_BSV"], on_host=True
        )
        return RecurrentStep(next_ids.numpy()[0].copy(), logits.numpy()[0].copy(), 0)

    def verify(self, ids: list[int], kl_exit: KLExit | None = None) -> RecurrentStep:
        """``ids`` at positions n.. at the generator's depth, each row's output as a one-row
        ``step`` of it would give: without an exit that is ``step(ids)`` (rows of one call are
        one-row calls bit for bit where the manifest declares ``exact_verify``). With the KL exit
        (``full`` KV only), every row runs all r core steps, as a one-row call does for its KV,
        and then each row in order takes the coda after each step until its own exit: a row's
        coda reads the earlier rows' coda KV at their exits, which is what a one-row call reads.
        Costs up to M·r one-row coda calls; commits the rows (n += M)."""
        if kl_exit is None:
            return self.step(ids)
        if kl_exit.kv_policy != "full":
            raise RequestError(
                "speculation with the KL exit needs kv_policy 'full': with 'last-exited' a token's "
                "skipped-step KV depends on its exit, which a verify call over several rows cannot know"
            )
        r, m, n = self.loops, len(ids), self.n
        if m < 1 or n + m > self.max_length:
            raise RequestError(f"verify of {m} rows at {n} outside the KV capacity {self.max_length}")
        self.require_depth(r, n)
        lengths, embedded, state = self._enter(ids, n)
        states = []  # [M, H] on the host after each checked step
        for k in range(r):
            state = self._core_step(k, state, embedded, lengths)
            if k + 1 >= kl_exit.min_loops:
                states.append(np.asarray(host_copy(state))[0])
        if not states:
            states.append(np.asarray(host_copy(state))[0])
        ids_out = np.empty(m, np.int64)
        logits = np.empty((m, self.config.vocab_size), np.float32)
        exits = []
        for j in range(m):
            ids_out[j], logits[j], exit_loops = self.exit_output([s[j] for s in states], n + j, kl_exit)
            exits.append(exit_loops)
        self.n = n + m
        self._commit(n, ids, r)
        return RecurrentStep(ids_out, logits, exits[-1], tuple(exits))

    def exit_output(
        self, states_H: list[np.ndarray], position: int, kl_exit: KLExit
    ) -> tuple[int, np.ndarray, int]:
        """One row's KL exit after it ran all r core steps (``full`` KV): ``states_H`` holds its
        state after each checked step (steps min_loops..r; only step r's when min_loops > r).
        The coda at ``position`` after each of them, in order, until the first whose KL to the
        previous step's distribution is below the threshold: (argmax, logits, exit loops). Each
        coda call writes the row's coda KV, so the exit step's is what stays, as in ``step``; it
        reads the coda KV of the positions before, which must hold their own exits' (the verify
        rows and the pipeline's lanes take their exits in position order)."""
        r = self.loops
        first = r - len(states_H) + 1  # the core steps after states_H[0]
        row = {
            "seqlens_k": np.array([position], np.int32),
            "total_sequence_length": np.array(position + 1, np.int32),
        }
        previous, exit_loops = uniform_log_probs(self.config.vocab_size), r
        out = None
        for i, s_k in enumerate(states_H):
            out = self._coda_outputs(self._value(s_k[None, None]), row)
            if first + i < kl_exit.min_loops:
                break  # min_loops > r: the output after r steps, unchecked
            kl, previous = step_kl(previous, out.logits[-1])
            if kl < kl_exit.threshold:
                exit_loops = first + i
                break
        assert out is not None, "exit_output needs at least one state"
        return int(out.next_ids[-1]), out.logits[-1], exit_loops

    def _commit(self, n: int, ids: list[int], r: int) -> None:
        del self.tokens[n:]
        self.tokens.extend(int(t) for t in ids)
        self._depth[n : n + len(ids)] = r  # a KL exit's skipped steps are filled (its kv_policy)

    def require_depth(self, r: int, n: int) -> None:
        """A call at r reads steps 0..r-1 of positions < n: refuse one deeper than they hold."""
        held = int(self._depth[:n].min()) if n else r
        if r > held:
            raise RequestError(
                f"loops={r} would read core steps that this generator's committed tokens did not run "
                f"(positions < {n} hold {held}); rewind(0) first or continue at loops <= {held}",
                parameter="loops",
            )

    def rewind(self, n: int) -> None:
        """Forget positions n.. (only moves n: their KV is rewritten before it is read again)."""
        if not 0 <= n <= self.n:
            raise RequestError(f"rewind to {n} outside 0..{self.n}")
        self.n = n
        del self.tokens[n:]

    def greedy(
        self,
        prompt: list[int],
        max_new_tokens: int,
        *,
        stop_ids: tuple[int, ...] = (),
        kl_exit: KLExit | None = None,
        exits: list[int] | None = None,
    ) -> tuple[list[int], list[np.ndarray]]:
        """Plain greedy decoding from a reset: the prompt in one call, then one token per call.
        Returns the new tokens and each one's logits ``[V]``; with ``kl_exit``, ``exits`` (if
        given) gets each call's exit step count."""
        self.rewind(0)
        out = self.step(list(prompt), kl_exit=kl_exit)
        tokens: list[int] = []
        logits: list[np.ndarray] = []
        while True:
            token = int(out.next_ids[-1])
            tokens.append(token)
            logits.append(out.logits[-1])
            if exits is not None:
                exits.append(out.exit_loops)
            if len(tokens) >= max_new_tokens or token in stop_ids or self.n >= self.max_length:
                return tokens, logits
            out = self.step([token], kl_exit=kl_exit)
