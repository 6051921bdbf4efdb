"""How much memory a new allocation can take on a device now: what a setting that sizes a buffer (a KV pool) is
checked against before the allocation fails inside torch with a traceback that names no setting."""

from __future__ import annotations

from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")


def total_bytes(device: torch.device) -> int | None:
    """The bytes a CUDA device has in all, read without creating a CUDA context on it (a check made in a process
    that will not compute there, a supervisor or a rank before its device is set, must not take any); None
    elsewhere."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def free_bytes(device: torch.device) -> int | None:
    """The bytes free on ``device``: CUDA's free memory, or the host's available memory (Linux's MemAvailable: free
    pages plus the caches the kernel gives back); None where the platform does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _meminfo("MemAvailable:") if device.type == "cpu" else None


def _meminfo(field: str) -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
