"""TextStreamer: token ids in, visible text out (UTF-8 safe, stop strings held back), against a
byte-level toy tokenizer and against the Python API's own stream on the demo model."""

from __future__ import annotations

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.text.stopping import trim_at_stop
from loopcast.ort_runtime.text.streamer import TextStreamer

from loopcast.errors import RequestError
from tests.artifacts import artifact

# A byte-level vocabulary: 0..255 are bytes, 256 is a special token "<eos>".
SPECIAL = 256


def toy_decode(ids, skip_special_tokens: bool) -> str:
    out, raw = [], bytearray()
    for t in ids:
        if t == SPECIAL:
            out.append(raw.decode("utf-8", errors="replace"))
            raw = bytearray()
            if not skip_special_tokens:
                out.append("<eos>")
        else:
            raw.append(t)
    return "".join(out) + raw.decode("utf-8", errors="replace")


def tokens_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(tokens, stop=(), skip=False) -> tuple[list[str], str, bool]:
    streamer = TextStreamer(toy_decode, stop, skip)
    deltas = []
    for t in tokens:
        delta, stopped = streamer.feed(t)
        deltas.append(delta)
        if stopped:
            return deltas, "", True
    return deltas, streamer.flush(), False


def test_multi_byte_characters_wait_until_complete() -> None:
    text = "aé€😀b"
    deltas, rest, stopped = run(tokens_of(text))
    assert not stopped and rest == ""
    # é is 2 bytes, € 3, 😀 4: the pieces of a character yield "" until its last byte
    assert deltas == ["a", "", "é", "", "", "€", "", "", "", "😀", "b"]
    assert "".join(deltas) == text


def test_a_stop_string_split_across_tokens_and_characters() -> None:
    text = "x = 1\n€END tail"
    deltas, rest, stopped = run(tokens_of(text), stop=["€END"])
    assert stopped and rest == ""
    assert "".join(deltas) == "x = 1\n"  # cut before the stop string
    assert all("€" not in d and "E" not in d for d in deltas)  # never a part of the match shown
    # fed after a stop: nothing more
    streamer = TextStreamer(toy_decode, ["END"])
    for t in tokens_of("aEND"):
        streamer.feed(t)
    assert streamer.stopped and streamer.matched == "END"
    assert streamer.feed(ord("z")) == ("", True) and streamer.flush() == ""


def test_held_back_text_is_released_when_ruled_out_or_at_the_end() -> None:
    deltas, rest, stopped = run(tokens_of("abcEN"), stop=["END"])
    assert not stopped and deltas == ["a", "b", "c", "", ""] and rest == "EN"
    deltas, rest, stopped = run(tokens_of("aENx"), stop=["END"])
    assert not stopped and deltas == ["a", "", "", "ENx"] and rest == ""


def test_a_character_still_incomplete_at_the_end_is_flushed() -> None:
    deltas, rest, stopped = run(tokens_of("ab") + [0xE2, 0x82])  # the first two bytes of €
    assert deltas == ["a", "b", "", ""] and rest == "\ufffd"
    assert "".join(deltas) + rest == toy_decode(tokens_of("ab") + [0xE2, 0x82], False)


def test_skip_special_tokens() -> None:
    tokens = tokens_of("hi") + [SPECIAL] + tokens_of("yo")
    kept, _, _ = run(tokens)
    skipped, _, _ = run(tokens, skip=True)
    assert "".join(kept) == "hi<eos>yo" and "".join(skipped) == "hiyo"
    # a stop string on the text as shown: with the special token skipped there is none to match
    assert run(tokens, stop=["<eos>"])[2] and not run(tokens, stop=["<eos>"], skip=True)[2]


def test_no_tokenizer_streams_empty_text_and_bad_stops_are_refused() -> None:
    streamer = TextStreamer(lambda ids, skip: None)
    assert streamer.feed(5) == ("", False) and streamer.flush() == ""
    with pytest.raises(RequestError, match="non-empty"):
        TextStreamer(toy_decode, [""])
    assert run(tokens_of("a|b"), stop="|")[2]  # a bare string is one stop


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("stop", [(), ("\n",), ("):\n", "return")])
def test_equals_the_api_stream_on_the_demo_model(demo, stop, skip) -> None:
    prompt = "def fibonacci(n):\n"
    pieces = list(demo.stream(prompt, 32, stop=list(stop), skip_special_tokens=skip))
    streamer = TextStreamer(demo.decode, stop, skip)
    got = []
    for piece in pieces:
        if piece.token is None:
            got.append((None, streamer.flush()))
            break
        delta, stopped = streamer.feed(piece.token)
        got.append((piece.token, delta))
        if stopped:
            break
    else:
        if rest := streamer.flush():
            got.append((None, rest))
    assert got == [(p.token, p.text) for p in pieces]
    tokens = [p.token for p in pieces if p.token is not None]
    text = demo.decode(tokens, skip)
    assert "".join(d for _, d in got) == (trim_at_stop(text, stop)[0] if stop else text)
