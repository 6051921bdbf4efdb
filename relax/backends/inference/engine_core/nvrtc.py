"""CUDA C source to a cubin with NVRTC, the runtime compiler PyTorch's CUDA wheels ship (``nvidia-cuda-nvrtc``).

Why not `torch.cuda._compile_kernel`: it adds the CUDA toolkit's include folder to every compile and fails where no
toolkit is installed (``CUDA_HOME`` unset and no ``nvcc``), which is most machines that got PyTorch from pip. The
engine's kernels include no header, so the library alone is enough; the cubin is then loaded by PyTorch
(`torch.cuda._utils._cuda_load_module`). Compiling needs no GPU, so the tests build the kernels on CPU too and read
ptxas' register and spill counts from the log.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import torch


class NvrtcError(RuntimeError):
    """The library is missing, or the source did not compile (the message holds NVRTC's log)."""


@functools.cache
def library() -> ctypes.CDLL:
    """libnvrtc: by its soname where the loader finds it, else from the ``nvidia-cuda-nvrtc`` wheel's folder."""
    major = torch.version.cuda.split(".")[0] if torch.version.cuda else "13"  # a CPU build: the test extra's 13
    names = [f"libnvrtc.so.{major}", "libnvrtc.so"]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        names += [str(path) for path in sorted(Path(root).glob("*/lib/libnvrtc.so*"))]
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise NvrtcError(f"no NVRTC library found (looked for {', '.join(names)}); install nvidia-cuda-nvrtc")


def _check(nvrtc: ctypes.CDLL, result: int, what: str) -> None:
    if result:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise NvrtcError(f"{what}: {nvrtc.nvrtcGetErrorString(result).decode()}")


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """``source`` for ``arch`` (``sm_90``): the cubin and NVRTC's log (ptxas' ``-v`` report where asked for)."""
    nvrtc = library()
    program = ctypes.c_void_p()
    _check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0, None,
                                           None), "nvrtcCreateProgram")
    try:
        flags = [f"--gpu-architecture={arch}", *options]
        array = (ctypes.c_char_p * len(flags))(*(flag.encode() for flag in flags))
        result = nvrtc.nvrtcCompileProgram(program, len(flags), array)
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        text = log.value.decode(errors="replace")
        if result:
            raise NvrtcError(f"{name} did not compile for {arch}:\n{text}")
        _check(nvrtc, nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw, text
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
