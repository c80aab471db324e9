"""The engine's parts as protocols, each with its capabilities declared in one small record.

    Proposer   offers draft tokens              propose(context, k) / advance(committed) / reset(gen)
    Verifier   runs a round's rows              max_drafts(gen), round_cost(costs, k), run_round(...)
    Acceptor   turns rows into tokens           first / decode / draft / accept / check
    Gate       decides per step                 engage(step) -> k | None, observe(...), report()
    Costs      prices a step                    decode(), mean(kind), host_factor(), draft_share

The engine (ort_runtime/decoding/speculate.py) reads what a part can do from its ``caps``,
never by probing attributes; the small base classes here give every part its defaults, so a
new proposer or strategy states only what differs. A verifier *declares its own round*
(``run_round``): verify-W, draft+verify_tail and tree verify share the draft round of the
engine; the pipeline runs its lanes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from loopcast.ort_runtime.binding.generator import Generator
    from loopcast.ort_runtime.decoding.greedy_accept import AcceptResult
    from loopcast.ort_runtime.decoding.proposers import Proposal


@dataclass(frozen=True)
class ProposerCaps:
    """What a proposer offers. ``drafts_hidden``: it drafts with the model's shallow loops and
    hands over the depth-d states (so the round verifies with draft+verify_tail);
    ``free_guess``: a one-token guess costs nothing (the gate may ask for evidence on plain
    steps); ``draws``: it draws its drafts with the generation's acceptor (sampled self-drafts)."""

    drafts_hidden: bool = False
    free_guess: bool = False
    draws: bool = False


@dataclass(frozen=True)
class VerifierCaps:
    """What a round strategy declares. ``writes_padding``: a round writes all of its graph's
    fixed rows (so it needs that many positions of KV room); ``alpha_decay``: how fast the cost
    gate forgets acceptance (rounds of one draft remember more); ``persistent_lanes``: lanes live
    across rounds, so a probe's hit must keep the probes coming (the pipeline)."""

    writes_padding: bool = True
    alpha_decay: float = 0.8
    persistent_lanes: bool = False


@runtime_checkable
class Proposer(Protocol):
    name: str
    caps: ProposerCaps

    def propose(self, context: Sequence[int], k: int) -> Proposal | list[int]: ...
    def advance(self, committed: Sequence[int]) -> None: ...
    def reset(self, generator: Generator) -> None: ...
    def bind(self, acceptor: Acceptor) -> None: ...


class ProposerBase:
    """Defaults: a token proposer that keeps no state."""

    name = "proposer"
    caps = ProposerCaps()

    def advance(self, committed: Sequence[int]) -> None:
        pass

    def reset(self, generator: Generator) -> None:
        pass

    def bind(self, acceptor: Acceptor) -> None:
        """The generation's acceptor, for proposers that draw their drafts (``caps.draws``)."""


class Costs(Protocol):
    draft_share: float

    def decode(self) -> float: ...
    def mean(self, kind: str) -> float | None: ...
    def rows_cost(self, kind: str, rows: int) -> float | None: ...
    def host_factor(self) -> float: ...
    def snapshot_ms(self) -> dict[str, float]: ...


class CostsBase:
    """Defaults for step costs given by hand (tests, what-if benches): no host overhead."""

    draft_share = 0.25

    def rows_cost(self, kind: str, rows: int) -> float | None:
        return None  # fixed-width kinds: a round costs the kind's mean whatever its rows

    def host_factor(self) -> float:
        return 1.0

    def snapshot_ms(self) -> dict[str, float]:
        return {}


class Acceptor(Protocol):
    sampled: bool

    def first(self, gen: Generator, ids: list[int]) -> int: ...
    def decode(self, gen: Generator, pending: int, context: Sequence[int]) -> int: ...
    def accept(self, context: Sequence[int], proposal: Proposal, verified: object) -> AcceptResult: ...


class Gate(Protocol):
    name: str
    transitions: int
    steps_off: int

    def engage(self, step: int) -> int | None: ...
    def observe(
        self,
        proposed: int,
        accepted: int,
        would_hit: bool | None = None,
        step: int = 0,
        evidence: int | None = None,
    ) -> None: ...
    def fit(self, drafts: int, evidence: int | None) -> int: ...
    def wants_evidence(self, step: int) -> bool: ...
    def plain_streak(self, step: int) -> int: ...
    def report(self) -> dict: ...
    def remember(self) -> None: ...


class Verifier(Protocol):
    name: str
    kinds: tuple[str, ...]
    caps: VerifierCaps

    def max_drafts(self, gen: Generator) -> int: ...
    def round_cost(self, costs: Costs, k: int) -> float: ...
    def token_rate(self, costs: Costs, alpha: float) -> float | None: ...
    def prepare(self, gen: Generator) -> None: ...
    def run_round(self, engine: RoundHost, pending: int, step: int, remaining: int) -> list[int]: ...
    def close(self) -> None: ...


class RoundHost(Protocol):
    """What a verifier's round may ask of the engine."""

    def draft_round(self, pending: int, step: int, remaining: int) -> list[int]: ...
    def lane_round(self, pending: int, step: int, remaining: int) -> list[int]: ...


class VerifierBase:
    """Defaults: a strategy that verifies a proposer's drafts in the engine's draft round."""

    name = "verify"
    kinds: tuple[str, ...] = ()
    caps = VerifierCaps()

    def prepare(self, gen: Generator) -> None:
        """Checks against the artifact before the generation starts (raise RequestError)."""

    def token_rate(self, costs: Costs, alpha: float) -> float | None:
        """Expected tokens per second at acceptance ``alpha``, for a strategy whose rounds are
        not priced by draft count (the pipeline's lanes); None: the gate prices ``round_cost``."""
        return None

    def run_round(self, engine: RoundHost, pending: int, step: int, remaining: int) -> list[int]:
        return engine.draft_round(pending, step, remaining)

    def close(self) -> None:
        """The generation ended: drop state that lives across rounds."""
