"""One generation's stats record: what it produced, how it speculated and what its gate did."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    speculative: str = "none"
    strategy: str = "decode"
    gate: str = "none"
    gate_report: dict = field(default_factory=dict)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens_per_round: float = 0.0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    near_tie_rejections: int = 0
    tolerant_accepts: int = 0
    exact_verify: bool = True  # the artifact's verify rows are decode rows on this device
    exact_greedy: bool = True  # the tokens are plain greedy's by construction
    gate_transitions: int = 0
    cycles: int = 0  # pipeline cycles (one pass over the core layers each)
    discarded_lanes: int = 0
    core_calls_per_token: float = 0.0  # passes over the core layers per new token (plain: R)
    core_passes: int = 0  # passes over the core layers in all (prefill excluded)
    pipeline_trace: list | None = None  # PipelineCycles(trace=True): each cycle's rows (tests)
    forks: int = 0  # alternate suffix: rounds verified with a branch
    fork_skips: int = 0  # near ties whose branch did not fit (width or KV capacity)
    alternate_selected: int = 0  # rounds the branch won
    alternate_discarded: int = 0  # rounds the primary chain passed the fork (or broke before it)
    fork_misses: int = 0  # rounds whose fork had neither branch's token right
    alternate_tokens: int = 0  # tokens gained: branch tokens committed past the primary's
    # adaptive depth (docs/adaptive-depth.md): loops each new token was read at -> tokens, the
    # mean, and the gate's KV policy ("" without the gate)
    exit_histogram: dict[int, int] = field(default_factory=dict)
    mean_loops: float = 0.0
    kv_policy: str = ""
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = asdict(self)
        if out["pipeline_trace"] is None:
            del out["pipeline_trace"]
        out["step_seconds"] = {k: round(v, 6) for k, v in out["step_seconds"].items()}
        return out
