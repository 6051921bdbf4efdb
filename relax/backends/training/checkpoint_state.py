"""A training backend's state in a checkpoint: the model (and the optimizer) as a torch distributed checkpoint
under ``model_optim/`` (each rank writes its shard; a checkpoint moves between world sizes and layouts), the LR
schedule as ``lr_scheduler.pt``. `relax.core.state.checkpoint` stages, seals and verifies the folder around it.

The optimizer's state is saved flattened, every entry keyed by its parameter's name (``state.<name>.exp_avg``,
``param_groups.<name>.lr``), not by the index of its parameter group: under pipeline parallelism each stage's ranks
hold a different group 0, and DCP keeps one writer per key, so an indexed group's hyper-parameters and parameter list
would be one stage's, and the other stages would load them wrongly. Checkpoints written before (indexed groups) still
load."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


def save_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler,
               options: StateDictOptions, asynchronous: bool = False) -> list[Future]:
    """The model (with ``optimizer``: its state and ``scheduler``'s) into ``directory``. ``asynchronous``: DCP
    copies the state to host memory before this returns and writes the files in a background thread; the returned
    futures end when they are written (training may change the weights meanwhile: the copy is what gets written)."""
    write = dcp.async_save if asynchronous else dcp.save
    options = dataclasses.replace(options, flatten_optimizer_state_dict=True)
    if optimizer is not None:
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        written = write({"model": model_state, "optim": optim_state}, checkpoint_id=directory / "model_optim")
        if dist.get_rank() == 0:
            torch.save(scheduler.state_dict(), directory / "lr_scheduler.pt")
    else:
        written = write({"model": get_model_state_dict(model, options=options)}, checkpoint_id=directory / "model_optim")
    return [written] if asynchronous else []


def load_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler,
               options: StateDictOptions) -> None:
    """What `save_state` wrote into ``model`` (with ``optimizer``: its state and ``scheduler``'s)."""
    if optimizer is not None:
        saved = set(dcp.FileSystemReader(str(directory / "model_optim")).read_metadata().state_dict_metadata)
        # (a checkpoint of before: its groups indexed, ``optim.param_groups.0.lr``)
        flat = not any(key.startswith("optim.param_groups.0.") for key in saved)
        options = dataclasses.replace(options, flatten_optimizer_state_dict=flat)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        dropped = _drop_states_not_saved(optim_state, saved, flat)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=directory / "model_optim")  # strict: every weight and saved state
        if flat:  # the flat layout needs every entry to unflatten: the fresh ones back, cleared after
            optim_state.update(dropped)
        # not strict only where the optimizer states of parameters without a gradient yet were left out
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=dataclasses.replace(options, strict=not dropped and options.strict))
        if flat and dropped:
            parameters = dict(model.named_parameters())
            for name in {key.removeprefix("state.").rsplit(".", 1)[0] for key in dropped}:
                optimizer.state.pop(parameters[name], None)
        scheduler.load_state_dict(torch.load(directory / "lr_scheduler.pt", weights_only=True))
    else:
        state = {"model": get_model_state_dict(model, options=options)}
        dcp.load(state, checkpoint_id=directory / "model_optim")
        set_model_state_dict(model, state["model"], options=options)


def _drop_states_not_saved(optim_state: dict, saved: set[str], flat: bool) -> dict:
    """Leave out of the state to load the optimizer states the checkpoint (whose keys are ``saved``) does not hold:
    those of parameters that had no gradient before the save (an omni thinker's unused audio token, a vision tower
    before the first image). `get_state_dict` gives a fresh optimizer a state for every parameter, which DCP would
    then look for; left out, such a parameter starts its state at its first gradient, as it would have without the
    restart. ``flat``: the state as `_flatten_optim_state_dict` lays it out. Returns what was left out."""
    if flat:
        return {key: optim_state.pop(key) for key in
                [key for key in optim_state if key.startswith("state.") and f"optim.{key}" not in saved]}
    return {name: optim_state["state"].pop(name) for name in
            [name for name, entry in optim_state["state"].items()
             if not all(f"optim.state.{name}.{key}" in saved for key in entry)]}
