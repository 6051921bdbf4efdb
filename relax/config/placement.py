"""Execution mode (sync, fully async, hybrid) and where roles run (sections: mode, placement)"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, field_validator, model_validator

from relax.config.base import flag, setting


class PlacementSettings(BaseModel):
    """Execution mode (sync, fully async, hybrid) and where roles run."""
    colocate: bool = setting(
        False, "Synchronous colocated training with the trainer and the engine time-sharing the device: turns on "
        "--offload-train and --offload-rollout unless they are set (as upstream's). Without it the sync mode "
        "keeps both resident; refused with the async modes.", "mode"
    )
    offload: bool = setting(
        False, "Both --offload-train and --offload-rollout (unless set on their own).", "mode"
    )
    offload_train: bool | None = setting(
        None, "Move the trainers' weights, gradients and optimizer state (actor, reference, critic, trainer teacher) "
        "to pinned host memory while rolling out; they come back for training (default: --offload or --colocate).",
        "mode",
    )
    offload_rollout: bool | None = setting(
        None, "Free the embedded engine's KV pool, CUDA graphs and weights while training; its weights are re-sent "
        "with the next weight sync (default: --offload or --colocate).", "mode",
    )
    fully_async: bool = setting(
        False,
        "Rollout runs ahead of training through the data plane, by at most --max-staleness weight versions.",
        "mode",
    )
    hybrid: bool = setting(
        False,
        "Rollout runs ahead as in --fully-async, while the reference, old-policy forwards and advantages run over "
        "whole steps inside the trainer's step (under --placement ray the reference lives in the actor's "
        "processes), as upstream's hybrid; --partial-rollout is refused. Exclusive with --fully-async "
        "(docs/modes.md).",
        "mode",
    )
    colocate_async: bool = setting(
        False,
        "Overlapped colocated mode: --fully-async with the embedded engine on the trainer's device, the engine "
        "generating step s+1 while the trainer trains step s (the trainer on a thread and CUDA stream of its own, "
        "the engine decoding on the event loop's). --max-staleness defaults to 1 (one step off-policy; TIS and the "
        "per-token weight versions as in --fully-async). Both stay resident: the offload flags are refused "
        "(docs/modes.md).",
        "mode",
    )
    max_staleness: int = setting(
        0,
        "How many weight versions rollout may run ahead of training (0: each step waits for the previous "
        "update). Samples older than this when trained on are dropped and counted (data/dropped_stale_groups).",
        "mode",
        ge=0,
    )
    partial_rollout: bool = setting(
        False,
        "Let a weight update land while responses are being generated (they continue with the new weights; "
        "each token records its version) instead of waiting for the generation in flight.",
        "mode",
    )
    data_wait_timeout: float = setting(
        3600.0,
        "Longest wait (seconds) in the async modes for a rollout step's data, a staleness slot or the end of the "
        "generation before a weight push; past it the run stops with an error naming what it waited for.",
        "mode",
        gt=0,
    )
    train_stream_chunks: int = setting(
        4,
        "--fully-async: the trainer reads a step's groups as they land and trains on them in up to this many chunks "
        "(each every group that landed while the last one trained, at least 1/N of the step; a step already in is "
        "one chunk) before the last group arrives (one optimizer step; the loss's global denominators are rescaled "
        "at the end, so the update equals training on the whole step). 1 waits for the whole step. Steps that need "
        "the whole batch first (old-policy log-probs, a critic, whitened or KL-shaped advantages) always wait.",
        "mode",
        ge=1,
    )
    over_sampling_batch_size: int | None = setting(
        None,
        "Prompt groups kept outstanding across steps (upstream's flag; default --rollout-batch-size: each step's "
        "rollout is one generation that ends with its slowest group). Above --rollout-batch-size B, with "
        "--fully-async (or --colocate-async) and --partial-rollout: each step takes the first B groups to finish, "
        "and the groups still decoding go on into the next steps under --max-staleness instead of holding the step "
        "(docs/modes.md, 'Partial rollout across steps').",
        "mode",
        ge=1,
    )
    mask_offpolicy_in_partial_rollout: bool = setting(
        False, "With --partial-rollout, keep only the tokens of the newest weight version in the loss.", "mode"
    )
    placement: Literal["in_process", "ray"] = setting(
        "in_process",
        "Where the roles run. `in_process`: every role is an object in the trainer's process (no Ray). `ray`: "
        "actor, rollout, critic and reference each run in their own Ray actor process, in placement groups sized "
        "by --resource; the controller drives them over the same async API (docs/placement.md).",
        "placement",
    )
    resource: dict[str, list[float]] = setting(
        {},
        "With --placement ray: JSON mapping a role (actor, rollout, critic, reference, advantages, genrm) to "
        "[replicas, gpus_per_replica], e.g. '{\"actor\": [1, 1], \"rollout\": [1, 1]}'. On a machine without GPUs "
        "the second number is CPUs per replica. Roles left out get [1, 1]. actor, critic and reference take N "
        "replicas as N processes of one FSDP2 process group (each trains on its share of every batch); rollout "
        "takes 1. advantages (default: the controller's process) and genrm (the --genrm-model-path judge; default: "
        "the rollout's process) get a process of their own only when named. actor_fwd is refused: the actor's "
        "processes compute the old-policy log-probs.",
        "placement",
    )
    ray_address: str | None = setting(
        None, "With --placement ray: join this running Ray cluster (e.g. `auto` or `127.0.0.1:6379`) instead of "
        "starting a local Ray bound to 127.0.0.1.", "placement",
    )
    weight_sync_transport: Literal["broadcast", "disk"] | None = setting(
        None,
        "How new weights reach engines in other processes. `broadcast`: torch.distributed broadcast over a "
        "dedicated group (gloo on CPU, NCCL on GPU; external servers join it through /init_weights_update_group); "
        "`disk`: versioned safetensors (under <output-dir>/weight_sync with --placement ray, under "
        "--rollout-weights-dir for external servers, which must see that path). Default: `broadcast` with "
        "--placement ray, `disk` with --rollout-external.",
        "placement",
    )
    update_weight_buffer_size: int = setting(
        512 * 1024 * 1024,
        "Bytes per bucket of a weight sync (upstream's flag and default, 512 MiB): the trainer gathers and sends "
        "its weights one bucket at a time, so this bounds the extra memory a sync takes and the size of each "
        "collective or safetensors file.",
        "placement",
        ge=1,
    )

    @model_validator(mode="before")
    @classmethod
    def _colocate_async_is_fully_async(cls, settings: Any) -> Any:
        """--colocate-async is --fully-async on one device, one step off-policy unless --max-staleness says more
        (as upstream's --hybrid turns on its fully_async internally). Its own misuses are named here, before the
        fully-async rules would name a flag the user did not pass."""
        if not isinstance(settings, dict) or not settings.get("colocate_async"):
            return settings
        for other in ("hybrid", "colocate"):
            if settings.get(other):
                raise ValueError(f"{flag('colocate_async')} and {flag(other)} are exclusive modes")
        if settings.get("max_staleness") == 0:
            raise ValueError(f"{flag('colocate_async')} overlaps step s+1's rollout with step s's training: it needs "
                             f"{flag('max_staleness')} >= 1, got 0 (0 is the synchronous --colocate)")
        return {**settings, "fully_async": True, "max_staleness": settings.get("max_staleness") or 1}

    @field_validator("resource", mode="before")
    @classmethod
    def _resource_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(f"--resource is not valid JSON: {err}") from None
        return value

    @model_validator(mode="after")
    def _check_placement(self) -> Self:
        placeable = ("actor", "rollout", "critic", "reference", "advantages", "genrm")
        for role, value in self.resource.items():
            if role == "actor_fwd":
                raise ValueError("--resource actor_fwd: Relax computes the old-policy log-probs in the actor's own "
                                 "processes, with the weights the update starts from (a separate actor_fwd holds "
                                 "the version it last received, so its ratio would measure the sync lag); leave "
                                 "the entry out, the actor's resources cover it (docs/placement.md)")
            if role not in placeable:
                raise ValueError(f"--resource: unknown role {role!r}; choose among {list(placeable)}")
            if len(value) != 2 or value[0] != int(value[0]) or value[0] < 1 or value[1] < 0:
                raise ValueError(f"--resource {role}: expects [replicas >= 1, gpus_per_replica >= 0], got {value}")
            if value[0] != 1 and role == "rollout":
                raise ValueError(f"--resource rollout: one rollout process (it holds the prompt cursor and the "
                                 f"rewards), got {int(value[0])}; several engines: --rollout-serve-replicas with "
                                 "the in-process placement, or --rollout-external servers")
            if value[0] != 1 and role in ("advantages", "genrm"):
                raise ValueError(f"--resource {role}: one process (it reads each step's groups once, in order), "
                                 f"got {int(value[0])}")
        if "genrm" in self.resource and self.genrm_model_path is None:
            raise ValueError("--resource genrm: places the judge model of --genrm-model-path, which is not set")
        if self.placement != "ray":
            for name in ("resource", "ray_address"):
                if getattr(self, name):
                    raise ValueError(f"{flag(name)} needs --placement ray")
            if self.weight_sync_transport is not None and not self.rollout_external:
                raise ValueError(f"{flag('weight_sync_transport')} needs --placement ray or --rollout-external")
        elif self.use_opd:
            raise ValueError("--placement ray does not support --use-opd yet; use --placement in_process")
        return self
