"""``loopcast generate`` on an artifact (the ORT backend): one GenerationConfig in, a JSON-able dict out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from loopcast.cli.options import PromptSource
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.text.stopping import trim_at_stop

from loopcast.errors import RequestError


def generate_with_ort(
    path: str,
    source: PromptSource,
    config: GenerationConfig,
    *,
    device: str = "cpu",
    threads: int | None = None,
    trust_ops: bool = False,
    draft_depth: int | None = None,
    on_text: Callable[[str], None] | None = None,
    kv_sharing: str | None = None,
) -> dict:
    """Run ``config`` on the artifact at ``path``; ``on_text`` gets the text as it is committed
    (the token ids, comma-terminated, when the artifact has no tokenizer). On a looped artifact
    ``draft_depth`` is a check, not an option (its draft graph's depth is fixed at export); on a
    recurrent-depth artifact it is the drafts' core steps (``draft_loops``), chosen per run."""
    model = load(path, device, threads=threads, trust_ops=trust_ops, kv_sharing=kv_sharing)
    if draft_depth is not None and model.config.recurrent_depth:
        # a recurrent-depth artifact drafts at any core-step count below --loops, chosen per run
        config = config.replace(draft_loops=draft_depth)
    elif draft_depth is not None and draft_depth != model.loaded.manifest.draft_depth:
        raise RequestError(
            f"--draft-depth {draft_depth}: this artifact's draft graph runs "
            f"{model.loaded.manifest.draft_depth} loops (re-export with --draft-depth {draft_depth})"
        )
    prompt = source.text if source.text is not None else source.ids
    if source.messages is not None:
        prompt = None
    if on_text is not None:
        from loopcast.ort_runtime.decoding.speculate import GenerationStats

        stats = GenerationStats()
        tokens = []
        pieces = model.stream(
            prompt,
            config=config,
            messages=source.messages,
            stats=stats,
            chat_template_kwargs=source.chat_template_kwargs,
        )
        for piece in pieces:
            if piece.token is not None:
                tokens.append(piece.token)
            on_text(piece.text if model.tokenizer is not None else f"{piece.token},")
        text = model.decode(tokens, config.skip_special_tokens)
        if config.stop and text is not None:
            text = trim_at_stop(text, config.stop)[0]
    else:
        result = model.generate(
            prompt, config=config, messages=source.messages, chat_template_kwargs=source.chat_template_kwargs
        )
        tokens, text, stats = result.tokens, result.text, result.stats
    return {
        "tokens": tokens,
        "text": text,
        "finish_reason": stats.finish_reason,
        "stats": {
            "backend": "ort",
            "device": device,
            **stats.as_dict(),
            "sampling": asdict(config.sampling) if config.sampling is not None else None,
        },
    }
