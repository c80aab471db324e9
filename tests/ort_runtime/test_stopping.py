"""Stop strings: the matcher, and generation stopping at a string split across tokens in
``generate``, ``stream`` and ``loopcast generate --stream``."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.ort_runtime import SamplingParams, load
from loopcast.ort_runtime.text.stopping import StopStringMatcher, trim_at_stop

from loopcast.errors import RequestError
from tests.artifacts import artifact

PROMPT = "def fibonacci(n):\n"


def _feed_all(stops, pieces) -> tuple[list[str], bool]:
    m = StopStringMatcher(stops)
    out = [m.feed(p) for p in pieces]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


def test_matcher_across_pieces_holds_back_possible_prefixes() -> None:
    out, stopped = _feed_all(["END"], ["abc E", "N", "D tail"])
    assert stopped and "".join(out) == "abc "
    assert out[0] == "abc "  # "E" held: it could start END
    out, stopped = _feed_all(["END"], ["abc E", "N", "x"])
    assert not stopped and out == ["abc ", "", "ENx", ""]  # released once ruled out


def test_matcher_earliest_match_wins_and_flush_releases() -> None:
    out, stopped = _feed_all(["lo w", "hello"], ["hel", "lo wor"])
    assert stopped and "".join(out) == ""  # "hello" starts at 0, before "lo w" at 3
    out, stopped = _feed_all(["xyz"], ["ab", "cx", "y"])
    assert not stopped and "".join(out) == "abcxy"
    assert trim_at_stop("a\n\nb", ["\n\n"]) == ("a", "\n\n")
    assert trim_at_stop("abc", ["z"]) == ("abc", None)
    assert trim_at_stop("a\n\nb", "\n\n") == ("a", "\n\n")  # a bare string is one stop, not two


def test_matcher_never_releases_part_of_a_match() -> None:
    text, stops = "aababcabcdabcde", ["abcd", "bcde", "cab"]
    for cut in range(1, len(text)):
        out, stopped = _feed_all(stops, [text[:cut], text[cut:]])
        assert stopped and "".join(out) == text[: text.find("cab")]


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(RequestError, match="non-empty"):
        StopStringMatcher([""])


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


@pytest.fixture(scope="module")
def split_stop(demo):
    """A stop string that spans a token boundary of the greedy output, and what it must give."""
    plain = demo.generate(PROMPT, 40)
    pieces = [demo.decode(plain.tokens[: i + 1]) for i in range(len(plain.tokens))]
    for j in range(3, len(pieces) - 1):
        a, b = pieces[j][len(pieces[j - 1]) :], pieces[j + 1][len(pieces[j]) :]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:2]
            text = plain.text
            if text.find(stop) == len(pieces[j]) - 2:  # its first occurrence is this one
                return stop, plain.tokens[: j + 2], text[: text.find(stop)]
    pytest.fail("no token boundary to split a stop string across")


def test_generate_stops_at_a_split_string(demo, split_stop) -> None:
    stop, tokens, text = split_stop
    gen = demo.new_generator()
    result = demo.generate(PROMPT, 40, stop=[stop, "never appears \x00"], generator=gen)
    assert (result.tokens, result.text, result.finish_reason) == (tokens, text, "stop")
    assert result.stats.new_tokens == len(tokens)
    # committed: prompt + every yielded token but the last (pending), as for any finish
    assert gen.n == len(demo.encode(PROMPT)) + len(tokens) - 1
    assert demo.generate(PROMPT, 40).tokens[: len(tokens)] == tokens  # the generator stays usable


@pytest.mark.parametrize("mode", ["none", "prompt-lookup", "self"])
def test_stream_stops_at_a_split_string(demo, split_stop, mode: str) -> None:
    stop, tokens, text = split_stop
    from loopcast.ort_runtime.decoding.speculate import GenerationStats

    stats = GenerationStats()
    pieces = list(demo.stream(PROMPT, 40, stop=[stop], speculative=mode, stats=stats))
    assert [p.token for p in pieces] == tokens
    assert "".join(p.text for p in pieces) == text
    assert stats.finish_reason == "stop"
    assert all(stop not in "".join(p.text for p in pieces[: i + 1]) for i in range(len(pieces)))


def test_cli_stream_stops_at_a_split_string(split_stop) -> None:
    stop, tokens, text = split_stop
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "generate",
            str(artifact("demo")),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "40",
            "--stop",
            stop,
            "--stream",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output == text + "\n"
    result = runner.invoke(
        main,
        [
            "generate",
            str(artifact("demo")),
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "40",
            "--stop",
            stop,
            "--json",
        ],
    )
    import json

    out = json.loads(result.output)
    assert (out["tokens"], out["text"], out["finish_reason"]) == (tokens, text, "stop")


def test_held_back_text_is_released_when_no_stop_matches(demo) -> None:
    plain = demo.generate(PROMPT, 12)
    tail = plain.text[-1]
    pieces = list(demo.stream(PROMPT, 12, stop=[tail + "\x00never"]))
    assert "".join(p.text for p in pieces) == plain.text
    assert pieces[-1].token is None and pieces[-1].text.endswith(tail)


def test_stop_with_sampling(demo) -> None:
    sp = SamplingParams(temperature=0.8, seed=5)
    free = demo.generate(PROMPT, 30, sampling=sp)
    stop = free.text[10:13]
    cut = demo.generate(PROMPT, 30, sampling=sp, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.find(stop)]
    assert cut.tokens == free.tokens[: len(cut.tokens)]


def test_skip_special_tokens(demo) -> None:
    kept = demo.generate("if __name__ ==", 64)  # greedy ends with <|endoftext|> (id 0)
    assert kept.finish_reason == "eos" and kept.text.endswith("<|endoftext|>")
    skipped = demo.generate("if __name__ ==", 64, skip_special_tokens=True)
    assert skipped.tokens == kept.tokens and skipped.text == kept.text[: -len("<|endoftext|>")]
    runner = CliRunner()
    args = ["generate", str(artifact("demo")), "--prompt", "if __name__ ==", "--max-new-tokens", "64"]
    assert runner.invoke(main, args).output == skipped.text + "\n"  # the CLI skips by default
    assert runner.invoke(main, args + ["--keep-special-tokens"]).output == kept.text + "\n"
    import json

    assert json.loads(runner.invoke(main, args + ["--json"]).output)["tokens"] == kept.tokens


def test_eos_ids_from_generation_config(tmp_path) -> None:
    from loopcast.ort_runtime.text.stopping import artifact_eos_ids

    from loopcast.errors import ArtifactError

    assert artifact_eos_ids(tmp_path, [2], 10) == (2,)  # no generation_config.json
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7, 9]}')
    assert artifact_eos_ids(tmp_path, [2], 10) == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}')
    assert artifact_eos_ids(tmp_path, [2], 10) == (2, 5)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 10]}')
    with pytest.raises(ArtifactError, match="eos_token_id 10 is not a token id"):
        artifact_eos_ids(tmp_path, [2], 10)
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="generation_config.json: unreadable"):
        artifact_eos_ids(tmp_path, [2], 10)
