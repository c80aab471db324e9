"""Python API: load an artifact once, then generate or stream from text or token ids.

    from loopcast.ort_runtime import load
    model = load("artifacts/demo")
    result = model.generate("def main():", max_new_tokens=64, speculative="prompt-lookup")
    for piece in model.stream("def main():", max_new_tokens=64):
        print(piece.text, end="")
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from loopcast.errors import RequestError
from loopcast.ort_runtime.artifact import LoadedModel, open_artifact
from loopcast.ort_runtime.decoding import GenerationStats, SpeculationConfig, stream
from loopcast.ort_runtime.generator import Generator
from loopcast.ort_runtime.speculate import TieGuard


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str
    stats: GenerationStats


@dataclass(frozen=True)
class StreamPiece:
    token: int
    text: str          # newly decodable text ("" while a multi-byte character is incomplete)


class _GeneratorPool:
    """Idle generators for the convenience methods. A call checks one out (making a new one when
    none is idle) and gives it back when its stream ends, fails or is closed, so no two calls
    ever share KV buffers or IO bindings. At most ``keep`` idle ones are kept: a generator owns
    KV buffers of the full max length, so a burst of threads must not pin them all forever."""

    def __init__(self, factory, keep: int = 2) -> None:
        self._factory, self._keep = factory, keep
        self._idle: list[Generator] = []
        self._lock = threading.Lock()

    def take(self) -> Generator:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._factory()  # outside the lock: allocating KV buffers can take a while

    def give(self, generator: Generator) -> None:
        with self._lock:
            if len(self._idle) < self._keep:
                self._idle.append(generator)


class LoopcastModel:
    """A loaded artifact; make generators with :meth:`new_generator`.

    Concurrency: ``generate``, ``stream`` and ``stream_ids`` without ``generator=`` may be
    called from several threads at once and their streams may be interleaved: each call takes
    its own generator from a small pool and returns it when the stream is exhausted or closed
    (an abandoned stream keeps its generator until it is garbage-collected). A generator passed
    as ``generator=`` (or from :meth:`new_generator`) is one sequence's state: use it from one
    thread and one stream at a time. A ``tie_guard`` or ``proposer`` object passed in is the
    caller's and is shared if the caller shares it.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._pool = _GeneratorPool(self.new_generator)

    @property
    def config(self):
        return self.loaded.config

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def new_generator(self) -> Generator:
        return Generator(self.loaded)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(f"{self.loaded.path}: no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt).ids
        return [int(t) for t in prompt]

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else None

    def _spec(self, speculative: str, num_draft_tokens, gate: str, tie_guard: TieGuard | None,
              proposer=None) -> SpeculationConfig:
        return SpeculationConfig(speculative, num_draft_tokens, gate, tie_guard=tie_guard or TieGuard(),
                                 proposer=proposer)

    def stream_ids(self, prompt: str | list[int], max_new_tokens: int = 64, *, stop_ids=None,
                   speculative: str = "none", num_draft_tokens: int | None = None, gate: str = "none",
                   tie_guard: TieGuard | None = None, proposer=None, generator: Generator | None = None,
                   stats: GenerationStats | None = None) -> Iterator[int]:
        """Yield token ids as they are committed. A fresh run unless ``generator`` is given
        (then the prompt continues after its committed prefix)."""
        ids = self.encode(prompt)
        stops = tuple(self.loaded.eos_token_ids if stop_ids is None else stop_ids)
        spec = self._spec(speculative, num_draft_tokens, gate, tie_guard, proposer)
        if generator is not None:
            return stream(generator, ids, max_new_tokens, stop_ids=stops, spec=spec, stats=stats)
        pooled = self._pool.take()
        try:
            pooled.rewind(0)
            tokens = stream(pooled, ids, max_new_tokens, stop_ids=stops, spec=spec, stats=stats)
        except BaseException:
            self._pool.give(pooled)  # a rejected request leaves the generator as it found it
            raise
        return self._returning(tokens, pooled)

    def _returning(self, tokens: Iterator[int], pooled: Generator) -> Iterator[int]:
        try:
            yield from tokens
        finally:
            self._pool.give(pooled)

    def stream(self, prompt: str | list[int], max_new_tokens: int = 64, **kwargs) -> Iterator[StreamPiece]:
        """Yield each committed token with the text it completes (UTF-8 safe)."""
        produced: list[int] = []
        shown = ""
        for token in self.stream_ids(prompt, max_new_tokens, **kwargs):
            produced.append(token)
            text = self.decode(produced) or ""
            if text.endswith("\ufffd"):  # a byte-level token split a character: wait for the rest
                yield StreamPiece(token, "")
                continue
            yield StreamPiece(token, text[len(shown):])
            shown = text

    def generate(self, prompt: str | list[int], max_new_tokens: int = 64, **kwargs) -> GenerationResult:
        stats = GenerationStats()
        tokens = list(self.stream_ids(prompt, max_new_tokens, stats=stats, **kwargs))
        return GenerationResult(tokens, self.decode(tokens), stats.finish_reason, stats)


def load(artifact_dir: str | os.PathLike, device: str = "cpu", *, threads: int | None = None,
         share_weights: bool = False, cuda_graphs: bool | str = True,
         kinds: tuple[str, ...] | None = None, trust_ops: bool = False) -> LoopcastModel:
    """Open an artifact. ``share_weights`` keeps one resident copy of the weights for all
    graph kinds at the cost of slower multi-row steps (see ort_runtime/artifact.py).
    On CUDA the fixed-width kinds of ``--batch-invariant`` artifacts run as captured CUDA graphs
    unless ``cuda_graphs=False`` (stock graphs run eagerly: see ort_runtime/artifact.py);
    ``kinds`` opens only those graph kinds (prefill is always needed to generate).
    ``trust_ops=True`` lets the artifact's custom-op library load even when it is not one you
    built (loading native code runs it: docs/trust.md)."""
    return LoopcastModel(open_artifact(artifact_dir, device, threads=threads, share_weights=share_weights,
                                       cuda_graphs=cuda_graphs, kinds=kinds, trust_ops=trust_ops))
