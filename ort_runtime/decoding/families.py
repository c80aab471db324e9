"""How an artifact's family decodes, chosen once when the model is loaded.

    LoopedDecoding     Ouro, Llama-family: one stack R times per graph (Generator, speculate.stream)
    RecurrentDecoding  Huginn/Raven: prelude → r core_step calls → coda composed by the host
                       (RecurrentGenerator, recurrent_stream.stream_recurrent), and the pipeline
                       on recurrent_cycle (recurrent_pipeline.RecurrentPipeline)

The API (ort_runtime/api.py) and the server's one-request engine hold one ``Decoding`` and call
it; nothing downstream asks a generator what it can do. Both take the same GenerationConfig,
so ``loops`` is Ouro's static depth and Huginn's r alike; each refuses, by name, the options
of the other family.
"""

from __future__ import annotations

from collections.abc import Generator as TokenStream
from typing import Protocol

from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.recurrent_stream import stream_recurrent
from loopcast.ort_runtime.decoding.speculate import stream
from loopcast.ort_runtime.decoding.stats import GenerationStats
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE, DRAFT, VERIFY, VERIFY_TAIL
from loopcast.vocab import GraphKind, SpeculativeMode

SequenceGenerator = Generator | RecurrentGenerator
RECURRENT_CYCLE = GraphKind.RECURRENT_CYCLE


class Decoding(Protocol):
    family: str
    generator_type: type

    def new_generator(self, loaded: LoadedModel, kv_sharing: str | None = None) -> SequenceGenerator: ...
    def speculative_modes(self, loaded: LoadedModel) -> tuple[str, ...]: ...
    def stream(
        self,
        gen: SequenceGenerator,
        ids: list[int],
        config: GenerationConfig,
        *,
        stats: GenerationStats | None,
        proposer: object | None,
    ) -> TokenStream[int, None, None]: ...


class LoopedDecoding:
    family = "looped"
    generator_type = Generator

    def new_generator(self, loaded: LoadedModel, kv_sharing: str | None = None) -> Generator:
        if kv_sharing is not None:
            raise RequestError(
                f"kv_sharing {kv_sharing!r}: sharing KV slots across core steps is the recurrent-depth "
                "(Huginn) family's; a looped artifact keeps a slot per loop and layer"
            )
        return Generator(loaded)

    def speculative_modes(self, loaded: LoadedModel) -> tuple[str, ...]:
        """none, and each mode whose graph kinds the artifact has."""
        needs = {
            SpeculativeMode.PROMPT_LOOKUP.value: (VERIFY,),
            SpeculativeMode.SELF.value: (DRAFT, VERIFY_TAIL),
            SpeculativeMode.PIPELINE.value: (CYCLE,),
        }
        graphs = loaded.manifest.graphs
        return ("none",) + tuple(mode for mode, kinds in needs.items() if all(k in graphs for k in kinds))

    def stream(self, gen, ids, config, *, stats=None, proposer=None) -> TokenStream[int, None, None]:
        for name in ("kl_threshold", "state_seed"):
            if getattr(config, name) is not None:
                raise RequestError(
                    f"{name} is a recurrent-depth (Huginn) option; this artifact is "
                    f"{gen.model.config.model_type} (its depth options: loops, exit_threshold)",
                    parameter=name,
                )
        if config.speculation.draft_loops is not None:
            raise RequestError(
                "draft_loops is the recurrent-depth drafts' core steps; a looped artifact's draft "
                "depth is fixed at export (--draft-depth)",
                parameter="draft_loops",
            )
        return stream(gen, ids, config, stats=stats, proposer=proposer)


class RecurrentDecoding:
    family = "recurrent-depth"
    generator_type = RecurrentGenerator

    def new_generator(self, loaded: LoadedModel, kv_sharing: str | None = None) -> RecurrentGenerator:
        """``kv_sharing``: the release's compress-s/r lookup (loopcast/kv_sharing.py; plain decoding)."""
        return RecurrentGenerator(loaded, kv_sharing=kv_sharing)

    def speculative_modes(self, loaded: LoadedModel) -> tuple[str, ...]:
        """Drafts verified through the core-step graphs, and the pipeline where the artifact has
        its recurrent_cycle graph."""
        modes = ("none", SpeculativeMode.PROMPT_LOOKUP.value, SpeculativeMode.SELF.value)
        if RECURRENT_CYCLE in loaded.manifest.graphs:
            modes += (SpeculativeMode.PIPELINE.value,)
        return modes

    def stream(self, gen, ids, config, *, stats=None, proposer=None) -> TokenStream[int, None, None]:
        return stream_recurrent(gen, ids, config, stats=stats, proposer=proposer)


def decoding_for(loaded: LoadedModel) -> Decoding:
    """The family's decoding, from the manifest's model config (declared, never sniffed)."""
    return RecurrentDecoding() if loaded.config.recurrent_depth else LoopedDecoding()
