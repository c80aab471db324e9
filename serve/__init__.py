"""``loopcast serve``: the OpenAI-compatible HTTP API over the batching engine (docs/serving.md)."""

from loopcast.vocab import SpeculativeMode

# The speculative modes a request (or --speculative) may name. Which of them an engine runs is its
# ``speculative_modes``: the batching engine drafts by prompt lookup (greedy requests, a cost gate
# per step); self and pipeline need a sequence's own draft/verify_tail or cycle graphs, which the
# one-request-at-a-time engine runs (``--sequential``, or an artifact without batched graphs).
SERVED_MODES = (
    SpeculativeMode.NONE,
    SpeculativeMode.PROMPT_LOOKUP,
    SpeculativeMode.SELF,
    SpeculativeMode.PIPELINE,
)
