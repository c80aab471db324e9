"""``loopcast serve``: the OpenAI-compatible HTTP API over the batching engine (docs/serving.md)."""

from loopcast.vocab import SpeculativeMode

# The speculative modes a request (or --speculative) may name. Which of them an engine runs is its
# ``speculative_modes``: the batching engine drafts by prompt lookup and by self-speculation
# (greedy requests; draft_batch/verify_tail_batch rounds, a cost gate per step and request); the
# pipeline needs a sequence's own cycle graphs, which the one-request-at-a-time engine runs
# (``--sequential``, or an artifact without batched graphs).
SERVED_MODES = (
    SpeculativeMode.NONE,
    SpeculativeMode.PROMPT_LOOKUP,
    SpeculativeMode.SELF,
    SpeculativeMode.PIPELINE,
)
