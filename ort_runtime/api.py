"""Python API: load an artifact once, then generate or stream from text or token ids.

    from loopcast.ort_runtime import load
    model = load("artifacts/demo")
    result = model.generate("def main():", max_new_tokens=64, speculative="prompt-lookup")
    for piece in model.stream("def main():", max_new_tokens=64):
        print(piece.text, end="")
    chat = model.generate(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=64,
                          sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=0),
                          stop=["\n\n"], skip_special_tokens=True)

``messages`` goes through the artifact's chat template (ort_runtime/text/chat.py) with the generation
prompt added; ``sampling`` (ort_runtime/decoding/sampling.py) draws tokens instead of taking the argmax
(None or temperature 0: greedy, byte-identical to before); ``stop`` strings end the output on
the decoded text, which is cut before them (finish reason "stop", ort_runtime/text/stopping.py);
``skip_special_tokens`` drops special tokens from the text (the token ids are unchanged).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator as TokenStream
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
from loopcast.ort_runtime.decoding.families import SequenceGenerator, decoding_for
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.stats import GenerationStats
from loopcast.ort_runtime.loading.artifact import LoadedModel, open_artifact
from loopcast.ort_runtime.text.chat import ChatTemplate, load_chat_template, template_kwargs
from loopcast.ort_runtime.text.stopping import artifact_eos_ids, trim_at_stop
from loopcast.ort_runtime.text.streamer import TextStreamer
from loopcast.ort_runtime.text.utf8 import checked_text

from loopcast.errors import ConfigError, RequestError
from loopcast.kv_sharing import parse_sharing
from loopcast.vocab import GraphKind, SpeculativeMode

TokenIds = TokenStream[int, None, None]  # a token stream: close() it to end the generation early


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]
    text: str | None
    finish_reason: str
    stats: GenerationStats


@dataclass(frozen=True)
class StreamPiece:
    token: int | None  # None only for a last piece that releases text held back for stop strings
    text: str  # newly decodable text ("" while a multi-byte character is incomplete or
    # while the text could be the start of a stop string)


class _GeneratorPool:
    """Idle generators for the convenience methods. A call checks one out (making a new one when
    none is idle) and gives it back when its stream ends, fails or is closed, so no two calls
    ever share KV buffers or IO bindings. At most ``keep`` idle ones are kept: a generator owns
    KV buffers of the full max length, so a burst of threads must not pin them all forever."""

    def __init__(self, factory, keep: int = 2) -> None:
        self._factory, self._keep = factory, keep
        self._idle: list[SequenceGenerator] = []
        self._lock = threading.Lock()

    def take(self) -> SequenceGenerator:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._factory()  # outside the lock: allocating KV buffers can take a while

    def give(self, generator: SequenceGenerator) -> None:
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

    def __init__(self, loaded: LoadedModel, *, kv_sharing: str | None = None) -> None:
        """``kv_sharing``: every generator's KV lookup on a recurrent-depth artifact (the
        release's ``compress-s<c>``/``compress-r<c>``: c core slots in all, plain decoding only;
        loopcast/kv_sharing.py); None: a slot per (step, layer)."""
        self.loaded = loaded
        # the family's decoding, chosen once: looped (Ouro, Llama) or recurrent depth (Huginn)
        self.decoding = decoding_for(loaded)
        if kv_sharing is not None:
            if not loaded.config.recurrent_depth:
                self.decoding.new_generator(loaded, kv_sharing)  # the family's refusal, by name
            try:
                parse_sharing(kv_sharing)
            except ConfigError as exc:
                raise RequestError(str(exc), parameter="kv_sharing") from None
        self.kv_sharing = kv_sharing
        self._pool = _GeneratorPool(self.new_generator)
        self._eos: tuple[int, ...] | None = None
        self._chat: tuple[ChatTemplate | None] | None = None

    @property
    def config(self):
        return self.loaded.config

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    def new_generator(self) -> SequenceGenerator:
        return self.decoding.new_generator(self.loaded, self.kv_sharing)

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt``: text through the tokenizer, or ids checked as ids (integers in
        the vocabulary; floats, bools, bytes and strings are refused, never converted)."""
        if isinstance(prompt, str):
            checked_text(prompt, "prompt")
            if self.tokenizer is None:
                raise RequestError(f"{self.loaded.path}: no tokenizer.json; pass token ids")
            return self.tokenizer.encode(prompt).ids
        return _token_ids(prompt, self.config.vocab_size)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str | None:
        return (
            self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            if self.tokenizer is not None
            else None
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id of the artifact: the manifest's and generation_config.json's."""
        if self._eos is None:
            self._eos = artifact_eos_ids(self.loaded.path, self.loaded.eos_token_ids, self.config.vocab_size)
        return self._eos

    @property
    def chat_template(self) -> ChatTemplate | None:
        if self._chat is None:
            self._chat = (load_chat_template(self.loaded.path),)
        return self._chat[0]

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` rendered by the artifact's chat template (as transformers'
        ``apply_chat_template(messages, add_generation_prompt=True, **chat_template_kwargs)``:
        ``chat_template_kwargs`` are extra template variables, e.g. ``{"enable_thinking": False}``)."""
        variables = template_kwargs(chat_template_kwargs)
        template = self.chat_template
        if template is None:
            raise RequestError(
                f"{self.loaded.path}: no chat template (tokenizer_config.json has no "
                "chat_template and there is no chat_template.jinja); pass a plain prompt"
            )
        if self.tokenizer is None:
            raise RequestError(f"{self.loaded.path}: no tokenizer.json; a chat prompt needs the tokenizer")
        text = checked_text(
            template.render(messages, add_generation_prompt=add_generation_prompt, **variables), "messages"
        )
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _prompt_ids(self, prompt, messages, chat_template_kwargs=None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of a prompt and messages")
        if messages is None:
            if chat_template_kwargs:
                raise RequestError(
                    "chat_template_kwargs goes with messages", parameter="chat_template_kwargs"
                )
            return self.encode(prompt)
        return self.apply_chat_template(messages, chat_template_kwargs=chat_template_kwargs)

    def stream_ids(
        self,
        prompt: str | list[int] | None = None,
        max_new_tokens: int | None = None,
        *,
        config: GenerationConfig | None = None,
        messages: Sequence[dict] | None = None,
        generator: SequenceGenerator | None = None,
        stats: GenerationStats | None = None,
        proposer: object | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        **options: object,
    ) -> TokenIds:
        """Yield token ids as they are committed. A fresh run unless ``generator`` is given
        (then the prompt continues after its committed prefix; otherwise a pooled generator
        serves the call, so concurrent calls never share one).

        Options come as one ``config`` (:class:`GenerationConfig`) or as keywords, each a field
        of it or of its ``SpeculationConfig`` (keywords override the config's fields):
        ``sampling``, ``stop_ids`` (default: the artifact's EOS ids), ``speculative``: "none",
        "prompt-lookup", "self", "pipeline" (lanes at every depth share one pass over the core
        layers; ``pipeline_exit`` is the loop whose head drafts; greedy lanes run K cycles per
        call with their schedule on the device where the artifact has the cycle_run graph, one
        cycle per call with ``pipeline_device_lanes=False``), or a ``proposer`` of your own
        (``ort_runtime/decoding/proposers.py``); ``alternate_gap`` (with "self", on artifacts
        exported with ``--tree-verify``): also verify one alternate suffix from the runner-up
        token where the draft's top-1/top-2 probability gap is below it; ``gate``: "auto"
        (calibrated on this device), "cost", "hit-density" or "always". Speculation is refused
        on an artifact whose verify rows are not bit-identical to its decode rows on this device
        unless ``allow_inexact=True``. ``chat_template_kwargs`` (with ``messages``): extra variables
        for the chat template, e.g. ``{"enable_thinking": False}`` for the Thinking variants."""
        config = self.generation_config(config, max_new_tokens, **options)
        ids = self._prompt_ids(prompt, messages, chat_template_kwargs)
        config = self._default_depth(config)
        if config.stop_ids is None:
            config = config.replace(stop_ids=self.eos_token_ids)

        def run(gen: SequenceGenerator) -> TokenIds:
            return self.decoding.stream(gen, ids, config, stats=stats, proposer=proposer)

        if generator is not None:
            return run(self._own(generator))
        pooled = self._pool.take()
        try:
            pooled.rewind(0)
            tokens = run(pooled)
        except BaseException:
            self._pool.give(pooled)  # a rejected request leaves the generator as it found it
            raise
        return self._returning(tokens, pooled)

    def _default_depth(self, config: GenerationConfig) -> GenerationConfig:
        """The checkpoint's ``early_exit_threshold`` (below 1.0) as the exit gate's threshold of a
        plain greedy request that names no depth (docs/adaptive-depth.md); speculative and sampled
        requests run every loop unless they ask for a depth."""
        q = self.config.early_exit_threshold
        if (
            q is None
            or q >= 1.0
            or config.loops is not None
            or config.gated
            or config.sampled
            or config.speculation.mode != SpeculativeMode.NONE
            or not self.loaded.has(GraphKind.LOOP_STEP)
        ):
            return config
        return config.replace(exit_threshold=q)

    @staticmethod
    def generation_config(
        config: GenerationConfig | None, max_new_tokens: int | None = None, **options: object
    ) -> GenerationConfig:
        """The config a call runs with: ``config`` (or the defaults) with the keyword options."""
        if max_new_tokens is not None:
            options["max_new_tokens"] = max_new_tokens
        if "stop" in options and options["stop"] is None:
            options["stop"] = ()
        return GenerationConfig.from_options(config, **options)

    def _own(self, generator: object) -> SequenceGenerator:
        """``generator`` if it is one of this model's (its KV buffers and sessions are this
        model's), else a RequestError: a generator of another loaded model would run that one."""
        kind = self.decoding.generator_type
        if not isinstance(generator, kind):
            raise RequestError(
                f"generator must be a {kind.__name__} (model.new_generator()), "
                f"got {type(generator).__name__}",
                parameter="generator",
            )
        owned = cast(SequenceGenerator, generator)  # the family's generator type, checked above
        if owned.model is not self.loaded:
            raise RequestError(
                f"generator belongs to another loaded model ({owned.model.path}); make one with "
                "this model's new_generator()",
                parameter="generator",
            )
        return owned

    def _returning(self, tokens: TokenIds, pooled: SequenceGenerator) -> TokenIds:
        try:
            yield from tokens
        finally:
            self._pool.give(pooled)

    def stream(
        self,
        prompt: str | list[int] | None = None,
        max_new_tokens: int | None = None,
        *,
        config: GenerationConfig | None = None,
        messages: Sequence[dict] | None = None,
        generator: SequenceGenerator | None = None,
        proposer: object | None = None,
        stats: GenerationStats | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        **options: object,
    ) -> TokenStream[StreamPiece, None, None]:
        """Yield each committed token with the text it completes (UTF-8 safe). With ``stop``
        strings, text that could start one is held back until the next tokens decide, and the
        stream ends at a match (the text cut before it, finish reason "stop")."""
        config = self.generation_config(config, max_new_tokens, **options)
        if config.stop and self.tokenizer is None:
            raise RequestError(f"{self.loaded.path}: stop strings need the tokenizer (tokenizer.json)")
        stats = stats or GenerationStats()
        start = time.perf_counter()
        streamer = TextStreamer(self.decode, config.stop, config.skip_special_tokens)
        tokens = self.stream_ids(
            prompt,
            config=config,
            stats=stats,
            messages=messages,
            generator=generator,
            proposer=proposer,
            chat_template_kwargs=chat_template_kwargs,
        )
        try:
            for token in tokens:
                delta, stopped = streamer.feed(token)
                if stopped:
                    # Closing the token stream rewinds the generator to the yielded tokens.
                    tokens.close()
                    _finish_on_stop(stats, start)
                    yield StreamPiece(token, delta)
                    return
                yield StreamPiece(token, delta)
            if rest := streamer.flush():
                yield StreamPiece(None, rest)
        finally:
            tokens.close()

    def generate(
        self,
        prompt: str | list[int] | None = None,
        max_new_tokens: int | None = None,
        *,
        config: GenerationConfig | None = None,
        messages: Sequence[dict] | None = None,
        generator: SequenceGenerator | None = None,
        proposer: object | None = None,
        stats: GenerationStats | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        **options: object,
    ) -> GenerationResult:
        """The whole generation at once: tokens, text, finish reason and stats. Takes what
        :meth:`stream_ids` takes (one ``config`` or keywords), and ``stop`` strings and
        ``skip_special_tokens`` for the text."""
        config = self.generation_config(config, max_new_tokens, **options)
        stats = stats or GenerationStats()
        if config.stop:
            tokens = [
                p.token
                for p in self.stream(
                    prompt,
                    config=config,
                    stats=stats,
                    messages=messages,
                    generator=generator,
                    proposer=proposer,
                    chat_template_kwargs=chat_template_kwargs,
                )
                if p.token is not None
            ]
            text, _ = trim_at_stop(self.decode(tokens, config.skip_special_tokens) or "", list(config.stop))
            return GenerationResult(tokens, text, stats.finish_reason, stats)
        tokens = list(
            self.stream_ids(
                prompt,
                config=config,
                stats=stats,
                messages=messages,
                generator=generator,
                proposer=proposer,
                chat_template_kwargs=chat_template_kwargs,
            )
        )
        decoded = self.decode(tokens, config.skip_special_tokens)
        return GenerationResult(tokens, decoded, stats.finish_reason, stats)


def _token_ids(prompt: object, vocab: int) -> list[int]:
    if isinstance(prompt, (bytes, bytearray, memoryview)) or not isinstance(prompt, (Sequence, np.ndarray)):
        raise RequestError(
            f"prompt must be text or a sequence of token ids, got {type(prompt).__name__}", parameter="prompt"
        )
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise RequestError(
                f"prompt token ids must be a 1-D integer array, got {prompt.dtype} {prompt.shape}",
                parameter="prompt",
            )
        prompt = prompt.tolist()
    ids: Sequence = prompt  # type: ignore[assignment]  # a Sequence or an array's list, checked above
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise RequestError(f"prompt token ids must be integers, got {t!r:.40}", parameter="prompt")
        if not 0 <= t < vocab:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab})", parameter="prompt")
    return [int(t) for t in ids]


def _finish_on_stop(stats: GenerationStats, start: float) -> None:
    """Stats of a run that a stop string ended (the decoding loop never saw its end)."""
    stats.finish_reason = "stop"
    stats.seconds = time.perf_counter() - start
    stats.tokens_per_second = stats.new_tokens / stats.seconds if stats.seconds > 0 else 0.0
    stats.tokens_per_round = (stats.accepted + stats.rounds) / stats.rounds if stats.rounds else 0.0


def load(
    artifact_dir: str | os.PathLike,
    device: str = "cpu",
    *,
    threads: int | None = None,
    spin: bool | None = None,
    share_weights: bool = False,
    cuda_graphs: bool | str = True,
    kinds: tuple[str, ...] | None = None,
    trust_ops: bool = False,
    kv_sharing: str | None = None,
) -> LoopcastModel:
    """Open an artifact. ``share_weights`` keeps one resident copy of the weights for all
    graph kinds at the cost of slower multi-row steps (see ort_runtime/loading/artifact.py).
    On CUDA the fixed-width kinds of ``--batch-invariant`` artifacts run as captured CUDA graphs
    unless ``cuda_graphs=False`` (stock graphs run eagerly: see ort_runtime/loading/artifact.py);
    ``kinds`` opens only those graph kinds (prefill is always needed to generate).
    ``trust_ops=True`` lets the artifact's custom-op library load even when it is not one you
    built (loading native code runs it: docs/trust.md). ``spin``: whether the CPU sessions'
    intra-op threads spin between ops (default yes: faster for one sequence; the server and
    the batching engine's callers pass False; ort_runtime/loading/thread_pool.py).
    ``kv_sharing`` (recurrent-depth artifacts): the release's ``compress-s<c>`` or
    ``compress-r<c>`` KV lookup for every generator (c core slots shared by all steps and
    layers; plain decoding only); None: a slot per (step, layer)."""
    return LoopcastModel(
        open_artifact(
            artifact_dir,
            device,
            threads=threads,
            spin=spin,
            share_weights=share_weights,
            cuda_graphs=cuda_graphs,
            kinds=kinds,
            trust_ops=trust_ops,
        ),
        kv_sharing=kv_sharing,
    )
