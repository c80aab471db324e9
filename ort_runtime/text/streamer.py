"""Token ids in, visible text out: detokenising while streaming, and stop strings on that text.

One streamer serves one output (the Python API's ``stream`` and the server's requests use it
alike). Each :meth:`TextStreamer.feed` decodes every token so far with the output's
``skip_special_tokens`` and returns the new visible text:

- UTF-8 safe: while the decoded text ends in U+FFFD (a byte-level token split a character), the
  delta is ``""`` and the text waits for the tokens that complete it.
- Stop strings (ort_runtime/text/stopping.py): text that could be the start of one is held back
  until later text rules the match out; at a match the delta ends just before the stop string
  and ``stopped`` is true (later feeds return ``("", True)``).
- :meth:`flush` at the end of the output releases what is still held back (nothing after a
  stop). The deltas of all feeds and the flush concatenate to the output's text, cut before a
  matched stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from loopcast.ort_runtime.text.stopping import StopStringMatcher

Decode = Callable[[Sequence[int], bool], "str | None"]  # (ids, skip_special_tokens) -> text


class TextStreamer:
    """``decode(ids, skip_special_tokens)`` is the model's (``LoopcastModel.decode``); a decode
    that returns None (no tokenizer) streams empty text."""

    def __init__(self, decode: Decode, stop: Iterable[str] = (), skip_special_tokens: bool = False) -> None:
        stops = tuple(stop) if not isinstance(stop, str) else (stop,)
        self._decode, self._skip = decode, skip_special_tokens
        self._matcher = StopStringMatcher(stops) if stops else None  # validates the stop strings
        self.tokens: list[int] = []
        self._shown = ""  # the decoded text handed on (to the matcher, or out)

    @property
    def stopped(self) -> bool:
        return self._matcher is not None and self._matcher.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._matcher.matched if self._matcher is not None else None

    def feed(self, token: int) -> tuple[str, bool]:
        """Add one committed token: (the text it makes visible, whether a stop string ended the output)."""
        if self.stopped:
            return "", True
        self.tokens.append(token)
        text = self._decode(self.tokens, self._skip) or ""
        if text.endswith("\ufffd"):  # a byte-level token split a character: wait for the rest
            return "", False
        return self._release(text)

    def flush(self) -> str:
        """The text still held back when the output ends (a stop string never completed, or a
        last character that stayed incomplete); "" after a stop."""
        if self.stopped:
            return ""
        delta = ""
        if self.tokens:
            delta, _ = self._release(self._decode(self.tokens, self._skip) or "")
        return delta + (self._matcher.flush() if self._matcher is not None else "")

    def _release(self, text: str) -> tuple[str, bool]:
        delta, self._shown = text[len(self._shown) :], text
        if self._matcher is None:
            return delta, False
        visible = self._matcher.feed(delta)
        return visible, self._matcher.stopped
