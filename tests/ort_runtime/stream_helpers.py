"""Run the engine the way the tests need: options as keywords, test hooks as injected parts.

Hooks are not generation options: a ``draft_hook`` becomes the pipeline's hooked drafter
(``ExitDrafts(hook)``), ``trace=True`` a traced ``PipelineCycles``; ``proposer``, ``costs`` and
``acceptor`` objects are handed to the engine as they are.
"""

from __future__ import annotations

from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.pipeline import ExitDrafts, PipelineCycles
from loopcast.ort_runtime.decoding.speculate import GenerationStats, stream


def engine_stream(gen, prompt, n, *, stop_ids=(), stats=None, **options):
    """``speculate.stream`` with keyword options (``mode`` or ``speculative``) and test hooks."""
    parts = {k: options.pop(k) for k in ("proposer", "costs", "acceptor") if k in options}
    hook, trace = options.pop("draft_hook", None), options.pop("trace", False)
    if "mode" in options:
        options["speculative"] = options.pop("mode")
    config = GenerationConfig.from_options(max_new_tokens=n, stop_ids=tuple(stop_ids), **options)
    if hook is not None:
        parts["proposer"] = ExitDrafts(hook)
    if trace:
        spec = config.speculation
        parts["verifier"] = PipelineCycles(
            spec.pipeline_exit, trace=True, device_lanes=spec.pipeline_device_lanes
        )
    return stream(gen, list(prompt), config, stats=stats, **parts)


def run_fresh(gen, prompt, n, *, stop_ids=(), **options) -> tuple[list[int], GenerationStats]:
    """A fresh generation on ``gen`` (rewound first); ``gen.n`` is left as the generation leaves it."""
    gen.rewind(0)
    stats = GenerationStats()
    return list(engine_stream(gen, prompt, n, stop_ids=stop_ids, stats=stats, **options)), stats
