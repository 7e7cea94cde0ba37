"""`llmlower serve ARTIFACT --replicas N`: the same OpenAI-compatible app as N replicas on Ray Serve, each with an
engine of its own; Ray's HTTP proxy spreads the requests over them. Needs the `replicas` extra (ray[serve]).

How the app is hosted: `Replica` is a Serve ingress deployment whose app is built at replica start-up (Ray's
late-bound `@serve.ingress()` with `__serve_build_asgi_app__`): the constructor loads the artifact with
`Engine.load` (runtime only, no torch), then `serving_app` wraps the engine in an AsyncEngine and builds the very
app `llmlower serve` runs, with its closures, its error envelope and its server-sent events (Ray streams a
StreamingResponse through the proxy chunk by chunk). Ray runs the app's lifespan, so a replica that stops closes
its engine thread. A middleware adds `x-llmlower-replica: <Ray's replica id>` to every response: which replica
answered (the id Ray's logs use).

Ray locally or on a cluster: `RAY_ADDRESS` (or `address=`) joins a running cluster (`ray start --head` ...);
without it a small local instance starts: no dashboard, a bounded object store, usage stats off unless
RAY_USAGE_STATS_ENABLED says otherwise. Serve's HTTP proxy listens on host:port (127.0.0.1 by default; on a
cluster every node with a replica runs a proxy, so pass --host 0.0.0.0 to reach them from elsewhere). Ray's
own processes (GCS, raylet, workers) listen for their cluster protocol on every interface; Ray has no setting
that confines them.

Each replica reserves `threads` of Ray's CPUs and runs its executor with that many intra-op threads (default:
the cluster's CPUs split evenly, at most one node's worth), plus one GPU for a CUDA artifact. Serve's
max_ongoing_requests is what the app admits itself (max_num_seqs + max_waiting), so a full replica answers 429
as `llmlower serve` does (the app counts sequences, n of them per request); requests beyond every replica's
max_ongoing_requests wait in Ray's router, at most max_waiting of them (max_queued_requests): more get Ray's own
429 with Retry-After, so nothing queues without limit in front of the replicas.

/health, /metrics and the rest behind Ray's proxy: every request reaches ONE replica, the one Ray's router picks
(the less loaded of two random ones, same node first), so
- /health says that the replica that answered is up. Ray health-checks every replica itself (every 10 s) and
  replaces one that stops answering; the proxy's own `/-/healthz` says the proxy is up, `/-/routes` lists the
  apps. The app's 503 "draining" comes from uvicorn's signal handling (server.py), which Ray does not run: a
  replica that stops is first taken out of the routing, then its running requests get graceful_shutdown_timeout_s
  (drain_timeout), then its lifespan closes the engine.
- /metrics is the answering replica's engine only (its queue, its KV pool, its counters), not a sum over the
  replicas; the x-llmlower-replica header says whose. Ask until every replica id has answered to see them all,
  or scrape Ray's own metrics (ray_serve_* per replica: requests, errors, latencies) from its metrics export.
- Prefix caches and KV pools are per replica: a prompt prefix is reused only by requests that land on the
  replica that cached it.

SIGINT or SIGTERM stops a blocking run: the app is deleted (Serve shut down, and Ray with it, when the instance
was started here) and running requests finish within drain_timeout; a second signal cuts the drain short.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import LlmlowerError
from ..runtime import Engine, EngineConfig
from ..runtime.artifact import is_artifact, read_manifest
from .app import ServerConfig
from .server import serving_app

APP_NAME = "llmlower"
REPLICA_HEADER = "x-llmlower-replica"
OBJECT_STORE_BYTES = 256 << 20  # a local instance: requests and responses are small


class ReplicaHeader:
    """ASGI middleware: `x-llmlower-replica: ID` on every response (streams too: it goes with the headers)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, sending)


@serve.ingress()
class Replica:
    """One replica: its own engine on the artifact, serving `llmlower serve`'s app."""

    def __init__(self, artifact: str, engine_config: EngineConfig, server_config: ServerConfig, threads: int) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = Engine.load(artifact, engine_config, threads=threads)
        self.server_config = server_config
        print(f"llmlower replica {self.replica_id} (pid {os.getpid()}): {artifact}, {threads} threads", flush=True)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = serving_app(self.engine, self.server_config)
        app.add_middleware(ReplicaHeader, replica=self.replica_id)
        self.served_app = app  # `app` is Serve's own attribute of an ingress deployment
        return app

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is unhealthy, so Serve replaces it."""
        app = getattr(self, "served_app", None)
        if app is not None and not app.state.engine.alive:
            raise RuntimeError(f"llmlower replica {self.replica_id}: the engine thread stopped")


class RunningReplicas:
    """The deployed replicas: `url` (Ray's proxy), `handle` (Serve's deployment handle); `shutdown()` deletes the
    app and stops what run_replicas started (idempotent; also on leaving a `with` block)."""

    def __init__(self, url: str, handle: Any, connected_here: bool, local: bool) -> None:
        self.url, self.handle = url, handle
        self._connected_here, self._local = connected_here, local
        self._closed = False

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._local:
                serve.shutdown()  # the controller and the proxies too: the instance is ours
            else:
                serve.delete(APP_NAME)  # a cluster's Serve (and its other apps) stays up
        finally:
            if self._connected_here:
                ray.shutdown()

    def __enter__(self) -> RunningReplicas:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()


def run_replicas(
    artifact: str | Path,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    replicas: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    threads: int = 0,
    blocking: bool = True,
    drain_timeout: float = 30,
    address: str | None = None,
) -> RunningReplicas | None:
    """Serve `artifact` as `replicas` replicas behind Ray Serve's proxy on host:port. `threads`: intra-op threads
    (and Ray CPUs) per replica, 0 to split the CPUs evenly; `drain_timeout`: seconds a stopping replica's running
    requests get; `address`: a Ray cluster to join (default $RAY_ADDRESS; neither: start a local instance).
    Blocking: serves until SIGINT/SIGTERM, then shuts down (returns None). Otherwise returns RunningReplicas
    once every replica is ready; call its shutdown()."""
    if replicas < 1:
        raise LlmlowerError(f"--replicas must be >= 1, got {replicas}")
    if threads < 0:
        raise LlmlowerError(f"--threads must be >= 0, got {threads}")
    path = Path(artifact).resolve()  # the replicas' working directory is not ours
    if not is_artifact(path):
        raise LlmlowerError(f"--replicas serves compiled artifacts only: {artifact} has no manifest.json")
    target = str(read_manifest(path, verify=False)["target"])  # each replica verifies the files' hashes
    gpus = 1 if target.split(maxsplit=1)[0] == "cuda" else 0

    if blocking and threading.current_thread() is not threading.main_thread():
        raise LlmlowerError("run_replicas(blocking=True) waits for signals: call it from the main thread")

    connected_here, local = _connect(address)
    serving, stop = threading.Event(), threading.Event()
    previous = _on_signals(serving, stop) if blocking else {}  # after ray.init, which sets its own
    try:
        try:
            cpus = threads or _even_share(replicas)
            if local:
                _check_fits(replicas, cpus, gpus)
            serve.start(http_options={"host": host, "port": port})
            deployment = serve.deployment(
                Replica,
                name=APP_NAME,
                num_replicas=replicas,
                ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
                max_ongoing_requests=engine_config.max_num_seqs + server_config.max_waiting,
                max_queued_requests=server_config.max_waiting,
                backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
                graceful_shutdown_timeout_s=drain_timeout,
            )
            app = deployment.bind(str(path), engine_config, server_config, cpus)
            handle = serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except BaseException as error:
            why = _why_not_started(error) if isinstance(error, Exception) else ""
            RunningReplicas("", None, connected_here, local).shutdown()
            if isinstance(error, Exception) and not isinstance(error, LlmlowerError):
                raise LlmlowerError(f"the replicas did not start: {why}") from error
            raise
        running = RunningReplicas(f"http://{_url_host(host)}:{port}", handle, connected_here, local)
        if not blocking:
            return running
        serving.set()
        print(f"llmlower: {replicas} replicas serving at {running.url} (Ray Serve); Ctrl-C stops", file=sys.stderr)
        while not stop.wait(1.0):
            pass
        running.shutdown()  # replicas drain; a second signal cuts it short
        return None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_signals(serving: threading.Event, stop: threading.Event) -> dict[int, Any]:
    """SIGINT/SIGTERM: while starting, interrupt (KeyboardInterrupt, which shuts down what started); while
    serving, stop (drain); while draining, interrupt the drain. Returns the handlers they replace."""

    def handler(signum: int, frame: FrameType | None) -> None:
        if serving.is_set() and not stop.is_set():
            stop.set()
        else:
            raise KeyboardInterrupt

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _why_not_started(error: Exception) -> str:
    """Why the deployment failed: the last line of each failing deployment's message (a replica constructor's
    exception, e.g. an artifact file whose hash does not match), else the error itself."""
    try:
        status = serve.status().applications.get(APP_NAME)
        messages = [d.message for d in status.deployments.values()] if status else []
    except Exception:  # Serve itself did not start: its error says why
        messages = []
    reasons = [message.strip().splitlines()[-1] for message in messages if message and message.strip()]
    return "; ".join(reasons) or str(error)


def _connect(address: str | None) -> tuple[bool, bool]:
    """Connect this process to Ray: (whether it connected here, whether it started a local instance)."""
    if ray.is_initialized():
        return False, False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address)
        return True, False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # a local instance reports nowhere
    # Serve restarts a proxy whose start takes over 5 s, which a busy 2-core machine exceeds (and a restarted
    # proxy is killed mid-deployment); its processes inherit this environment from the instance started here.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")
    ray.init(address="local", include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES)
    return True, True


def _even_share(replicas: int) -> int:
    """CPUs per replica when --threads is not given: the cluster's split evenly, at most one node's."""
    nodes = [int(node["Resources"].get("CPU", 0)) for node in ray.nodes() if node["Alive"]]
    return max(1, min(sum(nodes) // replicas, max(nodes, default=1)))


def _check_fits(replicas: int, cpus: int, gpus: int) -> None:
    """A local instance never grows: replicas it cannot place would leave Serve waiting forever."""
    have = ray.cluster_resources()
    if replicas * cpus > have.get("CPU", 0):
        raise LlmlowerError(
            f"{replicas} replicas x {cpus} threads need {replicas * cpus} CPUs; this machine has "
            f"{int(have.get('CPU', 0))} (lower --replicas or --threads, or join a cluster with RAY_ADDRESS)"
        )
    if replicas * gpus > have.get("GPU", 0):
        raise LlmlowerError(
            f"{replicas} replicas of a CUDA artifact need {replicas} GPUs; this machine has {int(have.get('GPU', 0))}"
        )


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
