"""``loopcast serve``: an OpenAI-compatible HTTP server over an artifact (uvicorn or Ray Serve)."""

from __future__ import annotations

import click
from loopcast.serve import SERVED_MODES
from loopcast.serve.limits import DEFAULT_MAX_BODY_BYTES

from loopcast.vocab import SpeculativeMode

_SERVE_EPILOG = """\b
Examples:
  loopcast export demo -o art --max-batch 8 && loopcast serve art --port 8000
  curl localhost:8000/v1/completions -d '{"model": "art", "prompt": "def f():", "temperature": 0}'
  (temperature 0 is greedy: the tokens of `loopcast generate`; OpenAI's default, 1, samples)
  loopcast serve art --ray --replicas 2 --replica-cpus 1
"""


@click.command(epilog=_SERVE_EPILOG)
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Sequences per decode step (default: the artifact's --max-batch; without batched graphs "
    "one request at a time).",
)
@click.option(
    "--max-waiting",
    type=int,
    default=256,
    show_default=True,
    help="Requests queued for a free slot; more get HTTP 503.",
)
@click.option(
    "--sequential", is_flag=True, help="One request at a time even with batched graphs (a baseline)."
)
@click.option(
    "--speculative",
    type=click.Choice([mode.value for mode in SERVED_MODES]),
    default=SpeculativeMode.NONE.value,
    show_default=True,
    help="Default speculation per request (a request's `speculative` field overrides it); greedy "
    "requests only, with a cost gate per step. The batched engine runs prompt-lookup, self "
    "(draft_batch/verify_tail_batch rounds) and pipeline where the artifact has cycle_batch "
    "(docs/serving.md).",
)
@click.option(
    "--cuda-graphs",
    is_flag=True,
    help="Capture the batched graphs per batch width on CUDA (opt-in; eager otherwise).",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="Reuse the KV of a prompt prefix another request already computed (batched engine, where "
    "the artifact's rows are exact on the device; docs/serving.md).",
)
@click.option(
    "--prefill-chunk",
    type=int,
    default=256,
    show_default=True,
    help="Prompt tokens prefilled between two decode steps, so a joining prompt delays running "
    "requests by at most one chunk (0: whole prompts; artifacts whose rows are exact on the device).",
)
@click.option("--model-name", default=None, help="Name in the API (default: the artifact directory's name).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads.")
@click.option(
    "--max-body-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_BODY_BYTES,
    show_default=True,
    help="Largest request body accepted; larger ones get HTTP 413 (checked before and while reading).",
)
@click.option("--trust-ops", is_flag=True, help="Load the artifact's op library even if not built here.")
@click.option("--ray", "use_ray", is_flag=True, help="Run as a Ray Serve application (docs/serving.md).")
@click.option(
    "--replicas",
    type=int,
    default=1,
    show_default=True,
    help="Ray: replicas (0: autoscale between --min-replicas and --max-replicas).",
)
@click.option("--min-replicas", type=int, default=1, show_default=True)
@click.option("--max-replicas", type=int, default=4, show_default=True)
@click.option(
    "--target-ongoing-requests",
    type=float,
    default=8.0,
    show_default=True,
    help="Ray autoscaling: ongoing requests per replica it aims for.",
)
@click.option("--replica-cpus", type=float, default=1.0, show_default=True, help="Ray: CPUs per replica.")
@click.option("--replica-gpus", type=float, default=0.0, show_default=True, help="Ray: GPUs per replica.")
@click.option(
    "--prefill-rows",
    type=click.IntRange(min=1),
    default=None,
    help="With --cuda-graphs: prefill in chunks of exactly this many tokens through a graph captured "
    "per slot (a prompt's last chunk overlaps the one before it; shorter prompts run uncaptured).",
)
@click.option(
    "--kv-sharing",
    default=None,
    metavar="compress-s<c>|compress-r<c>",
    help="Recurrent depth (Huginn): the release's KV lookup sharing c core slots across steps and "
    "layers (plain decoding; the one-request engine: --sequential where batched graphs exist).",
)
@click.option("--ray-address", default=None, help="Ray: an existing cluster (default: start a local one).")
def serve(
    artifact: str,
    host: str,
    port: int,
    device: str,
    max_batch: int | None,
    max_waiting: int,
    sequential: bool,
    speculative: str,
    cuda_graphs: bool,
    prefix_caching: bool,
    prefill_chunk: int,
    prefill_rows: int | None,
    model_name: str | None,
    threads: int | None,
    max_body_bytes: int,
    trust_ops: bool,
    use_ray: bool,
    replicas: int,
    min_replicas: int,
    max_replicas: int,
    target_ongoing_requests: float,
    replica_cpus: float,
    replica_gpus: float,
    kv_sharing: str | None,
    ray_address: str | None,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from loopcast.serve.launch import RayOptions, require_extra, serve_ray, serve_uvicorn
    from loopcast.serve.state import ServeOptions

    from loopcast.errors import RequestError

    require_extra("fastapi", "uvicorn", "prometheus_client", *(["ray"] if use_ray else []))
    if max_waiting < 0 or replicas < 0 or prefill_chunk < 0 or not 1 <= min_replicas <= max_replicas:
        raise RequestError(
            "--max-waiting, --replicas and --prefill-chunk must be >= 0 and "
            "1 <= --min-replicas <= --max-replicas"
        )
    if prefill_rows is not None and not cuda_graphs:
        raise RequestError("--prefill-rows needs --cuda-graphs (it sizes captured prefill calls)")
    options = ServeOptions(
        device,
        max_batch,
        max_waiting,
        sequential,
        threads,
        trust_ops,
        model_name,
        speculative,
        cuda_graphs,
        prefix_caching,
        prefill_chunk,
        max_body_bytes=max_body_bytes,
        prefill_rows=prefill_rows,
        kv_sharing=kv_sharing,
    )
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    if use_ray:
        serve_ray(
            artifact,
            options,
            RayOptions(
                replicas or None,
                min_replicas,
                max_replicas,
                target_ongoing_requests,
                max_ongoing_requests=max(64, max_waiting),
                replica_cpus=replica_cpus,
                replica_gpus=replica_gpus,
                address=ray_address,
            ),
            host,
            port,
            echo,
        )
    else:
        serve_uvicorn(artifact, options, host, port, echo)
