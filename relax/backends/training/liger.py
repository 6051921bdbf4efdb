"""liger-kernel's fused Triton kernels for the trainer's elementwise work: RMSNorm, SwiGLU and RoPE.

On the GPU most of a small model's step is not matrix products but the elementwise passes around them (the HF
RMSNorm alone makes five float32 passes over the hidden states, forward and backward). liger-kernel fuses each into
one kernel; on the Qwen3-0.6B shape that is 1.47x the packed trainer's tokens/s and 11 GiB less peak memory
(``benchmarks/results/train_gpu.json``).

The kernels go onto the trainer's module instances only (norms and MLPs by class name, for the families whose
math they reproduce), never onto Hugging Face's classes, so an inference engine or another model in the process
keeps the stock code. RoPE is a module-level function in Hugging Face's code: a dispatcher takes its place and
uses liger's kernel only inside `rope_scope`, which the trainer holds around its forwards and backwards (so a
checkpointed layer recomputes with the kernel it ran with).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import types

import torch
from torch import nn

from relax.backends.training.master_weights import shared_input_linears

# RMSNorms computing weight * (x / rms(x)) in float32 then cast back ("llama" casting); not Gemma's (1 + weight).
RMS_NORM_CLASSES = frozenset({"Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"})
# MLPs computing down(act(gate(x)) * up(x)).
GATED_MLP_CLASSES = frozenset({"Qwen3MLP", "Qwen2MLP", "LlamaMLP", "MistralMLP"})
ROPE_MODULES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")

_ROPE_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("relax_liger_rope", default=False)
_patched_rope_modules: set[str] = set()


def liger_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernels cannot run here, or None."""
    if device.type != "cuda":
        return f"liger-kernel's kernels are Triton kernels for CUDA; the trainer is on {device.type}"
    try:
        importlib.import_module("liger_kernel.transformers.functional")
    except Exception as err:  # noqa: BLE001 - ImportError, or Triton failing to initialise
        return f"liger-kernel is not importable ({type(err).__name__}: {err}); pip install liger-kernel"
    return None


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_rms_norm

    # in_place=False: liger's in-place backward writes into the incoming gradient, which another branch of the
    # residual stream may still read
    return liger_rms_norm(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_swiglu

    return self.down_proj(liger_swiglu(*shared_input_linears(x, (self.gate_proj, self.up_proj))))


def _silu_gated(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _rope_dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _ROPE_ACTIVE.get() and q.is_cuda and not args and set(kwargs) <= {"unsqueeze_dim"}:
            from liger_kernel.transformers.functional import liger_rope

            return liger_rope(q, k, cos, sin, None, kwargs.get("unsqueeze_dim", 1))
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.relax_original = original
    return apply_rotary_pos_emb


def _install_rope_dispatcher(model: nn.Module) -> bool:
    module_name = type(model).__module__
    family = module_name.rsplit(".", 1)[-1].removeprefix("modeling_")
    if family not in ROPE_MODULES:
        return False
    if module_name not in _patched_rope_modules:
        modeling = importlib.import_module(module_name)
        current = getattr(modeling, "apply_rotary_pos_emb", None)
        if current is None:
            return False
        if not hasattr(current, "relax_original"):
            modeling.apply_rotary_pos_emb = _rope_dispatcher(current)
        _patched_rope_modules.add(module_name)
    return True


def apply_liger_kernels(language_model: nn.Module, rms_norm_forward=None) -> dict[str, int]:
    """Put the kernels on this model's norms and MLPs; how many of each (and whether RoPE dispatches).
    ``rms_norm_forward``: the norms' forward instead of liger's (`compiled_norm.rms_norm_forward`)."""
    counts = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    for module in language_model.modules():
        name = type(module).__name__
        if name in RMS_NORM_CLASSES and getattr(module, "weight", None) is not None \
                and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_norm_forward or _rms_norm_forward, module)
            counts["rms_norm"] += 1
        elif name in GATED_MLP_CLASSES and _silu_gated(module):
            module.forward = types.MethodType(_gated_mlp_forward, module)
            counts["swiglu"] += 1
    for module in language_model.modules():
        if _install_rope_dispatcher(module):
            counts["rope"] = 1
            break
    return counts


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """``context_fn`` of the trainer's activation checkpointing: the recomputation of a checkpointed block runs with
    the RoPE its forward ran with. Autograd may recompute on another thread (CUDA's backward worker) or after the
    trainer's `rope_scope` has closed, where the context variable is not set: Hugging Face's RoPE would then save
    tensors of other shapes than liger's did, and the backward fails (found on the H200 with a KL loss)."""
    return contextlib.nullcontext(), rope_scope(_ROPE_ACTIVE.get())


@contextlib.contextmanager
def rope_scope(enabled: bool):
    """liger's RoPE for the forwards (and backward recomputations) inside; Hugging Face's elsewhere."""
    token = _ROPE_ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ROPE_ACTIVE.reset(token)
