"""`loopcast generate` on an artifact (the default ORT backend)."""

from __future__ import annotations

from dataclasses import asdict

from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.text.stopping import trim_at_stop

from loopcast.errors import RequestError


def generate_with_ort(
    path: str,
    prompt: str | None,
    prompt_ids: list[int] | None,
    max_new_tokens: int,
    *,
    device: str = "cpu",
    speculative: str = "none",
    num_draft_tokens: int | None = None,
    draft_depth: int | None = None,
    gate: str = "auto",
    allow_inexact: bool = False,
    on_text=None,
    messages: list[dict] | None = None,
    stop: tuple[str, ...] = (),
    sampling: SamplingParams | None = None,
    skip_special_tokens: bool = False,
    trust_ops: bool = False,
    pipeline_exit: int = 1,
    alternate_gap: float | None = None,
) -> dict:
    model = load(path, device, trust_ops=trust_ops)
    if draft_depth is not None and draft_depth != model.loaded.manifest.draft_depth:
        raise RequestError(
            f"--draft-depth {draft_depth}: this artifact's draft graph runs "
            f"{model.loaded.manifest.draft_depth} loops (re-export with --draft-depth {draft_depth})"
        )
    source = prompt if prompt is not None else prompt_ids
    kwargs = dict(
        speculative=speculative,
        num_draft_tokens=num_draft_tokens,
        gate=gate,
        messages=messages,
        sampling=sampling,
        allow_inexact=allow_inexact,
        pipeline_exit=pipeline_exit,
        alternate_gap=alternate_gap,
    )
    if messages is not None:
        source = None
    text_kwargs = dict(stop=list(stop), skip_special_tokens=skip_special_tokens)
    if on_text is not None:
        from loopcast.ort_runtime.decoding.speculate import GenerationStats

        stats = GenerationStats()
        tokens = []
        for piece in model.stream(source, max_new_tokens, stats=stats, **text_kwargs, **kwargs):
            if piece.token is not None:
                tokens.append(piece.token)
            on_text(piece.text if model.tokenizer is not None else f"{piece.token},")
        text = model.decode(tokens, skip_special_tokens)
        if stop and text is not None:
            text = trim_at_stop(text, stop)[0]
    else:
        result = model.generate(source, max_new_tokens, **text_kwargs, **kwargs)
        tokens, text, stats = result.tokens, result.text, result.stats
    return {
        "tokens": tokens,
        "text": text,
        "finish_reason": stats.finish_reason,
        "stats": {
            "backend": "ort",
            "device": device,
            **stats.as_dict(),
            "sampling": asdict(sampling) if sampling is not None else None,
        },
    }
