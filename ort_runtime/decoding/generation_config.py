"""What a caller asks of one generation, as one object: limits, stops, sampling, speculation.

The CLI builds a :class:`GenerationConfig` from its flags, the Python API from its keyword
arguments (``model.generate(prompt, max_new_tokens=64, speculative="self")`` is
``model.generate(prompt, config=GenerationConfig(64, speculation=SpeculationConfig("self")))``),
and the engine reads it. Validation happens here, once, with messages that name the parameter;
the CLI maps parameter names to its flags (``num_draft_tokens`` is ``--num-draft-tokens``).
Test hooks are not options: tests inject proposer, verifier or acceptor objects into the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from loopcast.ort_runtime.decoding.greedy_accept import TieGuard
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.text.utf8 import checked_text

from loopcast.errors import RequestError
from loopcast.vocab import GateKind, KVPolicy, SpeculativeMode, parse


@dataclass(frozen=True)
class SpeculationConfig:
    """How a generation speculates. Every mode returns plain decoding's tokens."""

    mode: SpeculativeMode = SpeculativeMode.NONE
    num_draft_tokens: int | None = None  # K drafts per round; default: the verify width - 1
    gate: GateKind = GateKind.AUTO
    min_ngram: int = 1  # prompt lookup's n-gram range
    max_ngram: int = 6  # longer matches first: the continuation of a long one is right more often
    tie_guard: TieGuard = field(default_factory=TieGuard)
    allow_inexact: bool = False  # speculate even where verify rows are not decode rows bit for bit
    pipeline_exit: int = 1  # pipeline: the loop whose head drafts the next lane's token
    pipeline_device_lanes: bool = True  # pipeline: greedy lanes scheduled on the device (cycle_run)
    alternate_gap: float | None = None  # self: fork an alternate suffix below this top-1/top-2 gap
    # self on a recurrent-depth (Huginn) artifact: the drafts' core steps (< loops; None: a
    # quarter of loops). Looped artifacts fix their draft depth at export.
    draft_loops: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse(SpeculativeMode, self.mode, "speculative"))
        object.__setattr__(self, "gate", parse(GateKind, self.gate, "gate"))
        for name in ("min_ngram", "max_ngram", "pipeline_exit"):
            _integer(getattr(self, name), name)
        for name in ("allow_inexact", "pipeline_device_lanes"):
            _flag(getattr(self, name), name)
        if self.num_draft_tokens is not None:
            _integer(self.num_draft_tokens, "num_draft_tokens")
        if self.draft_loops is not None:
            _integer(self.draft_loops, "draft_loops")
            if self.draft_loops < 1:
                raise RequestError(
                    f"draft_loops must be >= 1, got {self.draft_loops}", parameter="draft_loops"
                )
        if self.alternate_gap is not None and (
            isinstance(self.alternate_gap, bool) or not isinstance(self.alternate_gap, (int, float))
        ):
            raise RequestError(
                f"alternate_gap must be a number in (0, 1], got {self.alternate_gap!r}",
                parameter="alternate_gap",
            )
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise RequestError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise RequestError(
                f"min_ngram and max_ngram must satisfy 1 <= min_ngram <= max_ngram, "
                f"got {self.min_ngram} and {self.max_ngram}"
            )
        if self.pipeline_exit < 1:
            raise RequestError(f"pipeline_exit must be >= 1, got {self.pipeline_exit}")
        if self.alternate_gap is not None and not (
            math.isfinite(self.alternate_gap) and 0.0 < self.alternate_gap <= 1.0
        ):
            raise RequestError(f"alternate_gap must be in (0, 1], got {self.alternate_gap}")
        if not isinstance(self.tie_guard, TieGuard):
            raise RequestError(
                f"tie_guard must be a TieGuard, got {type(self.tie_guard).__name__}", parameter="tie_guard"
            )


@dataclass(frozen=True)
class GenerationConfig:
    """One generation's options (transformers' GenerationConfig, for this engine)."""

    max_new_tokens: int = 64
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    stop_ids: tuple[int, ...] | None = None  # None: the artifact's EOS ids
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded text
    skip_special_tokens: bool = False
    # Adaptive depth (docs/adaptive-depth.md). ``loops``: static depth, k loop applications per
    # token (Ouro's 0-based ``exit_at_step`` = k-1); None: every loop (R), or the gate below.
    loops: int | None = None
    # Ouro's exit gate: exit at the first loop whose cumulative exit probability reaches
    # ``exit_threshold`` (None: no gate), clamped to min_loops..max_loops; ``kv_policy`` says
    # what the skipped loops leave in the KV.
    exit_threshold: float | None = None
    min_loops: int | None = None
    max_loops: int | None = None
    kv_policy: KVPolicy = KVPolicy.FULL
    # Recurrent depth (Huginn, docs/checkpoints.md): ``loops`` is r, the core steps per token.
    # ``kl_threshold``: the KL exit, each token leaves after the first core step (from
    # ``min_loops``) whose next-token distribution moved less than this from the previous
    # step's (the release's 1e-3; None: r steps), ``kv_policy`` filling the skipped steps' KV.
    # ``state_seed``: the initial state, seeded truncated-normal per position (None: zero).
    kl_threshold: float | None = None
    state_seed: int | None = None

    def __post_init__(self) -> None:
        _integer(self.max_new_tokens, "max_new_tokens")
        if self.max_new_tokens < 0:
            raise RequestError(
                f"max_new_tokens must be >= 0, got {self.max_new_tokens}", parameter="max_new_tokens"
            )
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise RequestError(
                f"sampling must be a SamplingParams or None, got {type(self.sampling).__name__}"
            )
        if not isinstance(self.speculation, SpeculationConfig):
            raise RequestError(
                f"speculation must be a SpeculationConfig, got {type(self.speculation).__name__}"
            )
        if self.stop_ids is not None:
            if isinstance(self.stop_ids, (str, bytes)) or not isinstance(self.stop_ids, Iterable):
                raise RequestError(
                    f"stop_ids must be a sequence of token ids, got {self.stop_ids!r:.60}",
                    parameter="stop_ids",
                )
            ids = tuple(self.stop_ids)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                    raise RequestError(
                        f"stop_ids must be token ids (integers >= 0), got {t!r}", parameter="stop_ids"
                    )
            object.__setattr__(self, "stop_ids", tuple(int(t) for t in ids))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if isinstance(self.stop, bytes) or not isinstance(self.stop, Iterable):
            raise RequestError(f"stop must be strings, got {self.stop!r:.60}", parameter="stop")
        for s in self.stop:
            if not isinstance(s, str):
                raise RequestError(f"stop must be strings, got {s!r:.60}", parameter="stop")
            checked_text(s, "stop")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        _flag(self.skip_special_tokens, "skip_special_tokens")
        self._check_depth()

    def _check_depth(self) -> None:
        object.__setattr__(self, "kv_policy", parse(KVPolicy, self.kv_policy, "kv_policy"))
        if self._check_recurrent():
            return
        for name in ("loops", "min_loops", "max_loops"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RequestError(
                    f"{name} must be a positive integer (loop applications), got {value!r}", parameter=name
                )
        q = self.exit_threshold
        if q is not None:
            if (
                isinstance(q, bool)
                or not isinstance(q, (int, float))
                or not (math.isfinite(q) and 0.0 < q <= 1.0)
            ):
                raise RequestError(f"exit_threshold must be in (0, 1], got {q!r}", parameter="exit_threshold")
            object.__setattr__(self, "exit_threshold", float(q))
            if self.loops is not None:
                raise RequestError(
                    "give either loops (a static depth) or exit_threshold (the exit gate), not both",
                    parameter="loops",
                )
        elif self.min_loops is not None or self.max_loops is not None:
            raise RequestError(
                "min_loops and max_loops clamp the exit gate: they need exit_threshold "
                "(min_loops also goes with kl_threshold, the recurrent-depth KL exit)",
                parameter="min_loops" if self.min_loops is not None else "max_loops",
            )
        elif self.kv_policy is not KVPolicy.FULL:
            raise RequestError(
                f"kv_policy {self.kv_policy.value!r} applies to the exit gate: it needs exit_threshold",
                parameter="kv_policy",
            )
        if self.min_loops is not None and self.max_loops is not None and self.min_loops > self.max_loops:
            raise RequestError(
                f"min_loops {self.min_loops} exceeds max_loops {self.max_loops}", parameter="min_loops"
            )

    def _check_recurrent(self) -> bool:
        """The recurrent-depth options; True when the KL exit is on (it takes min_loops and
        kv_policy, and composes with loops, the most core steps a token runs)."""
        seed = self.state_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise RequestError(
                f"state_seed must be an integer >= 0 or None, got {seed!r}", parameter="state_seed"
            )
        t = self.kl_threshold
        if t is None:
            return False
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t >= 0):
            raise RequestError(f"kl_threshold must be a number >= 0, got {t!r}", parameter="kl_threshold")
        object.__setattr__(self, "kl_threshold", float(t))
        if self.exit_threshold is not None:
            raise RequestError(
                "give either kl_threshold (the recurrent-depth KL exit) or exit_threshold (Ouro's exit gate)",
                parameter="kl_threshold",
            )
        if self.max_loops is not None:
            raise RequestError(
                "with kl_threshold the most core steps per token is loops; max_loops is the exit gate's",
                parameter="max_loops",
            )
        if self.min_loops is not None and (
            isinstance(self.min_loops, bool) or not isinstance(self.min_loops, int) or self.min_loops < 1
        ):
            raise RequestError(
                f"min_loops must be a positive integer, got {self.min_loops!r}", parameter="min_loops"
            )
        if self.min_loops is not None and self.loops is not None and self.min_loops > self.loops:
            raise RequestError(
                f"min_loops {self.min_loops} exceeds loops {self.loops}", parameter="min_loops"
            )
        if self.loops is not None and (
            isinstance(self.loops, bool) or not isinstance(self.loops, int) or self.loops < 1
        ):
            raise RequestError(f"loops must be a positive integer, got {self.loops!r}", parameter="loops")
        return True

    @property
    def gated(self) -> bool:
        """Whether the exit gate picks each token's depth."""
        return self.exit_threshold is not None

    @property
    def sampled(self) -> bool:
        return self.sampling is not None and not self.sampling.greedy

    # The keyword form of the public API: each keyword is a field of this config or of its
    # SpeculationConfig (``speculative`` is ``speculation.mode``).
    _SPECULATION_KEYWORDS = {
        "speculative": "mode",
        "num_draft_tokens": "num_draft_tokens",
        "gate": "gate",
        "min_ngram": "min_ngram",
        "max_ngram": "max_ngram",
        "tie_guard": "tie_guard",
        "allow_inexact": "allow_inexact",
        "pipeline_exit": "pipeline_exit",
        "pipeline_device_lanes": "pipeline_device_lanes",
        "alternate_gap": "alternate_gap",
        "draft_loops": "draft_loops",
    }

    def value(self, keyword: str) -> object:
        """The value of one keyword option (a field of this config or of its SpeculationConfig)."""
        if keyword in self._SPECULATION_KEYWORDS:
            return getattr(self.speculation, self._SPECULATION_KEYWORDS[keyword])
        if keyword not in {f.name for f in dataclasses.fields(self)}:
            raise RequestError(f"unknown generation option {keyword!r}")
        return getattr(self, keyword)

    def replace(self, **options: object) -> GenerationConfig:
        """This config with keyword options applied (``None`` for a speculation option keeps it)."""
        spec_changes: dict[str, Any] = {}
        own: dict[str, Any] = {}
        fields = {f.name for f in dataclasses.fields(self)}
        for name, value in options.items():
            if name in self._SPECULATION_KEYWORDS:
                if value is not None or name in ("num_draft_tokens", "alternate_gap", "draft_loops"):
                    spec_changes[self._SPECULATION_KEYWORDS[name]] = value
            elif name in fields:
                own[name] = value
            elif name == "use_weighted_exit" and value:
                raise RequestError(
                    "use_weighted_exit (logits averaged under the exit distribution) is not supported; "
                    "use exit_threshold (the token of the exit loop) or loops=k",
                    parameter="use_weighted_exit",
                )
            elif name == "use_weighted_exit":
                continue
            else:
                known = sorted(fields | set(self._SPECULATION_KEYWORDS))
                raise RequestError(f"unknown generation option {name!r}; known: {', '.join(known)}")
        if spec_changes:
            own["speculation"] = dataclasses.replace(self.speculation, **spec_changes)
        return dataclasses.replace(self, **own) if own else self

    @classmethod
    def from_options(cls, config: GenerationConfig | None = None, **options: object) -> GenerationConfig:
        base = config if config is not None else cls()
        if not isinstance(base, GenerationConfig):
            raise RequestError(f"config must be a GenerationConfig, got {type(base).__name__}")
        return base.replace(**options)


def _integer(value: object, name: str) -> None:
    """``value`` is an integer (a bool or a float such as 1.5 is not), else a RequestError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise RequestError(f"{name} must be an integer, got {value!r:.60}", parameter=name)


def _flag(value: object, name: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{name} must be True or False, got {value!r:.60}", parameter=name)
