"""Python API: load an artifact once, then generate or stream from text or token ids.

    from loopcast.ort_runtime import load
    model = load("artifacts/demo")
    result = model.generate("def main():", max_new_tokens=64, speculative="prompt-lookup")
    for piece in model.stream("def main():", max_new_tokens=64):
        print(piece.text, end="")
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from loopcast.errors import RequestError
from loopcast.ort_runtime.artifact import LoadedModel, open_artifact
from loopcast.ort_runtime.accept import TieGuard
from loopcast.ort_runtime.generator import Generator
from loopcast.ort_runtime.speculate import GenerationStats, SpeculationConfig, stream


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


class LoopcastModel:
    """A loaded artifact plus a default generator; make more with :meth:`new_generator`."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self._default: Generator | None = None

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

    def stream_ids(self, prompt: str | list[int], max_new_tokens: int = 64, *, stop_ids=None,
                   speculative: str = "none", num_draft_tokens: int | None = None, gate: str = "auto",
                   tie_guard: TieGuard | None = None, proposer=None, allow_inexact: bool = False,
                   generator: Generator | None = None, stats: GenerationStats | None = None) -> Iterator[int]:
        """Yield token ids as they are committed. A fresh run unless ``generator`` is given
        (then the prompt continues after its committed prefix).

        ``speculative``: "none", "prompt-lookup", "self", or a ``proposer`` of your own
        (``ort_runtime/proposers.py``); ``gate``: "auto" (calibrated on this device), "cost",
        "hit-density" or "none" (always speculate). Speculation is refused on an artifact whose
        verify rows are not bit-identical to its decode rows on this device unless
        ``allow_inexact=True``."""
        ids = self.encode(prompt)
        if generator is None:
            if self._default is None:
                self._default = self.new_generator()
            generator = self._default
            generator.rewind(0)
        stops = tuple(self.loaded.eos_token_ids if stop_ids is None else stop_ids)
        spec = SpeculationConfig(speculative, num_draft_tokens, gate, tie_guard=tie_guard or TieGuard(),
                                 proposer=proposer, allow_inexact=allow_inexact)
        return stream(generator, ids, max_new_tokens, stop_ids=stops, spec=spec, stats=stats)

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
         kinds: tuple[str, ...] | None = None) -> LoopcastModel:
    """Open an artifact. ``share_weights`` keeps one resident copy of the weights for all
    graph kinds at the cost of slower multi-row steps (see ort_runtime/artifact.py).
    On CUDA the fixed-width kinds of ``--batch-invariant`` artifacts run as captured CUDA graphs
    unless ``cuda_graphs=False`` (stock graphs run eagerly: see ort_runtime/artifact.py);
    ``kinds`` opens only those graph kinds (prefill is always needed to generate)."""
    return LoopcastModel(open_artifact(artifact_dir, device, threads=threads, share_weights=share_weights,
                                       cuda_graphs=cuda_graphs, kinds=kinds))
