"""The one place where operators meet Ray: a :class:`Stage` declares what an operator needs (data, not code), and
:func:`apply_stage` turns it into ``Dataset.map_batches``.

Operators are plain callables over pyarrow Tables and never import ray. A stage with ``actors > 0`` runs in an
actor pool (one operator instance, e.g. one loaded model, per actor); otherwise it runs as stateless tasks, which
Ray Data fuses with their neighbours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable

from pairmine.operators.errors import PairmineError

log = logging.getLogger("pairmine")


@dataclass(frozen=True)
class Stage:
    """How one operator runs on Ray.

    Attributes:
        name: shown in Ray's progress bars and logs.
        make: zero-argument factory returning the operator (called once per actor, or once in the driver for tasks).
        batch_size: rows per call (None: a whole block).
        actors: size of the actor pool; 0 runs the operator as tasks.
        num_cpus / num_gpus: resources per task or actor.
        memory: bytes of memory Ray reserves per task or actor (0: none); an actor holding a large object (an index
            shard) says so, and Ray places it on a node with that much memory free.
    """

    name: str
    make: Callable[[], Callable]
    batch_size: int | None = None
    actors: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int = 0


class _ActorOperator:
    """Actor wrapper: builds the operator once, calls its ``setup()`` (model load) before the first batch."""

    def __init__(self, make: Callable[[], Callable]):
        self.op = make()
        if hasattr(self.op, "setup"):
            self.op.setup()

    def __call__(self, batch):
        return self.op(batch)


def apply_stage(ds, stage: Stage):
    """``ds.map_batches`` for ``stage`` (pyarrow batches in and out)."""
    import ray.data

    common: dict[str, Any] = dict(batch_size=stage.batch_size, batch_format="pyarrow", num_cpus=stage.num_cpus)
    if stage.num_gpus:
        common["num_gpus"] = stage.num_gpus
    if stage.memory:
        common["memory"] = int(stage.memory)
    if stage.actors > 0:
        # A class per stage with the factory in its closure, so Ray's logs and progress name the stage.
        make = stage.make
        cls = type(stage.name.title(), (_ActorOperator,), {"__init__": lambda self: _ActorOperator.__init__(self, make)})
        return ds.map_batches(cls, compute=ray.data.ActorPoolStrategy(size=stage.actors), **common)
    op = stage.make()

    def run(batch):
        return op(batch)

    run.__name__ = run.__qualname__ = stage.name  # Ray names the task (logs, progress, stats) after the function
    return ds.map_batches(run, **common)


IDLE_WORKER_KEEP_S = 60
"""Seconds an idle task worker of pairmine's private local Ray lives (Ray's ``idle_worker_killing_time_threshold_ms``,
1 s by default; ``$RAY_idle_worker_killing_time_threshold_ms`` wins). Measured figures: docs/benchmarks.md."""


@contextlib.contextmanager
def _own_sigterm_handler():
    """Keep the caller's own Python SIGTERM handler across ``ray.init``, which replaces it with one that calls
    ``sys.exit(15)`` (so pairmine's CLI, whose handler ends a run as Ctrl-C does, would end with tracebacks from
    Ray Data's threads instead). A default or ignored SIGTERM is left to Ray's handler."""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(before):
            signal.signal(signal.SIGTERM, before)


started_private_ray = False
"""Whether :func:`init_ray` started a private local Ray in this process (the CLI shuts that one down itself)."""

JOB_ENVIRONMENT = (
    ("RAY_JOB_SUBMISSION_ID", "a KubeRay RayJob's submitter pod"),  # KubeRay sets it (and RAY_DASHBOARD_ADDRESS) there
    ("RAY_JOB_CONFIG_JSON_ENV_VAR", "a Ray job's driver"),  # Ray's job supervisor sets it for every job entrypoint
)
"""Variables that show this process runs where a private Ray would do a job's work off its cluster, with what they
mean. KubeRay (v1.3 on) runs ``ray job submit --no-wait -- <entrypoint> ; ray job logs --follow`` in a shell of the
submitter pod, so a command after ``&&`` or ``;`` in an entrypoint runs in that pod (1 CPU, 1 GiB by default)."""


def _refuse_private_ray_in_a_job() -> None:
    """Raise :class:`PrivateRayRefused` when the environment shows a KubeRay submitter or a Ray job (with no Ray
    address given): pairmine would otherwise start a private Ray there without a word."""
    for name, where in JOB_ENVIRONMENT:
        if os.environ.get(name):
            dashboard = os.environ.get("RAY_DASHBOARD_ADDRESS", "")
            raise PrivateRayRefused(
                f"no Ray address is set and this process runs in {where} (${name} is set): a private Ray here would "
                f"do the job's work outside the cluster{f' (its dashboard: {dashboard})' if dashboard else ''}. A "
                "command after `&&` or `;` in a RayJob entrypoint runs in the submitter pod, not on the cluster: give "
                "it a RayJob of its own. To start a private Ray here on purpose: --ray-address local (ray.address=local)")


def init_ray(address: str = "", num_cpus: int = 0) -> str:
    """Connect to the Ray cluster at ``address`` (else ``$RAY_ADDRESS``), or start a private local Ray.

    With no address, pairmine never joins a cluster that happens to run on the machine (a plain ``ray.init()``
    attaches to the latest ``ray start`` cluster and dies with it): it starts its own (``address="local"``), except
    where the environment shows a KubeRay submitter pod or a Ray job (:data:`JOB_ENVIRONMENT`): there a private Ray
    would do a job's work off the cluster without a word, so it is refused unless asked for (``address="local"``).

    Args:
        address: a Ray address (``host:port``, ``ray://...``, ``auto``); empty: ``$RAY_ADDRESS``, else local.
        num_cpus: CPUs of the private local Ray (0: all of the machine's); ignored for a cluster.

    Returns:
        What was used, for the log and the manifest's ``resolved.ray``: ``"local (2 CPUs)"``,
        ``"cluster 10.0.0.5:6379 (3 node(s), 48 CPUs, 8 GPUs)"``, or ``"existing ..."`` when this process had
        already initialised Ray.

    Raises:
        PrivateRayRefused: no address (argument or ``$RAY_ADDRESS``) inside a KubeRay submitter or a Ray job.
    """
    import ray

    if ray.is_initialized():
        return f"existing {describe_cluster()}"
    if not address and not os.environ.get("RAY_ADDRESS"):
        _refuse_private_ray_in_a_job()
    address = address or os.environ.get("RAY_ADDRESS", "")
    env_vars = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}
    if address and address != "local":
        # Inside a submitted Ray job, Ray refuses a ray.init runtime_env that sets a variable the job's own
        # runtime_env sets too: ours only fills in what the job left out.
        job_env = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}") or "{}").get("runtime_env") or {}
        given = job_env.get("env_vars") or {}
        env_vars = {k: v for k, v in env_vars.items() if k not in given}
        with _own_sigterm_handler():
            ray.init(address=address, runtime_env={"env_vars": env_vars} if env_vars else None, log_to_driver=True)
        return f"cluster {describe_cluster()}"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray ends a task worker after 1 s idle once the node has more workers than CPUs, and actors count: with an embed
    # actor busy, a pipeline whose tasks come seconds apart started a new worker process (~1 s of CPU) for nearly
    # every task (18 worker processes in one negatives run on 2 CPUs). Idle workers are kept IDLE_WORKER_KEEP_S here;
    # keeping them does not raise the peak number of workers, only when the idle ones go.
    os.environ.setdefault("RAY_idle_worker_killing_time_threshold_ms", str(IDLE_WORKER_KEEP_S * 1000))
    # The workers' variables go into the environment the private Ray's processes inherit when ray.init starts them,
    # not into a job runtime_env: Ray gives a job with a runtime_env none of the workers it started with the node
    # (they have no such env), so every task and actor waited for a new process while those idled (~1 s of CPU
    # each). This process's own environment is put back afterwards.
    # The private Ray's GCS port is chosen here, and RAY_ADDRESS names it in every process of that Ray: code that
    # asks Ray's state API without an address (Ray Train's PlacementGroupCleaner, every second of a training run)
    # otherwise picks "the latest cluster" of the machine, another `ray start` cluster or another command's Ray, does
    # not find the run's controller there, and removes the run's placement group: the training workers die
    # ("Destroying worker since its placement group was removed"). Seen with two Rays on one machine.
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        gcs_port = sock.getsockname()[1]
    env_vars = {**env_vars, "RAY_GCS_SERVER_PORT": str(gcs_port),
                "RAY_ADDRESS": f"{ray.util.get_node_ip_address()}:{gcs_port}"}
    before = {key: os.environ.get(key) for key in env_vars}
    for key, value in env_vars.items():
        if key in ("RAY_GCS_SERVER_PORT", "RAY_ADDRESS"):
            os.environ[key] = value  # this Ray's, whatever the caller had (RAY_ADDRESS=local, say)
        else:
            os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = dict(address="local", include_dashboard=False, logging_level=logging.WARNING)
    if num_cpus:
        kwargs["num_cpus"] = num_cpus
    try:
        with _own_sigterm_handler():
            ray.init(**kwargs)
        global started_private_ray
        started_private_ray = True
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    gcs = ray.get_runtime_context().gcs_address
    if not gcs.endswith(f":{gcs_port}"):
        log.warning("the private Ray's GCS listens on %s, not on port %d as asked: Ray's state API in its processes "
                    "may pick another Ray of this machine", gcs, gcs_port)
    return f"local ({int(ray.cluster_resources().get('CPU', 0))} CPUs)"


def describe_cluster() -> str:
    """The connected Ray's GCS address and resources: ``"127.0.0.1:6379 (2 node(s), 2 CPUs, 0 GPUs)"``."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    gcs = ray.get_runtime_context().gcs_address
    return f"{gcs} ({len(nodes)} node(s), {int(res.get('CPU', 0))} CPUs, {int(res.get('GPU', 0))} GPUs)"


class PlanError(PairmineError, ValueError):
    """The stages cannot be placed on the Ray cluster as configured (the message says why and what to change).
    User-fixable."""


class PrivateRayRefused(PlanError):
    """No Ray address, in a KubeRay submitter or a Ray job (:data:`JOB_ENVIRONMENT`): no private Ray is started
    there unless asked for with ``ray.address = "local"``. User-fixable (a :class:`PlanError`): the message says
    which address to set."""


MAX_ACTORS_PER_CPU = 10  # beyond this, each actor's CPU share is too small to be worth having (refused)


@dataclass(frozen=True)
class StagePlan:
    """Where and how the streaming stages run: one plan for ``mine`` and ``filter-pairs``.

    Attributes:
        device: "cpu" or "cuda" for the embedder and the consistency filter.
        embed_actors / filter_actors: actor pool sizes (``filter_actors`` 0 when the filter is off).
        threads: torch CPU threads per embed actor.
        embed_cpus / light_cpus: CPUs per embed actor and per light stage (task or filter actor).
        embed_gpus / filter_gpus: GPU share per embed actor / filter actor (0 on CPU).
        cpus / gpus: what the cluster has.
        scaled: True when the CPU shares were scaled down to fit the cluster.
    """

    device: str
    embed_actors: int
    filter_actors: int
    threads: int
    embed_cpus: float
    light_cpus: float
    embed_gpus: float
    filter_gpus: float
    cpus: float
    gpus: int
    scaled: bool = False

    def describe(self) -> str:
        """One line for the log and the manifest's ``resolved.stage_plan``."""
        gpu = f", {self.embed_gpus:g} GPU" if self.embed_gpus else ""
        line = (f"{self.embed_actors} embed actor(s) on {self.device} ({self.embed_cpus:g} CPU{gpu}, {self.threads} "
                f"thread(s) each)")
        if self.filter_actors:
            line += f", {self.filter_actors} filter actor(s) ({self.light_cpus:g} CPU"
            line += f", {self.filter_gpus:g} GPU)" if self.filter_gpus else ")"
        line += f", tasks {self.light_cpus:g} CPU; cluster {self.cpus:g} CPUs, {self.gpus} GPUs"
        return line + (" (CPU shares scaled down to fit)" if self.scaled else "")


def plan_stages(device_request: str, embed_actors: int = 0, filter_actors: int = 0, filter_enabled: bool = True,
                threads: int = 0, cpus: float | None = None, gpus: int | None = None,
                cpus_per_node: int | None = None, embed_cpus: float = 1.0, light_cpus: float = 0.5,
                embed_gpu_share: float = 0.75) -> StagePlan:
    """Fit the streaming stages to the cluster, or refuse a plan that could never run (before any work starts).

    Every stage runs at once in a streaming pipeline, so all actors plus one slot for the light tasks must fit
    together: ``embed_actors * embed_cpus + filter_actors * light_cpus + light_cpus`` (1, 0.5 and 0.5 by default:
    ``ray.embed_cpus`` / ``ray.task_cpus``). When the cluster has fewer CPUs (a 1-CPU Ray, ``ray.num_cpus=1``), every
    share is scaled by ``cpus / need`` instead of leaving Ray to wait forever for CPUs that do not exist (it used to
    hang with no message). On GPUs, each embed actor takes ``embed_gpu_share`` of a GPU (3/4) and each filter actor
    the rest, so that both pools fit one GPU.

    Args:
        device_request: ``embed.device``: "auto", "cpu" or "cuda".
        embed_actors / filter_actors: configured pool sizes; 0 is one per GPU, else 1.
        filter_enabled: whether the consistency filter runs.
        threads: ``embed.threads``; 0 divides the largest node's CPUs between the embed actors.
        cpus / gpus / cpus_per_node: the cluster's resources (default: asked of the connected Ray).
        embed_cpus / light_cpus / embed_gpu_share: ``ray.embed_cpus``, ``ray.task_cpus``, ``ray.embed_gpu_share``
            (:func:`plan_for` takes them from a config).

    Returns:
        The :class:`StagePlan`.

    Raises:
        PlanError: ``cuda`` asked for on a cluster without GPUs; more GPU actors than the GPUs can hold; a cluster
            without CPUs; more than ``MAX_ACTORS_PER_CPU`` embed actors per CPU.
    """
    import ray

    res = ray.cluster_resources() if cpus is None or gpus is None else {}
    cpus = float(res.get("CPU", 0)) if cpus is None else float(cpus)
    gpus = int(res.get("GPU", 0)) if gpus is None else int(gpus)
    if cpus <= 0:
        raise PlanError("the Ray cluster has no CPU: nothing can run (start it with --num-cpus >= 1)")
    if device_request == "cuda" and gpus == 0:
        raise PlanError("embed.device is 'cuda' but the Ray cluster has no GPU; use embed.device=auto or cpu")
    device = "cuda" if device_request == "cuda" or (device_request == "auto" and gpus > 0) else "cpu"
    on_gpu = device == "cuda"
    embed_actors = embed_actors or (gpus if on_gpu else 1)
    filter_actors = (filter_actors or (gpus if on_gpu else 1)) if filter_enabled else 0
    embed_gpus, filter_gpus = (embed_gpu_share, 1.0 - embed_gpu_share) if on_gpu else (0.0, 0.0)
    if on_gpu and embed_actors * embed_gpus + filter_actors * filter_gpus > gpus + 1e-9:
        raise PlanError(f"{embed_actors} embed actor(s) x {embed_gpus:g} GPU + {filter_actors} filter actor(s) x "
                        f"{filter_gpus:g} GPU do not fit the cluster's {gpus} GPU(s); set embed.num_actors and "
                        f"consistency.num_actors to at most {gpus} (0: one per GPU)")
    if embed_actors > MAX_ACTORS_PER_CPU * cpus:
        raise PlanError(f"embed.num_actors = {embed_actors} on {cpus:g} CPU(s): more than {MAX_ACTORS_PER_CPU} "
                        "actors per CPU; lower embed.num_actors")
    light = light_cpus
    need = embed_actors * embed_cpus + filter_actors * light + light
    scaled = need > cpus + 1e-9
    if scaled:
        factor = cpus / need
        embed_cpus, light = embed_cpus * factor, light * factor
    if not threads:
        per_node = cpus_per_node if cpus_per_node is not None else cluster_cpus_per_node()
        threads = max(1, int(per_node) // embed_actors)
    return StagePlan(device, embed_actors, filter_actors, threads, round(embed_cpus, 4), round(light, 4), embed_gpus,
                     filter_gpus, cpus, gpus, scaled)


def plan_for(cfg, filter_actors: int, filter_enabled: bool = True, embed_actors: int | None = None,
             **cluster) -> StagePlan:
    """:func:`plan_stages` with a command's config: ``embed.device``, ``embed.num_actors`` (unless ``embed_actors``
    is given), ``embed.threads`` and the shares ``ray.embed_cpus``, ``ray.task_cpus``, ``ray.embed_gpu_share``. The
    one place mine, filter-pairs and negatives decide where their stages run. ``cluster``: ``cpus`` / ``gpus`` /
    ``cpus_per_node`` instead of asking the connected Ray. Raises PlanError as plan_stages."""
    r = cfg.ray
    return plan_stages(cfg.embed.device, cfg.embed.num_actors if embed_actors is None else embed_actors,
                       filter_actors, filter_enabled, cfg.embed.threads, embed_cpus=r.embed_cpus,
                       light_cpus=r.task_cpus, embed_gpu_share=r.embed_gpu_share, **cluster)


class StallError(PairmineError, RuntimeError):
    """A pipeline made no progress for longer than ``ray.stall_limit_s`` (the message names what Ray cannot place).
    User-fixable: the message says what to change (resources, actors, the limit)."""


def pending_demands() -> list[tuple[dict, int]]:
    """Resource bundles Ray has been asked for but cannot place now, with their counts: ``[({'CPU': 1.0}, 1)]``.

    From the GCS's cluster status (what ``ray status`` prints as "Pending Demands"); empty when it cannot be read
    or this process is not connected to a Ray.
    """
    import ray

    if not ray.is_initialized():  # a diagnostic never starts a Ray (ray.get_runtime_context() would)
        return []
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        return [(dict(b.bundle), int(b.count)) for d in status.resource_demands.ray_task_actor_demand
                for b in d.bundles_by_count]
    except Exception as e:  # noqa: BLE001 - a diagnostic only: never let it end the run
        log.debug("cannot read Ray's pending demands: %s", e)
        return []


STORE_FULL = 0.9  # object store share in use above which a stall names it
DISK_FULL = 0.95  # Ray's own limit: local_fs_capacity_threshold, above which it refuses to create objects


def pressure_phrase(used: int, capacity: int, spilled: int, pulls_queued: bool, disk_used: float | None,
                    disk_free: int | None, temp_dir: str) -> str:
    """The part of a stall message that names the object store and the spill disk, from Ray's own figures (see
    :func:`store_pressure`); "" when neither is under pressure.

    Args:
        used, capacity: object store bytes in use and available in all (all nodes).
        spilled: bytes spilled to disk since Ray started (all nodes); named when it grew since the last call (a
            spill long past is not why a run stalls now). pulls_queued: fetches wait for store memory.
        disk_used: share of the disk holding Ray's temp folder in use (the driver's node), or None if unknown.
        disk_free: its free bytes. temp_dir: that folder (where Ray spills by default).
    """
    mib = 1024 * 1024
    parts = []
    if disk_used is not None and disk_used >= DISK_FULL:
        parts.append(f"the disk of Ray's temp folder {temp_dir} is {100 * disk_used:.0f}% full ({(disk_free or 0) // mib} "
                     f"MiB free; Ray refuses new objects above {100 * DISK_FULL:.0f}%): free it or give the node a larger "
                     "spill volume")
    if spilled > _spilled_seen[0] or (capacity and used / capacity >= STORE_FULL) or pulls_queued:
        full = f"{100 * used / capacity:.0f}% full" if capacity else "full"
        parts.append(f"Ray is spilling objects to disk ({spilled // mib} MiB spilled so far; object store {full}"
                     f"{', fetches waiting for store memory' if pulls_queued else ''}): lower the batch sizes or give "
                     "the nodes a larger object store")
    _spilled_seen[0] = max(_spilled_seen[0], spilled)
    return "; ".join(parts)


_spilled_seen = [0]  # the spilled bytes the last pressure_phrase saw (this process)


def store_pressure() -> str:
    """:func:`pressure_phrase` from the running Ray: the object store's use and spilled bytes over all nodes (the
    raylets' aggregate store stats, what ``ray memory --stats-only`` prints), and the disk of this node's Ray temp
    folder. "" when nothing is under pressure, Ray cannot be read, or this process is not connected."""
    import shutil

    import ray

    if not ray.is_initialized():
        return ""
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        st = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address),
                                   timeout_seconds=10).store_stats
        node = ray._private.worker._global_node
        temp_dir = node.get_temp_dir_path() if node is not None else "/tmp/ray"
        try:
            disk = shutil.disk_usage(temp_dir)
            disk_used, disk_free = disk.used / disk.total, disk.free
        except OSError:
            disk_used = disk_free = None
        return pressure_phrase(int(st.object_store_bytes_used), int(st.object_store_bytes_avail),
                               int(st.spilled_bytes_total), bool(st.object_pulls_queued), disk_used, disk_free,
                               temp_dir)
    except Exception as e:  # noqa: BLE001 - a diagnostic only: never let it end the run
        log.debug("cannot read Ray's object store stats: %s", e)
        return ""


def stall_report(stages: list[Stage], idle_s: float, progress: str) -> str:
    """One line on a pipeline that made no progress for ``idle_s`` seconds: spilling or a full spill disk when Ray's
    own state shows it (:func:`store_pressure`), else what Ray cannot place (and which stages ask for exactly that),
    then the alive nodes and their free resources.

    Args:
        stages: the pipeline's stages (their per-task/actor resources name the waiting stage).
        idle_s: seconds since the last completed batch.
        progress: what was done so far, e.g. "120 / 827 documents".
    """
    import ray

    def fmt(bundle: dict) -> str:
        return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(bundle.items()) if v) + "}"

    parts = []
    for bundle, count in pending_demands():
        asks = {k: v for k, v in bundle.items() if v}
        names = [st.name for st in stages
                 if {k: v for k, v in (("CPU", st.num_cpus), ("GPU", st.num_gpus)) if v} == asks]
        parts.append(f"{fmt(bundle)} x {count}" + (f" (stage {', '.join(names)})" if names else ""))
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        free = fmt({k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")})
    except Exception:  # noqa: BLE001
        nodes, free = [], "?"
    where = f"{len(nodes)} node(s) alive, free {free}"
    pressure = store_pressure()
    head = f"nothing completed for {idle_s:.0f} s ({progress}); " + (f"{pressure}; " if pressure else "")
    if parts:
        return f"{head}Ray cannot place {'; '.join(parts)}; {where}"
    if pressure:  # Ray's own state says why; the generic guess would mislead
        return f"{head}{where}"
    busy = ", ".join(f"{st.name} ({st.actors} actor(s))" if st.actors else st.name for st in stages)
    return (f"{head}no resource demand is pending, so a stage is running "
            f"but not finishing (a frozen or very slow worker?); stages: {busy}; {where}")


PROGRESS_EVERY_S = 10.0  # a pass over loose passages (the pool, a negatives corpus) logs its progress this often


def watched(items, stages: list[Stage], progress: Callable[[], str], warn_s: float, limit_s: float, hint: str = "",
            every_s: float = 0.0, label: str = ""):
    """Yield from ``items`` (a Ray Data iterator), watching for a pipeline that stops making progress.

    With ``every_s``, a long pass is not silent either: once the caller has taken an item, ``"label: progress()"``
    is logged if ``every_s`` seconds have passed since the last such line (:data:`PROGRESS_EVERY_S` for the passes
    over loose passages: the pool, a negatives corpus).

    While nothing arrives for ``warn_s`` seconds, a warning (:func:`stall_report`) is logged every ``warn_s``
    seconds (before the first item, while Ray has no demand it cannot place, an info line that the first batch is
    on its way instead: on CPU a first batch takes a minute). While Ray has no demand it cannot place (every stage
    is running), the wait before "a stage is running but not finishing" is at least twice the longest wait between
    two items so far (the first included): a pass whose every call takes longer than ``warn_s`` (1,024 long corpus
    passages through a CPU embedder take ~80 s) is slow, not frozen, and is not warned about at each call; what
    Ray cannot place is still reported after ``warn_s``. After ``limit_s`` seconds without progress (0: never)
    :class:`StallError` ends the wait, and Ctrl-C (KeyboardInterrupt) ends it the same way before it propagates.
    The iterator is drained in a daemon thread, so the wait can end even while Ray blocks. Before the error is
    raised, the driver's running Ray Data executions are shut down and the draining thread is given up to 30 s to
    end, so nothing of the abandoned run still talks to Ray when the caller shuts Ray down.

    Raises:
        StallError: no item for ``limit_s`` seconds; the message is the last report plus ``hint``.
        Exception: whatever the iterator raised.
    """
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=64)
    end = object()

    def drain() -> None:
        try:
            for item in items:
                q.put(("item", item))
            q.put(("end", end))
        except BaseException as e:  # noqa: BLE001 - handed to the consuming thread
            q.put(("error", e))

    thread = threading.Thread(target=drain, name="pairmine-stream", daemon=True)
    thread.start()
    last = warned = logged = time.time()
    first = True  # nothing has arrived yet
    longest = 0.0  # the longest wait between two items so far (the wait for the first included), seconds
    while True:
        try:
            kind, value = q.get(timeout=min(5.0, max(warn_s, 0.5)))
        except KeyboardInterrupt:  # Ctrl-C: end the execution before the caller shuts Ray down (no tracebacks)
            _stop_execution(thread, q, RuntimeError("interrupted"))
            raise
        except queue.Empty:
            now = time.time()
            idle = now - last
            if limit_s and idle >= limit_s:
                error = StallError(f"stalled: {stall_report(stages, idle, progress())}" + (f"; {hint}" if hint else ""))
                _stop_execution(thread, q, error)
                raise error
            if idle >= warn_s and now - warned >= warn_s:
                placed = not pending_demands()  # every stage is running (nothing waits for resources)
                if placed and not first and idle < 2 * longest:
                    continue  # no longer than calls have taken so far: slow, not frozen
                warned = now
                if first and placed and not store_pressure():
                    # Before the first batch, with every stage placed: a first batch (model loads, a batch of
                    # documents through a CPU embedder) takes a while; not a warning yet.
                    log.info("nothing completed yet after %.0f s (%s): every stage is placed and running, the first "
                             "batch is still on its way", idle, progress())
                else:
                    log.warning("%s", stall_report(stages, idle, progress()))
            continue
        if kind == "end":
            return
        if kind == "error":
            raise value
        now = time.time()
        longest = max(longest, now - last)
        last = warned = now
        first = False
        yield value
        if every_s and time.time() - logged >= every_s:  # the caller has taken the item: progress() counts it
            logged = time.time()
            log.info("%s%s", f"{label}: " if label else "", progress())


def _stop_execution(thread, q, error: Exception) -> None:
    """Shut down this process's running Ray Data executions (their actors are killed), then wait for the draining
    thread to end.

    Ray Data has no public call to abandon an iteration. Its ``StreamingExecutor`` runs as a thread of the driver
    (and a Dataset only records it once the first block has arrived), so the running ones are found among the
    process's threads; ``shutdown(force=True)`` is what Ray Data itself calls when an iteration ends early.
    Without this, an abandoned executor keeps polling, and once the caller shuts Ray down it logs tracebacks and
    even starts a new local Ray from its thread. Failures here are logged at debug level and ignored: the stall
    is what the caller reports.
    """
    import queue
    import threading

    try:
        from ray.data._internal.execution.streaming_executor import StreamingExecutor
    except ImportError:  # a Ray without it: nothing to stop
        return
    executors = [t for t in threading.enumerate() if isinstance(t, StreamingExecutor)]
    for executor in executors:
        try:
            executor.shutdown(force=True, exception=error)
        except Exception as e:  # noqa: BLE001 - best effort; the stall error follows
            log.debug("shutting down the stalled execution failed: %s", e)
    if not executors:
        return
    deadline = time.time() + 30
    while thread.is_alive() and time.time() < deadline:
        try:  # keep the bounded queue from blocking the draining thread
            q.get(timeout=0.2)
        except queue.Empty:
            pass
    if thread.is_alive():
        log.debug("the stalled stream did not end within 30 s")


def configure_data(target_block_mb: float) -> None:
    """Ray Data settings for pairmine's pipelines.

    Measured on the sample: with Ray's default 128 MB block target, a whole row group leaves the embed actor as one
    block at the end of its task and the later stages wait; ~1 MB blocks stream batch by batch. Off a terminal,
    Ray's progress bars become a multi-line status block every few seconds; pairmine's own progress lines replace
    them there.
    """
    import sys

    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.target_max_block_size = int(target_block_mb * 1024 * 1024)
    if not sys.stderr.isatty():
        ctx.enable_progress_bars = False


def cluster_gpus() -> int:
    """GPUs in the connected Ray cluster (0 on a CPU-only cluster)."""
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def cluster_cpus_per_node() -> int:
    """CPUs of the largest alive node (to size the embedder's torch threads)."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = [int(n["Resources"].get("CPU", 0)) for n in nodes]
    return max(cpus) if cpus else os.cpu_count() or 1


def run_remote(fn: Callable, args_list: list[tuple], num_cpus: float = 1.0) -> list:
    """Run ``fn(*args)`` for every args tuple as Ray tasks; results in input order."""
    import ray

    return ray.get(submit(fn, args_list, num_cpus=num_cpus))


def iter_block_refs(ds):
    """Run ``ds`` and yield ``(block ObjectRef, rows, bytes)`` for each output block as it completes, without fetching
    any data into this process: the blocks stay in Ray's object store (spilled to disk when it is full) for as long
    as the caller holds the refs. (Ray Data's ``iter_internal_ref_bundles``, a developer API; ``materialize`` runs the
    same way but shows no progress until it ends.)"""
    for bundle in ds.iter_internal_ref_bundles():
        for ref, meta in zip(bundle.block_refs, bundle.metadata):
            yield ref, int(meta.num_rows or 0), int(meta.size_bytes or 0)


def submit(fn: Callable, args_list: list[tuple], num_returns: int = 1, num_cpus: float = 1.0) -> list:
    """``fn(*args)`` as a Ray task for every args tuple (``fn`` exported once); their ObjectRefs (a list of
    ``num_returns`` refs per task when it is above 1), in input order, without waiting. ObjectRefs among the args
    arrive as their values."""
    import ray

    remote = ray.remote(fn).options(num_returns=num_returns, num_cpus=num_cpus)
    return [remote.remote(*args) for args in args_list]


def stage_figures(ds, prefix: str = "") -> list[dict]:
    """Per-stage figures of a finished Ray Data execution, from Ray Data's own execution stats (the summary behind
    ``Dataset.stats()``), in pipeline order.

    Ray fuses neighbouring stages with the same resources into one operator (e.g. ``read->chunk``): such stages
    share one entry, named by all of them. Returns a list of dicts: ``stage`` (name), ``wall_s`` (first task start
    to last task end, seconds), ``busy_s`` (task wall time summed over tasks: > wall_s when tasks run in parallel),
    ``cpu_s`` (task CPU time summed), ``tasks``, ``rows_out``. Empty when Ray gives no summary."""
    try:
        summary = ds._get_stats_summary()  # noqa: SLF001 - what Dataset.stats() formats; no public structured form
    except Exception:  # noqa: BLE001 - figures are informative; a Ray change must not fail a run
        return []
    chain, seen = [], set()

    def walk(s) -> None:
        for parent in getattr(s, "parents", None) or []:
            walk(parent)
        if id(s) not in seen:
            seen.add(id(s))
            chain.append(s)

    walk(summary)
    out = []
    for s in chain:
        for op in getattr(s, "operators_stats", None) or []:
            name = re.sub(r"MapBatches\((\w+)\)", r"\1", op.operator_name or "").replace("->", "+").lower()
            if not name or name.startswith(("input", "readrange", "fromitems")):  # the source, not a stage
                continue
            total = lambda st: float(st.sum) if st is not None and st.sum is not None else 0.0  # noqa: E731
            out.append({
                "stage": prefix + name, "wall_s": round(float(op.time_total_s or 0.0), 2),
                "busy_s": round(total(op.wall_time), 2), "cpu_s": round(total(op.cpu_time), 2),
                "tasks": int(op.wall_time.count) if op.wall_time is not None and op.wall_time.count else 0,
                "rows_out": int(total(op.output_num_rows)),
            })
    return out


def timing_lines(phases: dict[str, float], figures: list[dict], note: str = "") -> list[str]:
    """A run's final timing log lines: ``phases (wall s): start 6.0, first pass 12.9, ...[; note]`` (none when
    ``phases`` is empty), then ``stage figures: ...``, the table of :func:`format_stage_figures`."""
    lines = []
    if phases:
        walls = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f}" for name, seconds in phases.items())
        lines.append(f"phases (wall s): {walls}" + (f"; {note}" if note else ""))
    return lines + [f"stage figures: {line}" for line in format_stage_figures(figures)]


def format_stage_figures(figures: list[dict]) -> list[str]:
    """Lines of a small fixed-width table of :func:`stage_figures` (for the log)."""
    if not figures:
        return []
    w = max(len(f["stage"]) for f in figures)
    lines = [f"{'stage':<{w}}  {'wall s':>8}  {'busy s':>8}  {'cpu s':>8}  {'tasks':>6}  {'rows out':>9}"]
    lines += [f"{f['stage']:<{w}}  {f['wall_s']:>8.1f}  {f['busy_s']:>8.1f}  {f['cpu_s']:>8.1f}  {f['tasks']:>6}  "
              f"{f['rows_out']:>9}" for f in figures]
    return lines
