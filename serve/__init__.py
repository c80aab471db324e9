"""``loopcast serve``: the OpenAI-compatible HTTP API over the batching engine (docs/serving.md)."""

from loopcast.vocab import SpeculativeMode

# The speculative modes a server runs per request: the batching engine drafts by prompt lookup
# (greedy requests, a cost gate per step); the other modes need a sequence's own verify graphs.
SERVED_MODES = (SpeculativeMode.NONE, SpeculativeMode.PROMPT_LOOKUP)
