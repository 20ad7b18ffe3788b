"""The one place where operators meet Ray: a :class:`Stage` declares what an operator needs (data, not code), and
:func:`apply_stage` turns it into ``Dataset.map_batches``.

Operators are plain callables over pyarrow Tables and never import ray. A stage with ``actors > 0`` runs in an
actor pool (one operator instance, e.g. one loaded model, per actor); otherwise it runs as stateless tasks, which
Ray Data fuses with their neighbours.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """How one operator runs on Ray.

    Attributes:
        name: shown in Ray's progress bars and logs.
        make: zero-argument factory returning the operator (called once per actor, or once in the driver for tasks).
        batch_size: rows per call (None: a whole block).
        actors: size of the actor pool; 0 runs the operator as tasks.
        num_cpus / num_gpus: resources per task or actor.
    """

    name: str
    make: Callable[[], Callable]
    batch_size: int | None = None
    actors: int = 0
    num_cpus: float = 1.0
    num_gpus: float = 0.0


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
    if stage.actors > 0:
        # A class per stage with the factory in its closure, so Ray's logs and progress name the stage.
        make = stage.make
        cls = type(stage.name.title(), (_ActorOperator,), {"__init__": lambda self: _ActorOperator.__init__(self, make)})
        return ds.map_batches(cls, compute=ray.data.ActorPoolStrategy(size=stage.actors), **common)
    op = stage.make()
    op.__name__ = stage.name  # Ray names the task after the callable
    return ds.map_batches(op, **common)


def init_ray(address: str = "", num_cpus: int = 0) -> str:
    """Connect to the Ray cluster at ``address`` (else ``$RAY_ADDRESS``), or start a private local Ray.

    With no address, pairmine never joins a cluster that happens to run on the machine (a plain ``ray.init()``
    attaches to the latest ``ray start`` cluster and dies with it): it starts its own (``address="local"``).

    Args:
        address: a Ray address (``host:port``, ``ray://...``, ``auto``); empty: ``$RAY_ADDRESS``, else local.
        num_cpus: CPUs of the private local Ray (0: all of the machine's); ignored for a cluster.

    Returns:
        What was used, for the log and the manifest's ``resolved.ray``: ``"local (2 CPUs)"``,
        ``"cluster 10.0.0.5:6379 (3 node(s), 48 CPUs, 8 GPUs)"``, or ``"existing ..."`` when this process had
        already initialised Ray.
    """
    import ray

    if ray.is_initialized():
        return f"existing {describe_cluster()}"
    address = address or os.environ.get("RAY_ADDRESS", "")
    runtime_env = {"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false"}}
    if address and address != "local":
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return f"cluster {describe_cluster()}"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = dict(
        address="local", include_dashboard=False, runtime_env=runtime_env, logging_level=logging.WARNING
    )
    if num_cpus:
        kwargs["num_cpus"] = num_cpus
    ray.init(**kwargs)
    return f"local ({int(ray.cluster_resources().get('CPU', 0))} CPUs)"


def describe_cluster() -> str:
    """The connected Ray's GCS address and resources: ``"127.0.0.1:6379 (2 node(s), 2 CPUs, 0 GPUs)"``."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    res = ray.cluster_resources()
    gcs = ray.get_runtime_context().gcs_address
    return f"{gcs} ({len(nodes)} node(s), {int(res.get('CPU', 0))} CPUs, {int(res.get('GPU', 0))} GPUs)"


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

    remote = ray.remote(num_cpus=num_cpus)(fn)
    return ray.get([remote.remote(*a) for a in args_list])
