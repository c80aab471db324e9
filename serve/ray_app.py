"""The server as a Ray Serve deployment (docs/serving.md, "Ray Serve").

Each replica is one process that loads the artifact and runs its own batching engine behind the
same FastAPI app as ``loopcast serve``; Ray's proxy spreads requests over the replicas (one per
GPU with ``replica_gpus=1``, or per CPU budget with ``replica_cpus``), and autoscaling adds or
removes replicas by the number of ongoing requests per replica.

    loopcast serve ART --ray --replicas 2
    serve run loopcast.serve.ray_app:app_builder artifact=ART num_replicas=2     # Ray's own CLI
"""

from __future__ import annotations

from dataclasses import asdict

from loopcast.serve.launch import RayOptions
from loopcast.serve.state import ServeOptions
from ray import serve


@serve.ingress()
class LoopcastReplica:
    """One replica: a ServingState, and the app over it (built by Ray after ``__init__``)."""

    def __init__(self, artifact: str, options: dict) -> None:
        from loopcast.serve.state import open_serving

        self.options = ServeOptions(**options)
        self.state = open_serving(artifact, self.options)

    def __serve_build_asgi_app__(self):
        from loopcast.serve.app import create_app

        return create_app(self.state, close_on_shutdown=False, max_body_bytes=self.options.max_body_bytes)

    def __del__(self) -> None:
        state = getattr(self, "state", None)
        if state is not None:
            state.close(5.0)


def build_deployment(artifact: str, options: ServeOptions, ray_options: RayOptions):
    """The bound application: replicas, resources and autoscaling from ``ray_options``."""
    settings = dict(
        name="loopcast",
        max_ongoing_requests=ray_options.max_ongoing_requests,
        ray_actor_options={"num_cpus": ray_options.replica_cpus, "num_gpus": ray_options.replica_gpus},
    )
    if ray_options.num_replicas is not None:
        settings["num_replicas"] = ray_options.num_replicas
    else:
        settings["autoscaling_config"] = {
            "min_replicas": ray_options.min_replicas,
            "max_replicas": ray_options.max_replicas,
            "target_ongoing_requests": ray_options.target_ongoing_requests,
        }
    return serve.deployment(LoopcastReplica, **settings).bind(str(artifact), asdict(options))


def app_builder(args: dict):
    """For ``serve run loopcast.serve.ray_app:app_builder artifact=ART [num_replicas=N] [max_batch=B]
    [device=cuda] [replica_cpus=C] [replica_gpus=G]``."""
    artifact = args["artifact"]
    serve_fields, ray_fields = ServeOptions.__dataclass_fields__, RayOptions.__dataclass_fields__
    convert = {
        "num_replicas": int,
        "max_batch": int,
        "max_waiting": int,
        "prefill_chunk": int,
        "prefill_rows": int,
        "threads": int,
        "replica_cpus": float,
        "replica_gpus": float,
        "min_replicas": int,
        "max_replicas": int,
        "max_ongoing_requests": int,
        "target_ongoing_requests": float,
        "trust_ops": lambda v: str(v).lower() in ("1", "true", "yes"),
        "sequential": lambda v: str(v).lower() in ("1", "true", "yes"),
        "prefix_caching": lambda v: str(v).lower() in ("1", "true", "yes"),
        "cuda_graphs": lambda v: str(v).lower() in ("1", "true", "yes"),
    }
    values = {k: convert.get(k, str)(v) for k, v in args.items() if k != "artifact"}
    unknown = sorted(set(values) - set(serve_fields) - set(ray_fields))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}")
    options = ServeOptions(**{k: v for k, v in values.items() if k in serve_fields})
    ray_options = RayOptions(**{k: v for k, v in values.items() if k in ray_fields})
    return build_deployment(artifact, options, ray_options)
