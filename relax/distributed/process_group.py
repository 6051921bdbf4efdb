"""Join (or create) the default torch.distributed process group.

Under torchrun the usual RANK/WORLD_SIZE/MASTER_ADDR variables are honoured. A plain
`relax train` on one machine gets a one-process group on 127.0.0.1, so the training code is the
same FSDP2 code at every world size.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def free_loopback_port() -> int:
    return free_port("127.0.0.1")


def ensure_process_group(device: torch.device) -> None:
    """Initialise the default group once: NCCL on CUDA, gloo on CPU."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_loopback_port()}", rank=0, world_size=1
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
