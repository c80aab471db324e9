"""`loopcast generate` on an artifact (the default ORT backend)."""

from __future__ import annotations

from loopcast.errors import RequestError
from loopcast.ort_runtime.api import load


def generate_with_ort(path: str, prompt: str | None, prompt_ids: list[int] | None, max_new_tokens: int, *,
                      device: str = "cpu", speculative: str = "none", num_draft_tokens: int | None = None,
                      draft_depth: int | None = None, gate: str = "none", on_text=None,
                      trust_ops: bool = False) -> dict:
    model = load(path, device, trust_ops=trust_ops)
    if draft_depth is not None and draft_depth != model.loaded.manifest.draft_depth:
        raise RequestError(f"--draft-depth {draft_depth}: this artifact's draft graph runs "
                           f"{model.loaded.manifest.draft_depth} loops (re-export with --draft-depth {draft_depth})")
    source = prompt if prompt is not None else prompt_ids
    kwargs = dict(speculative=speculative, num_draft_tokens=num_draft_tokens, gate=gate)
    if on_text is not None:
        from loopcast.ort_runtime.decoding import GenerationStats
        stats = GenerationStats()
        tokens = []
        for piece in model.stream(source, max_new_tokens, stats=stats, **kwargs):
            tokens.append(piece.token)
            on_text(piece.text if model.tokenizer is not None else f"{piece.token},")
        text = model.decode(tokens)
    else:
        result = model.generate(source, max_new_tokens, **kwargs)
        tokens, text, stats = result.tokens, result.text, result.stats
    return {"tokens": tokens, "text": text, "finish_reason": stats.finish_reason,
            "stats": {"backend": "ort", "device": device, **stats.as_dict()}}
