"""What the GPU benchmarks take as a card's memory bandwidth: the rate it copies at (bytes read plus bytes
written per second), as measured on the cards this project is lent, and a measurement of it in the run."""

from __future__ import annotations

import torch

# device-to-device copies of a few GiB (as `measure_copy_bytes_per_s` does), measured on the lent cards
COPY_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.0e12}


def copy_bytes_per_s(name: str | None = None) -> float:
    """The copy rate of the card named ``name`` (this process's CUDA device by default); the H200's when unknown."""
    name = name if name is not None else torch.cuda.get_device_name()
    return next((rate for card, rate in COPY_BYTES_PER_S.items() if card in name), COPY_BYTES_PER_S["H200"])


def measure_copy_bytes_per_s(gib: float = 4.0, repeats: int = 10) -> float:
    """This card's device-to-device copy rate now: bytes read plus written per second, the median of ``repeats``
    copies of a ``gib`` GiB tensor (far past the L2 cache)."""
    source = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del source, target
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / sorted(times)[len(times) // 2]
