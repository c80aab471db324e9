"""Self-speculation for recurrent-depth models: draft with fewer core steps, verify at r.

A round at ``n`` (positions < n committed; the pending token p not yet run):

    draft    p, d_1 .. d_K-1 one by one at depth ``draft_loops`` → drafts d_1 .. d_K
    verify   rewind to n; [p, d_1 .. d_K] in one call at depth r → the target ids
    accept   greedy_accept: a drafts plus the verifier's next token; n += a + 1

Invariant (docs/architecture.md §2): the draft rows write KV at positions n..n+K-1 for steps
< draft_loops and the coda only; the verify call rewrites every slot (all r steps, prelude,
coda) at n..n+K before any row reads them, so a committed position always holds the KV of
its committed token at depth r. Rows past the accepted ones (n+a+1..n+K) hold the rejected
drafts' KV; the next round rewrites them before any row reads them (rewind only moves n).

The committed tokens are greedy's at depth r when the verify rows equal the one-row decode
rows, which the exporter measures (``exact_verify``: true with the loopcast attention; with
the stock ops M-row rows differ by ~1e-7). Elsewhere this mode runs only with
``allow_inexact=True`` (then ``stats.exact_greedy`` is false), as for any other mode (§6).
"""

from __future__ import annotations

import time

from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
from loopcast.ort_runtime.decoding.greedy_accept import greedy_accept
from loopcast.ort_runtime.decoding.stats import GenerationStats

from loopcast.errors import RequestError


def self_draft_greedy(
    generator: RecurrentGenerator,
    prompt: list[int],
    max_new_tokens: int,
    *,
    draft_loops: int,
    num_drafts: int = 4,
    stop_ids: tuple[int, ...] = (),
    allow_inexact: bool = False,
) -> tuple[list[int], GenerationStats]:
    """Greedy tokens at the generator's depth, drafted at ``draft_loops`` < its depth."""
    r = generator.loops
    if not isinstance(draft_loops, int) or not 1 <= draft_loops < r:
        raise RequestError(
            f"draft_loops must be an integer in 1..{r - 1} (below loops={r}), got {draft_loops!r}"
        )
    if not isinstance(num_drafts, int) or num_drafts < 1:
        raise RequestError(f"num_drafts must be a positive integer, got {num_drafts!r}")
    if generator.sharing is not None:
        raise RequestError("self-speculation needs a KV slot per (step, layer): kv_sharing must be None")
    exact_verify = generator.loaded.exact_verify
    if not exact_verify and not allow_inexact:
        raise RequestError(
            "this artifact's verify rows are not its decode rows bit for bit on this device "
            "(exact_verify is false), so self-speculation may differ from plain greedy; pass "
            "allow_inexact=True to run it anyway"
        )
    stats = GenerationStats(
        prompt_tokens=len(prompt), speculative="self", strategy="draft+verify", exact_verify=exact_verify
    )
    stats.exact_greedy = exact_verify
    started = time.perf_counter()
    generator.rewind(0)
    pending = int(generator.step(list(prompt)).next_ids[-1])
    tokens = [pending]
    while len(tokens) < max_new_tokens and pending not in stop_ids and generator.n < generator.max_length:
        n = generator.n
        # the verify writes positions n..n+k: keep them inside the KV capacity
        k = min(num_drafts, generator.max_length - n - 1, max_new_tokens - len(tokens))
        drafts: list[int] = []
        last = pending
        for _ in range(k):
            last = int(generator.step([last], loops=draft_loops).next_ids[-1])
            drafts.append(last)
        generator.rewind(n)
        target = generator.step([pending, *drafts])  # depth r: rewrites every slot at n..n+k
        result = greedy_accept(drafts, target.next_ids.tolist())
        committed = [*drafts[: result.accepted], result.next_token]
        generator.rewind(n + result.accepted + 1)
        stats.rounds += 1
        stats.proposed += k
        stats.accepted += result.accepted
        for token in committed:
            tokens.append(token)
            if token in stop_ids or len(tokens) >= max_new_tokens:
                break
        pending = tokens[-1]
    stats.new_tokens = len(tokens)
    stats.seconds = time.perf_counter() - started
    stats.tokens_per_round = (stats.new_tokens - 1) / stats.rounds if stats.rounds else 0.0
    stats.finish_reason = "stop" if tokens[-1] in stop_ids else "length"
    return tokens, stats
