"""How much memory a new allocation can take on a device now: what a setting that sizes a buffer (a KV pool) is
checked against before the allocation fails inside torch with a traceback that names no setting."""

from __future__ import annotations

from pathlib import Path

import torch

MEMINFO = Path("/proc/meminfo")


def free_bytes(device: torch.device) -> int | None:
    """The bytes free on ``device``: CUDA's free memory, or the host's available memory (Linux's MemAvailable: free
    pages plus the caches the kernel gives back); None where the platform does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None
