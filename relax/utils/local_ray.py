"""A Ray that Relax starts on this machine listens on 127.0.0.1 only, with no dashboard and no telemetry.

Every place that may start one (Ray placement, the TransferQueue data plane, the Serve deployment of the engines)
starts it here. Ray keeps to loopback only with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (environment-notes §2;
without it Ray turns "127.0.0.1", even an explicit ``_node_ip_address``, into the machine's interface address and
binds its GCS and raylet there). Ray reads that variable when it is imported, and in `relax train` something had
imported Ray before the variable was set (the runs of issue 28 listened on the interface): so the variable is set
for Ray's worker processes and Ray's own constant for this one. After the start the node's address is checked, and a Ray that came up on another
address is shut down with an error rather than left listening. Joining an existing cluster (``--ray-address``) is
the cluster's business: nothing is started then.
"""

from __future__ import annotations

import os
from typing import Any

LOOPBACK = "127.0.0.1"


def set_local_ray_environment() -> None:
    """Loopback only, no telemetry, no auth token file; before ``ray.init``."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its worker processes at niceness 15, as background work beside a driver; Relax's roles in them are
    # the training itself (trainer, rollout, data plane), so on a machine with other work they would starve while
    # the run's own process waits on them: they run at the run's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # Ray prestarts idle Python workers when the driver connects; Relax's processes are actors started with the
    # run's own environment, and the prestarted ones stayed idle to the end: ~2 CPU-s each, 16 of them in the
    # suite's seven-restart chaos run (30 CPU-s), with no start-up latency gained (measured on 2 cores, 2026-12-05).
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # TransferQueue warns on every put/get when its default of 8 threads exceeds the cores.
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, os.cpu_count() or 1)))


def start_local_ray(num_cpus: int, **init_kwargs: Any) -> None:
    """Start a Ray of this machine on 127.0.0.1 (no dashboard); raises if it came up on another address."""
    import ray
    from ray._private import ray_constants

    set_local_ray_environment()
    # Ray reads the variable once, when it is imported: a Ray imported earlier (by TransferQueue, by a test) would
    # still turn 127.0.0.1 into the machine's interface address. Its worker processes read the variable.
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(include_dashboard=False, num_cpus=num_cpus, log_to_driver=False, logging_level="warning",
             _node_ip_address=LOOPBACK, **init_kwargs)
    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray came up on {address}, not {LOOPBACK}: Relax starts Ray on loopback only "
                           "(check RAY_* variables of the environment, or give --ray-address of a cluster)")
