"""Rollout engines outside the trainer: external servers, Serve replicas, the scaling API (sections: engines)"""

from __future__ import annotations

import re
from typing import Literal, Self

from pydantic import BaseModel, model_validator

from relax.config.base import flag, setting


class EngineSettings(BaseModel):
    """Rollout engines outside the trainer: external servers, Serve replicas, the scaling API."""
    rollout_external: bool = setting(
        False,
        "Generate with inference servers started outside the run (`relax serve`, SGLang, vLLM) at "
        "--rollout-external-engine-addrs instead of an in-process engine; requests go through a router "
        "(least outstanding requests, one prompt group per server, retry on another server when one fails). "
        "See docs/engines.md.",
        "engines",
    )
    rollout_external_engine_addrs: list[str] = setting(
        [], "Base URLs of the external servers, e.g. `http://10.0.0.5:30000 http://10.0.0.6:30000`.", "engines"
    )
    rollout_engine_protocol: Literal["sglang", "openai", "vllm", "relax"] = setting(
        "sglang",
        "Protocol of the external servers: `sglang` (native /generate; `relax serve` and SGLang), `openai` "
        "(/v1/completions; weight updates need the server's /update_weights_from_disk), `vllm` (relax starts a "
        "vLLM server at each address, which must be http://127.0.0.1:PORT, from .venv-vllm or $RELAX_VLLM_PYTHON, "
        "and reloads its weights in place) or `relax` (relax starts a `relax serve` process at each "
        "http://127.0.0.1:PORT, on the trainer's device and dtype: each engine in a process of its own; "
        "docs/engines.md).",
        "engines",
    )
    rollout_health_check_interval: float = setting(
        30.0, "Seconds between health checks of an external engine while it has requests in flight (upstream's "
        "default); one that fails --rollout-health-check-max-consecutive-failures of them in a row (hung, stopped, "
        "unreachable) is given up on and its request groups go to another engine.", "engines", gt=0,
    )
    rollout_health_check_timeout: float = setting(
        30.0, "Seconds a health check may take before it counts as failed.", "engines", gt=0,
    )
    rollout_health_check_max_consecutive_failures: int = setting(
        2, "Failed health checks in a row after which an engine with requests in flight is given up on.", "engines",
        ge=1,
    )
    use_fault_tolerance: bool = setting(
        False, "Relaunch the rollout engines this run starts (--rollout-engine-protocol relax or vllm) when they die "
        "or stop answering health checks: the process group is killed, started again and loaded with the current "
        "weights before it gets work, while its request groups go to the other engines (or wait for it; "
        "upstream's flag; docs/fault_tolerance.md). The embedded engine recovers in place from an out-of-memory "
        "error instead (its core rebuilt, the failed requests decoded again with their seeds). Servers started "
        "outside the run are routed around and probed again without it.", "engines",
    )
    rollout_engine_max_relaunches: int = setting(
        3, "Relaunches per engine (in-place recoveries of the embedded engine) under --use-fault-tolerance; after "
        "them a failing engine stays down.", "engines",
        ge=1,
    )
    rollout_engine_api_key: str | None = setting(
        None, "Bearer token of the external servers' control endpoints (never logged, never saved).",
        "engines", secret=True,
    )
    rollout_weights_dir: str | None = setting(
        None,
        "Where the trainer writes new weights (versioned safetensors) for the external servers to load; they "
        "must read it at the same path (a shared filesystem). Default: <output-dir>/engine_weights.",
        "engines", path=True,
    )
    rollout_weight_sync_address: str = setting(
        "127.0.0.1",
        "With --rollout-external and --weight-sync-transport broadcast: the trainer's address the servers "
        "connect to for the weight-sync group (the trainer binds it).",
        "engines",
    )
    rollout_api_port: int | None = setting(
        None,
        "Serve the rollout engines' elastic-scaling REST API (/scale_out, /scale_in, /engines; docs/engines.md) on "
        "127.0.0.1:PORT while training, so engines can be added and removed during the run (`relax scale`); under "
        "--placement ray the rollout role's process serves it, on its node.",
        "engines",
        ge=1,
        le=65535,
    )
    rollout_serve_replicas: int = setting(
        0,
        "Run the rollout engines as a Ray Serve deployment of this many replicas (each an embedded engine in a Ray "
        "process of its own; a local Ray on 127.0.0.1 is started when none runs): Serve routes the calls (one per "
        "replica, whole prompt groups) to replicas, health-checks them every --rollout-health-check-interval s and "
        "replaces a dead one (its calls are sent again), and the scaling API's num_replicas sets the replica count. Weights reach the "
        "replicas as versioned safetensors under --rollout-weights-dir. 0: the engine in the trainer's process. "
        "docs/placement.md.",
        "engines",
        ge=0,
        le=1024,
    )
    rollout_num_gpus_per_engine: float = setting(
        1.0, "GPUs each Serve replica reserves on CUDA (upstream's flag; a fraction shares a GPU between replicas, "
        "or with the trainer).", "engines", gt=0,
    )
    rollout_api_key: str | None = setting(
        None, "Bearer token the scaling API's control endpoints require (default: $RELAX_API_KEY, as `relax serve` "
        "and `relax scale`; never logged, never saved).",
        "engines", secret=True,
    )
    scale_out_max_engines: int = setting(
        32,
        "Most rollout engines a scale-out may bring the run to (each embedded engine holds a copy of the model); "
        "a larger num_replicas is rejected.",
        "engines",
        ge=1,
        le=1024,
    )
    scale_in_drain_timeout: float = setting(
        60.0, "Seconds a scale-in waits for an engine's requests before it leaves the router (they still finish).",
        "engines",
        gt=0,
    )

    @model_validator(mode="after")
    def _check_external_engines(self) -> Self:
        if self.rollout_api_port is None:
            set_flags = [flag(name) for name in ("rollout_api_key", "scale_out_max_engines", "scale_in_drain_timeout")
                         if self.changed(name)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('rollout_api_port')}")
        if self.rollout_serve_replicas:
            serve = flag("rollout_serve_replicas")
            if self.rollout_external:
                raise ValueError(f"{serve} and {flag('rollout_external')} both name the rollout engines; external "
                                 "servers join a Serve run through the scaling API (/scale_out with engine_urls)")
            if self.colocate:
                raise ValueError(f"{serve} keeps each engine in a Ray process of its own, whose memory is not "
                                 f"handed to the trainer between phases: drop {flag('colocate')}")
        elif self.changed("rollout_num_gpus_per_engine"):
            raise ValueError(f"{flag('rollout_num_gpus_per_engine')} needs {flag('rollout_serve_replicas')}")
        if self.changed("rollout_engine_max_relaunches") and not self.use_fault_tolerance:
            raise ValueError(f"{flag('rollout_engine_max_relaunches')} needs {flag('use_fault_tolerance')}")
        if (self.use_fault_tolerance and self.rollout_external
                and self.rollout_engine_protocol not in ("relax", "vllm")):
            protocol = flag("rollout_engine_protocol")
            raise ValueError(f"{flag('use_fault_tolerance')} relaunches the engines this run starts ({protocol} "
                             f"relax or vllm) or recovers the embedded one in place; servers started outside the run "
                             f"({protocol} {self.rollout_engine_protocol}) are routed around and probed again "
                             "without it")
        if not self.rollout_external:
            set_flags = [flag(name) for name in ("rollout_external_engine_addrs", "rollout_engine_api_key",
                                                 "rollout_weights_dir", "rollout_engine_protocol",
                                                 "rollout_weight_sync_address")
                         if self.changed(name) and not (name == "rollout_weights_dir" and self.rollout_serve_replicas)]
            if set_flags:
                raise ValueError(f"{', '.join(set_flags)} {'needs' if len(set_flags) == 1 else 'need'} "
                                 f"{flag('rollout_external')}")
            return self
        if not self.rollout_external_engine_addrs:
            raise ValueError(f"{flag('rollout_external')} needs {flag('rollout_external_engine_addrs')} (one base URL "
                             "or more)")
        for address in self.rollout_external_engine_addrs:
            if not address.startswith(("http://", "https://")) or len(address.split("://", 1)[1].strip("/")) == 0:
                raise ValueError(f"{flag('rollout_external_engine_addrs')}: {address!r} is not a base URL "
                                 "(http://host:port)")
        if len({a.rstrip("/") for a in self.rollout_external_engine_addrs}) != len(self.rollout_external_engine_addrs):
            raise ValueError(f"{flag('rollout_external_engine_addrs')}: an address is listed twice")
        if self.rollout_engine_protocol in ("vllm", "relax"):
            for address in self.rollout_external_engine_addrs:
                if not re.fullmatch(r"http://127\.0\.0\.1:\d{1,5}/?", address) or not 0 < int(
                        address.rstrip("/").rsplit(":", 1)[1]) < 65536:
                    raise ValueError(f"{flag('rollout_engine_protocol')} {self.rollout_engine_protocol} starts the "
                                     f"servers on this machine: {flag('rollout_external_engine_addrs')} {address!r} "
                                     "must be http://127.0.0.1:PORT")
        if self.weight_sync_transport == "broadcast" and self.rollout_engine_protocol not in ("sglang", "relax"):
            raise ValueError(f"{flag('weight_sync_transport')} broadcast needs {flag('rollout_engine_protocol')} "
                             "sglang or relax (OpenAI-protocol servers have no /init_weights_update_group)")
        if self.use_fault_tolerance and self.weight_sync_transport == "broadcast":
            raise ValueError(f"{flag('use_fault_tolerance')} needs {flag('weight_sync_transport')} disk: a relaunched "
                             "engine loads the current weights from --rollout-weights-dir (a new process cannot "
                             "join the running broadcast group)")
        if self.multimodal_keys:
            raise ValueError(f"{flag('rollout_external')} does not take {flag('multimodal_keys')} yet (media are not "
                             "sent over HTTP)")
        return self
