"""The demo-model card's degeneracy rule (tools/demo_model/eval_demo_model.py): which greedy continuations
count as one short cycle repeated, and the rounds prompt lookup needs on the edit workload."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.demo_model.eval_demo_model import degenerate, prompt_lookup_rounds, tail_cycle


@pytest.mark.parametrize(
    "tokens,expected",
    [
        ([], (0, 0)),
        ([1, 2, 3, 4, 5, 6], (0, 0)),  # nothing repeats
        ([7] * 10, (1, 10)),  # one token: the shortest period wins
        ([1, 1], (0, 0)),  # fewer than three copies
        ([9, 1, 2, 1, 2], (0, 0)),  # two and a half copies of (1, 2)
        ([9, 9] + [1, 2, 3] * 3, (3, 9)),  # a prefix, then three copies
        (list(range(32)) * 3, (32, 96)),  # the longest period counted
        (list(range(33)) * 3, (0, 0)),  # one past it
        ([5, 1, 2] * 4 + [4], (0, 0)),  # a cycle that is broken at the end
    ],
)
def test_tail_cycle(tokens, expected) -> None:
    assert tail_cycle(tokens) == expected


def test_degenerate_needs_the_second_half() -> None:
    head = list(range(100, 150))
    assert degenerate(head[:46] + [1, 2] * 25)  # the cycle covers 50 of 96
    assert not degenerate(head + [1, 2] * 23)  # 46 of 96: under half
    assert not degenerate(list(range(96)))
    assert degenerate([3] * 96)


def test_packed_documents_give_back_the_texts_and_their_prompts() -> None:
    import numpy as np
    from loopcast.exporter.torch_backend import load_tokenizer

    from tools.demo_model.demo_prompts import code_prompts, packed_documents

    tokenizer = load_tokenizer(Path(__file__).resolve().parents[2] / "loopcast" / "demo_model")
    texts = ["x = 1\n", "def f():\n    return 2\n" * 20, "\tdef g(a):\n" + "    pass\n" * 40 + "# é ✓\n"]
    ids = np.concatenate(
        [np.append(np.asarray(tokenizer.encode(t).ids, np.uint16), np.uint16(0)) for t in texts]
    )
    docs = packed_documents(ids, tokenizer)
    assert [text for _, text in docs] == texts
    prompts = code_prompts(docs, 2)  # the first text has no def line
    assert prompts[0].startswith("def f():\n") and len(prompts[0]) <= 200 and not prompts[0].endswith("\n")
    assert prompts[1].startswith("\tdef g(a):\n")
    with pytest.raises(SystemExit, match="only 2 held-out documents"):
        code_prompts(docs, 3)


@pytest.mark.parametrize(
    "tokens,drafts,rounds",
    [
        (list(range(10, 22)), 5, 3),  # a copy of the prompt's 12 tokens: 1, then 6 per round
        (list(range(10, 22)), 3, 4),  # 1, then 4 per round
        ([90, 91, 92, 93], 5, 4),  # nothing to look up: one token per round
        ([10, 11, 12, 99, 15, 16], 5, 4),  # 1; 2 + the edit; a miss after it; the copy again
    ],
)
def test_prompt_lookup_rounds(tokens, drafts, rounds) -> None:
    # The prompt holds 10..21 between a lead-in and a tail that never repeats, so the first
    # token has nothing to look up; after it prompt lookup drafts the copy, and each round
    # commits its accepted drafts plus the verifier's token.
    prompt = [1, 2, 3] + list(range(10, 22)) + [4, 5, 6, 7, 8, 9]
    assert prompt_lookup_rounds(prompt, tokens, drafts) == rounds
