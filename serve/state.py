"""What a server replica holds: the loaded artifact, its batching engine, and text streaming.

``open_serving`` loads an artifact and starts one engine (ort_runtime/batching/engine.py): continuous
batching over the ``decode_batch`` graph when the artifact has one (``export --max-batch``),
else one request at a time. ``ServingState.stream`` submits token ids and yields text pieces
as the engine commits tokens, asyncio-side: the engine thread hands events to the event loop
with ``call_soon_threadsafe``. The text comes from a TextStreamer (ort_runtime/text/streamer.py,
as the Python API's): stop strings are matched on it and cancel the request, which frees its
slot at the next step boundary. Torch-free.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loopcast.ort_runtime.api import LoopcastModel, load
from loopcast.ort_runtime.batching.engine import DEFAULT_PREFILL_CHUNK, BatchingEngine, BatchRequest
from loopcast.ort_runtime.batching.sequential import SequentialEngine
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.text.streamer import TextStreamer
from loopcast.ort_runtime.text.utf8 import checked_text
from loopcast.serve import SERVED_MODES
from loopcast.serve.limits import DEFAULT_MAX_BODY_BYTES

from loopcast.errors import RequestError
from loopcast.vocab import SpeculativeMode, parse


@dataclass(frozen=True)
class ServeOptions:
    device: str = "cpu"
    max_batch: int | None = None  # None: the artifact's max_batch (1 sequence at a time without one)
    max_waiting: int = 256  # requests queued for a slot before 503s
    sequential: bool = False  # one request at a time even when batched graphs exist
    threads: int | None = None
    trust_ops: bool = False
    model_name: str | None = None  # default: the artifact directory's name
    speculative: SpeculativeMode = SpeculativeMode.NONE  # default per request, one of SERVED_MODES
    cuda_graphs: bool = False  # capture the batched kinds per width on CUDA (opt-in)
    prefix_caching: bool = True  # reuse common prompt prefixes' KV where exact (docs/serving.md)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # prompt tokens between two decode steps (0: whole)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get HTTP 413
    prefill_rows: int | None = None  # with cuda_graphs: captured prefill chunks of this many tokens
    kv_sharing: str | None = None  # recurrent-depth: the release's compress-s/r KV lookup (sequential)

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", served_mode(self.speculative))
        if self.model_name is not None:
            checked_text(self.model_name, "model_name")  # it is in every response
        if (
            isinstance(self.max_body_bytes, bool)
            or not isinstance(self.max_body_bytes, int)
            or self.max_body_bytes < 1
        ):
            raise RequestError(
                f"max_body_bytes must be a positive integer, got {self.max_body_bytes!r}",
                parameter="max_body_bytes",
            )


@dataclass
class TextPiece:
    text: str
    token: int | None


# An absolute POSIX path (or a Windows drive path) inside a message: at least two components.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])(?:/[\w.@+-]+){2,}/?|[A-Za-z]:\\[^\s'\"]+")


@dataclass
class TextResult:
    """How a request ended, filled in as it streams."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # OpenAI's: "stop" (EOS or a stop string) or "length"
    first_token_s: float | None = None
    speculative: object | None = None  # the engine's Completion: its speculation mode and counts


class ServingState:
    def __init__(
        self,
        model: LoopcastModel,
        engine,
        name: str,
        mode: str,
        speculative: SpeculativeMode | str = SpeculativeMode.NONE,
    ) -> None:
        self.model, self.engine, self.name, self.mode = model, engine, name, mode
        self.speculative = served_mode(speculative)
        self.created = int(time.time())
        self.max_length = model.loaded.manifest.max_length

    # -- prompts -------------------------------------------------------------------------
    def public(self, message: str) -> str:
        """``message`` as a client may see it: the artifact's location becomes the served model's
        name and any other absolute path on this machine becomes ``<path>`` (a client learns
        nothing about the server's file system from an error)."""
        artifact = self.model.loaded.path
        for where in sorted({str(artifact), str(Path(artifact).resolve())}, key=len, reverse=True):
            message = message.replace(where, f"model '{self.name}'")
        return _ABSOLUTE_PATH.sub("<path>", message)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.model.encode(prompt)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(prompt)

    def chat_ids(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
        return self.model.apply_chat_template(messages, chat_template_kwargs=chat_template_kwargs)

    def check_fits(self, ids: list[int], max_tokens: int) -> None:
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) >= self.max_length:
            raise RequestError(
                f"this model's maximum context length is {self.max_length} tokens; the prompt has "
                f"{len(ids)} (room is needed for at least one generated token)"
            )

    # -- generation ----------------------------------------------------------------------
    async def stream(
        self,
        ids: list[int],
        max_tokens: int,
        *,
        sampling: SamplingParams | None,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        ignore_eos: bool = False,
        speculative: SpeculativeMode | str | None = None,
        config: GenerationConfig | None = None,
        result: TextResult | None = None,
    ) -> AsyncIterator[TextPiece]:
        """Yield text pieces of the completion of ``ids``; ``result`` is filled in on the way.
        ``config``: the request's other generation options (serve/request_fields.py; its
        ``speculative`` unless ``speculative`` is given). Closing the iterator (a client that
        went away) cancels the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind: str, value) -> None:  # engine thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
            except RuntimeError:  # the loop is gone (server shutting down)
                pass

        streamer = TextStreamer(self.model.decode, stop, skip_special_tokens)
        result = result if result is not None else TextResult(len(ids))
        start = time.perf_counter()
        stop_ids = () if ignore_eos else tuple(self.model.eos_token_ids)
        if config is None:
            config = GenerationConfig(speculation=SpeculationConfig(self.speculative))
        mode = config.speculation.mode if speculative is None else served_mode(speculative)
        request = BatchRequest(ids, max_tokens, stop_ids, sampling, mode.value, config)
        completion = self.engine.submit(request, on_event)
        result.speculative = completion
        try:
            while True:
                kind, value = await events.get()
                if kind == "error":  # a request the one-sequence engine refused is the client's (400)
                    refused = f"{RequestError.__name__}: "
                    if str(value).startswith(refused):
                        raise RequestError(str(value)[len(refused) :])
                    raise RuntimeError(value)
                if kind == "done":
                    if value == "cancelled":  # only we cancel: a stop string already ended it
                        return
                    if rest := streamer.flush():
                        yield TextPiece(rest, None)
                    result.finish_reason = "stop" if value == "eos" else "length"
                    return
                result.tokens.append(value)
                if result.first_token_s is None:
                    result.first_token_s = time.perf_counter() - start
                delta, stopped = streamer.feed(value)
                if stopped:
                    completion.cancel()
                    result.finish_reason = "stop"
                    if delta:
                        yield TextPiece(delta, value)
                    return
                if delta:
                    yield TextPiece(delta, value)
        finally:
            completion.cancel()  # no-op once finished

    def health(self) -> dict:
        engine = self.engine
        return {
            "status": "ok",
            "model": self.name,
            "mode": self.mode,
            "pid": os.getpid(),
            "running": getattr(engine, "running", 0),
            "waiting": engine.waiting,
            "steps": engine.steps,
            "speculation": getattr(engine, "stats", None),
        }

    def capabilities(self) -> dict:
        """What the served artifact and engine support (``/v1/models``' ``loopcast`` field)."""
        manifest, engine = self.model.loaded.manifest, self.engine
        gen = getattr(engine, "gen", None)
        return {
            "engine": self.mode,
            "graph_kinds": sorted(str(k) for k in manifest.graphs),
            "speculative_modes": list(engine.speculative_modes),
            "default_speculative": self.speculative.value,
            "max_model_len": self.max_length,
            "max_batch": gen.max_batch if gen is not None else 1,
            "verify_width": getattr(gen, "verify_width", None) if gen is not None else None,
            "draft_depth": manifest.draft_depth,
            "num_loops": self.model.config.num_loops,
            "dtype": manifest.dtype,
            "op_set": str(manifest.op_set),
            "exact_verify": self.model.loaded.exact_verify,
            "prefix_caching": getattr(engine, "prefix_caching", "off (one request at a time)"),
            "self_speculation": getattr(engine, "self_speculation", "one request at a time"),
            "prefill_chunk": getattr(engine, "prefill_chunk", None),
        }

    def close(self, timeout: float = 30.0) -> None:
        self.engine.shutdown(timeout)


def served_mode(value: object) -> SpeculativeMode:
    """``value`` as one of the SERVED_MODES, or a RequestError that names ``speculative``
    (which of them an engine runs is the engine's ``speculative_modes``)."""
    mode = parse(SpeculativeMode, value, "speculative")
    if mode not in SERVED_MODES:
        raise RequestError(
            f"speculative must be one of {', '.join(SERVED_MODES)} when serving, got {value!r}",
            parameter="speculative",
        )
    return mode


def open_serving(artifact: str | Path, options: ServeOptions = ServeOptions()) -> ServingState:
    """Load ``artifact`` and start its engine (batched when it has the batched graphs)."""
    from loopcast.ort_runtime.binding.slots import has_batch_slots, open_batch_slots

    # threads that sleep between ops: spinning ones starve the engine's host work and the
    # server's own threads (ort_runtime/loading/thread_pool.py)
    model = load(
        artifact,
        options.device,
        threads=options.threads,
        spin=False,
        trust_ops=options.trust_ops,
        kv_sharing=options.kv_sharing,
    )
    name = options.model_name or Path(artifact).resolve().name
    batched = has_batch_slots(model.loaded)
    if batched and not options.sequential and options.kv_sharing is not None:
        raise RequestError(
            f"--kv-sharing {options.kv_sharing}: the batching engine keeps a KV slot per (step, layer); "
            "serve with --sequential (one request at a time) to share them"
        )
    if batched and not options.sequential:
        generator = open_batch_slots(
            model.loaded,
            options.max_batch,
            cuda_graphs=options.cuda_graphs,
            prefill_rows=options.prefill_rows,
        )
        engine = BatchingEngine(
            generator,
            max_waiting=options.max_waiting,
            prefix_caching=options.prefix_caching,
            prefill_chunk=options.prefill_chunk,
        )
        mode = f"batched (up to {generator.max_batch} sequences per step)"
    else:
        if options.max_batch not in (None, 1) and not options.sequential:
            raise RequestError(
                f"{artifact}: --max-batch {options.max_batch} needs the batched graphs; "
                "re-export with loopcast export --max-batch B"
            )
        engine = SequentialEngine(model, max_waiting=options.max_waiting)
        mode = "sequential (one request at a time)"
    if options.speculative.value not in engine.speculative_modes:
        raise RequestError(
            f"--speculative {options.speculative.value}: the {engine.kind} serves "
            f"{', '.join(engine.speculative_modes)}{engine.modes_note}",
            parameter="speculative",
        )
    return ServingState(model, engine.start(), name, mode, options.speculative)
