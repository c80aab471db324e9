"""Stop conditions beyond ``max_new_tokens``: stop strings on the decoded text, and EOS ids.

Stop strings are matched on the output text (decoded with the request's
``skip_special_tokens``), so a string split across tokens, or across stream pieces, is found.
While streaming, the matcher holds back the longest tail of the text that is still the start of
some stop string, and releases it once the next text rules the match out. Invariant: released
text never contains any part of a stop string occurrence — a stop string starting inside the
released text would have made that text's tail a prefix of it, and that tail is held back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from loopcast.confined_files import read_confined_json
from loopcast.errors import ArtifactError, RequestError


class StopStringMatcher:
    """Feed text as it is decoded; get back the text safe to show, and whether a stop string
    ended the output (the returned text then ends just before it)."""

    def __init__(self, stops: Iterable[str] | str) -> None:
        self.stops = (stops,) if isinstance(stops, str) else tuple(stops)  # a bare string is one stop
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise RequestError(f"stop strings must be non-empty strings, got {list(self.stops)!r}")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add newly decoded text; return what can be shown now (nothing once stopped)."""
        if self.stopped:
            return ""
        buf = self._held + text
        hit = min(((i, s) for s in self.stops if (i := buf.find(s)) >= 0), default=None)
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit[1], ""
            return buf[: hit[0]]
        hold = self._longest_partial(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """The held-back text, when the output ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


def trim_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` cut before the earliest stop string, and which one (None: no match)."""
    matcher = StopStringMatcher(stops)
    shown = matcher.feed(text)
    return (shown, matcher.matched) if matcher.stopped else (text, None)


def artifact_eos_ids(path: Path, manifest_ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """Every EOS id the artifact declares: the manifest's, plus ``generation_config.json``'s
    ``eos_token_id`` (an int or a list: instruction-tuned Llamas end turns with several)."""
    ids = [int(t) for t in manifest_ids]
    gen_config = Path(path) / "generation_config.json"
    data = read_confined_json(Path(path), gen_config.name, "generation config", required=False)
    if data is not None:
        if not isinstance(data, dict):
            raise ArtifactError(f"{gen_config}: expected a JSON object")
        raw = data.get("eos_token_id")
        extra = raw if isinstance(raw, list) else [] if raw is None else [raw]
        for t in extra:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ArtifactError(
                    f"{gen_config}: eos_token_id {t!r} is not a token id in [0, {vocab_size})"
                )
            if t not in ids:
                ids.append(t)
    return tuple(ids)
