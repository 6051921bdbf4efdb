"""Join (or create) the default torch.distributed process group.

Under torchrun the usual RANK/WORLD_SIZE/MASTER_ADDR variables are honoured. A plain
`relax train` on one machine gets a one-process group on 127.0.0.1, so the training code is the
same FSDP2 code at every world size.
"""

from __future__ import annotations

import atexit
import gc
import os
import random
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

PG_INIT_METHOD_ENV = "RELAX_PG_INIT_METHOD"

# Releases of objects whose destructors use the default group (an FSDP2 model and its optimizer). They must run
# before the group goes: an FSDP2 module collected after it (at interpreter exit, or as cyclic garbage after
# destroy_process_group) aborts the process with "terminate called without an active exception" about one exit
# in five on gloo (torch 2.13), turning a finished run into SIGABRT.
_releases: list[weakref.WeakMethod] = []


# Ports below this are left alone: Ray's workers bind 10002-19999 (its default --min/max-worker-port) explicitly.
QUIET_PORTS_FROM = 20000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the OS hands out for ``bind(0)`` and for every outgoing connection's local end (Linux's
    ``ip_local_port_range``; its default where that cannot be read)."""
    try:
        low, high = (int(part) for part in Path(_EPHEMERAL_RANGE).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(address: str = "127.0.0.1", attempts: int = 64) -> int:
    """A TCP port free on ``address`` now, for a server that binds it a moment later.

    Not one ``bind(0)`` returns: that comes from the ephemeral range, which every outgoing connection on the machine
    draws its local port from too (a Ray cluster opens hundreds), so between the pick and the server's bind another
    process's client socket can take it, and the server fails with "address already in use" (seen in the suite: the
    scaling API of a run beside Ray Serve). A port between `QUIET_PORTS_FROM` and the ephemeral range is only ever
    taken by an explicit bind; one of those is drawn at random and checked. Where that range is empty (a machine
    whose ephemeral range starts lower), ``bind(0)``'s port as before."""
    low, _ = ephemeral_port_range()
    candidates = range(QUIET_PORTS_FROM, low)
    for port in random.sample(candidates, min(attempts, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
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
