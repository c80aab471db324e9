"""greedy_accept is pure: accepted prefix, correction/bonus token, near ties."""

import numpy as np
import pytest
from loopcast.ort_runtime.decoding.greedy_accept import greedy_accept


def test_all_accepted_gives_bonus() -> None:
    r = greedy_accept([4, 5, 6], [4, 5, 6, 9])
    assert (r.accepted, r.next_token) == (3, 9)


def test_first_rejected_gives_correction() -> None:
    r = greedy_accept([1, 5, 6], [4, 5, 6, 9])
    assert (r.accepted, r.next_token) == (0, 4)


def test_middle_rejection_stops_even_if_later_drafts_match() -> None:
    r = greedy_accept([4, 7, 6], [4, 5, 6, 9])
    assert (r.accepted, r.next_token) == (1, 5)


def test_no_drafts() -> None:
    assert greedy_accept([], [3]).next_token == 3


def test_row_count_checked() -> None:
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


def _logits(rows):
    return np.array(rows, dtype=np.float32)


def test_near_tie_counted_but_strict_by_default() -> None:
    logits = _logits([[0.0, 5.0, 4.9995, 0.0], [0, 0, 0, 1.0]])
    r = greedy_accept([2], [1, 3], logits, epsilon=1e-3)
    assert (r.accepted, r.next_token, r.near_tie_rejections, r.tolerant_accepts) == (0, 1, 1, 0)


def test_exact_tie_is_a_near_tie() -> None:
    logits = _logits([[0.0, 5.0, 5.0, 0.0], [0, 0, 0, 1.0]])
    r = greedy_accept([2], [1, 3], logits, epsilon=0.0)
    assert r.accepted == 0 and r.near_tie_rejections == 1


def test_clear_rejection_is_not_a_near_tie() -> None:
    logits = _logits([[0.0, 5.0, 3.0, 0.0], [0, 0, 0, 1.0]])
    assert greedy_accept([2], [1, 3], logits, epsilon=1e-3).near_tie_rejections == 0


def test_tolerant_mode_accepts_near_ties_and_reports_it() -> None:
    logits = _logits([[0.0, 5.0, 4.9995, 0.0], [0, 0, 0, 1.0]])
    r = greedy_accept([2], [1, 3], logits, epsilon=1e-3, tolerant=True)
    assert (r.accepted, r.next_token, r.tolerant_accepts) == (1, 3, 1)
