"""Request-body extensions that are generation options, by the library's (and the CLI's) names.

Each field of :class:`GenerationFields` is a keyword option of ``GenerationConfig.replace``
(ort_runtime/decoding/generation_config.py): ``"num_draft_tokens": 3`` in a request is
``--num-draft-tokens 3`` of ``loopcast generate``. A field left out (or null) keeps the
server's default. The values are typed here and validated by GenerationConfig itself (a 400
naming the field); the engine then refuses, by name, an option it does not implement
(ort_runtime/batching/options.py). A new generation option reaches the HTTP API with one line here.
"""

from __future__ import annotations

from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from pydantic import BaseModel, Field


class GenerationFields(BaseModel):
    speculative: str | None = None  # "none" | "prompt-lookup" | "self" | "pipeline"; default: --speculative
    num_draft_tokens: int | None = Field(default=None, ge=1)  # drafts per round (verify width - 1 at most)
    min_ngram: int | None = Field(default=None, ge=1)  # prompt lookup's n-gram range
    max_ngram: int | None = Field(default=None, ge=1)
    # depth (docs/adaptive-depth.md; vllm-rlt's names for the gate's three): a static depth (a
    # looped model's loops, a recurrent model's r), or Ouro's exit gate with its clamps and KV
    # policy; a recurrent model's KL exit and initial state's seed. The one-request-at-a-time
    # engine runs them; the batching engine (every loop in its batched graphs) refuses them by name.
    loops: int | None = None  # GenerationConfig names the range (the family's)
    exit_threshold: float | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    kv_policy: str | None = None  # "full" | "last-exited"
    kl_threshold: float | None = Field(default=None, ge=0)
    state_seed: int | None = Field(default=None, ge=0)

    def generation_options(self) -> dict[str, object]:
        """The fields this request set, as GenerationConfig keyword options."""
        return {
            name: value
            for name in GenerationFields.model_fields
            if (value := getattr(self, name)) is not None
        }

    def generation_config(self, default_speculative: str) -> GenerationConfig:
        """The request's options over the defaults (``speculative``: the server's when unset)."""
        options = self.generation_options()
        options.setdefault("speculative", default_speculative)
        return GenerationConfig.from_options(**options)
