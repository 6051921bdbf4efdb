"""Join (or create) the default torch.distributed process group.

Under torchrun the usual RANK/WORLD_SIZE/MASTER_ADDR variables are honoured. A plain
`relax train` on one machine gets a one-process group on 127.0.0.1, so the training code is the
same FSDP2 code at every world size.
"""

from __future__ import annotations

import atexit
import gc
import os
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

PG_INIT_METHOD_ENV = "RELAX_PG_INIT_METHOD"

# Releases of objects whose destructors use the default group (an FSDP2 model and its optimizer). They must run
# before the group goes: an FSDP2 module collected after it (at interpreter exit, or as cyclic garbage after
# destroy_process_group) aborts the process with "terminate called without an active exception" about one exit
# in five on gloo (torch 2.13), turning a finished run into SIGABRT.
_releases: list[weakref.WeakMethod] = []


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def free_loopback_port() -> int:
    return free_port("127.0.0.1")


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (on the master) listens on ``host`` alone. torch's own binds every interface of the
    machine, and anyone who reaches a store can write the rendezvous keys of the group."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    listener = socket.create_server((host, port), reuse_port=False, backlog=max(128, world_size))
    # the store's server takes the descriptor over (and closes it): the Python socket lets go of it
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())


def ensure_process_group(device: torch.device) -> None:
    """Initialise the default group once: NCCL on CUDA, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        # RELAX_PG_INIT_METHOD: a rendezvous other than torchrun's MASTER_ADDR/PORT (a file for processes of one node)
        init_method = os.environ.get(PG_INIT_METHOD_ENV, "env://")
        dist.init_process_group(backend, init_method=init_method, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    else:
        # One process needs no rendezvous: an in-memory store, no port (a free port picked here could be taken by
        # another process before the store binds it)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    atexit.register(shutdown_process_group)


def release_before_shutdown(release: Callable[[], None]) -> None:
    """Have `shutdown_process_group` call the bound method ``release`` first (held weakly: an object collected
    earlier is skipped)."""
    _releases.append(weakref.WeakMethod(release))


def shutdown_process_group() -> None:
    """Release what uses the default group, collect it, then destroy the group (at exit, or by hand)."""
    while _releases:
        release = _releases.pop()()
        if release is not None:
            release()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """All ranks meet here (nothing to do in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
