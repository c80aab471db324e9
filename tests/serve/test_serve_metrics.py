"""``GET /metrics`` (serve/metrics.py): Prometheus text that prometheus_client's own parser reads,
with counts that agree with the responses the server gave."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")
from loopcast.serve.app import create_app  # noqa: E402
from loopcast.serve.state import ServeOptions, open_serving  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tests.artifacts import artifact, require_exact_cpu_artifacts  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402


@pytest.fixture(scope="module")
def tiny_state():
    require_exact_cpu_artifacts()
    state = open_serving(artifact("ouro-r3", max_batch=4), ServeOptions(model_name="tiny"))
    yield state
    state.close()


def scrape(url: str) -> dict[str, float]:
    """sample name (+ finished_reason label) -> value, through prometheus_client's parser."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.labels.get("model_name") != "tiny":
                continue
            key = s.name + (f"[{s.labels['finished_reason']}]" if "finished_reason" in s.labels else "")
            if "le" in s.labels:
                key += f"[le={s.labels['le']}]"
            samples[key] = s.value
    return samples


def test_metrics_scraped_and_parsed(tiny_state):
    repeated = [5, 6, 7, 8] * 6
    bodies = [
        {"model": "tiny", "prompt": [1, 2, 3 + i], "max_tokens": 5 + i, "temperature": 0, "ignore_eos": True}
        for i in range(5)
    ] + [
        {
            "model": "tiny",
            "prompt": repeated,
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "speculative": mode,
        }
        for mode in ("prompt-lookup", "pipeline")
    ]
    with running_server(tiny_state) as url:
        before = scrape(url)
        assert before["loopcast_num_requests_running"] == 0 and before["loopcast_kv_slots_total"] == 4
        with ThreadPoolExecutor(6) as pool:
            answers = list(
                pool.map(lambda b: httpx.post(f"{url}/v1/completions", json=b, timeout=120).json(), bodies)
            )
        after = scrape(url)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    completion = sum(a["usage"]["completion_tokens"] for a in answers)
    assert grew("loopcast_generation_tokens_total") == completion == sum(b["max_tokens"] for b in bodies)
    assert grew("loopcast_prompt_tokens_total") == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert grew("loopcast_request_success_total[length]") == len(bodies)
    for name in ("time_to_first_token", "e2e_request_latency", "time_per_output_token"):
        assert grew(f"loopcast_{name}_seconds_count") == len(bodies)
        assert grew(f"loopcast_{name}_seconds_bucket[le=+Inf]") == len(bodies)
        assert after[f"loopcast_{name}_seconds_sum"] > before.get(f"loopcast_{name}_seconds_sum", 0.0)
    drafted = sum(a["loopcast"]["proposed"] for a in answers)
    assert grew("loopcast_spec_decode_num_draft_tokens_total") == drafted
    assert grew("loopcast_spec_decode_num_accepted_tokens_total") == sum(
        a["loopcast"]["accepted"] for a in answers
    )
    assert after["loopcast_num_requests_running"] == after["loopcast_num_requests_waiting"] == 0
    assert after["loopcast_kv_slots_used"] == 0 and after["loopcast_kv_cache_usage_ratio"] == 0
    assert grew("loopcast_engine_steps_total") > 0
    assert grew("loopcast_pipeline_cycles_total") == tiny_state.engine.stats["pipeline_cycles"] > 0
    assert "loopcast_prefix_cache_queries_total" in after and "loopcast_prefix_cache_hits_total" in after


def test_each_app_has_its_own_registry(tiny_state):
    """Two apps in one process (tests, Ray replicas in one worker): no shared global registry."""
    first, second = create_app(tiny_state, close_on_shutdown=False), create_app(tiny_state)
    assert first.state.metrics.registry is not second.state.metrics.registry
    first.state.metrics.observe(3, [1.0, 1.5], 0.5, 2.0, "stop")
    text = second.state.metrics.render().decode()
    assert 'loopcast_generation_tokens_total{model_name="tiny"} 0.0' in text
    assert 'loopcast_generation_tokens_total{model_name="tiny"} 2.0' in first.state.metrics.render().decode()


def test_exit_depth_metrics_match_the_responses():
    """The one-request engine under the exit gate: each response's ``loopcast`` field carries
    its depth stats (those of the API's generate), and /metrics' loopcast_exit_depth histogram
    and loopcast_core_passes_total grow by exactly what the responses say."""
    require_exact_cpu_artifacts()
    state = open_serving(artifact("ouro-r3"), ServeOptions(model_name="tiny"))
    prompt = [3, 5, 7, 11, 2, 9]
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    gated = [{"exit_threshold": 0.4, "kv_policy": policy} for policy in ("full", "last-exited")]
    try:
        with running_server(state) as url:
            before = scrape(url)
            answers = [
                httpx.post(f"{url}/v1/completions", json={**base, **extra}, timeout=60).json()
                for extra in [*gated, {"loops": 2}]
            ]
            after = scrape(url)
    finally:
        state.close()
    histogram: dict[int, int] = {}
    passes = 0
    for extra, answer in zip([*gated, {"loops": 2}], answers, strict=True):
        got = answer["loopcast"]
        want = state.model.generate(prompt, 10, stop_ids=(), **extra).stats
        assert {int(k): v for k, v in got["exit_histogram"].items()} == want.exit_histogram, extra
        assert got["mean_loops"] == want.mean_loops and got["kv_policy"] == want.kv_policy
        assert got["core_calls_per_token"] == want.core_calls_per_token
        assert got["core_passes"] == want.core_passes > 0
        for k, v in want.exit_histogram.items():
            histogram[k] = histogram.get(k, 0) + v
        passes += want.core_passes
    # last-exited skips the loops past each exit; full still runs them for the KV
    assert answers[1]["loopcast"]["core_passes"] < answers[0]["loopcast"]["core_passes"]
    assert len(histogram) > 1  # the gate's exits vary, so the buckets are told apart

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("loopcast_core_passes_total") == passes
    assert grew("loopcast_exit_depth_count") == sum(histogram.values()) == 3 * 10
    assert grew("loopcast_exit_depth_sum") == sum(k * v for k, v in histogram.items())
    for le in (1, 2, 3, 4):  # cumulative buckets: tokens read at le loops or fewer
        want_le = sum(v for k, v in histogram.items() if k <= le)
        assert grew(f"loopcast_exit_depth_bucket[le={float(le)}]") == want_le, le
