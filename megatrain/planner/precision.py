"""train.precision: `auto` resolved for the device that computes, and the one line that says what was chosen and why.

auto is bf16 where the device computes bf16 natively, fp32 elsewhere:
    CUDA   bf16 tensor cores (sm80 and later: torch.cuda.is_bf16_supported without emulation); planning for a GPU
           from a machine without one, the profile's GPU is taken to have them (the planner's rates are bf16 ones)
    CPU    AVX512_BF16 or AMX (the CPU's flags), torch's CPU kernels at AVX512 or above
           (torch.backends.cpu.get_cpu_capability, which honours ATEN_CPU_CAPABILITY) and oneDNN's bf16 matmuls
           (which honour ONEDNN_MAX_CPU_ISA); an Arm CPU with the BF16 extension and oneDNN's bf16 matmuls
Without bf16 instructions torch emulates bf16 on a CPU, its matmuls ~10x slower than fp32 (a layer of the demo's
model ~7x). An explicit `bf16` still runs there; its line says the cost (measured at start: planner.plan.run_profile).
To reproduce such a CPU on one that has the instructions, set both ATEN_CPU_CAPABILITY=avx2 (torch's own kernels)
and ONEDNN_MAX_CPU_ISA=AVX2 (the matmuls: oneDNN's, which ATEN_CPU_CAPABILITY does not reach).

The run resolves train.precision once, before anything reads it (run/prepare.check_inputs), so its config.json,
checkpoints and plan hold the resolved value; the planner resolves a config's `auto` the same way
(workload.workload_from_config).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # x86 /proc/cpuinfo flags of the bf16 dot-product instructions


@dataclass(frozen=True)
class Bf16Support:
    native: bool  # the device computes bf16 natively
    why: str  # what says so, e.g. "this CPU has avx512_bf16"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features` of /proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def _onednn_bf16() -> bool:
    """oneDNN runs bf16 matmuls natively at its ISA (honours ONEDNN_MAX_CPU_ISA); False where unknown."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def cpu_bf16() -> Bf16Support:
    """Whether this CPU computes bf16 natively, as torch will run it in this process."""
    cap = torch.backends.cpu.get_cpu_capability()
    flags = cpu_flags()
    onednn = _onednn_bf16()
    if platform.machine().lower() in ("aarch64", "arm64"):
        if "bf16" in flags and onednn:
            return Bf16Support(True, "this CPU has the Arm BF16 extension")
        return Bf16Support(False, "this CPU has no bf16 instructions (no Arm BF16 extension or no oneDNN bf16)")
    isa = [f for f in CPU_BF16_FLAGS if f in flags]
    if isa and cap.startswith(("AVX512", "AMX")) and onednn:
        return Bf16Support(True, f"this CPU has {', '.join(isa)}")
    if not isa:
        return Bf16Support(False, f"this CPU has no bf16 instructions ({', '.join(CPU_BF16_FLAGS)})")
    off = []  # what turned them off: the environment, else torch's build
    if not cap.startswith(("AVX512", "AMX")):
        off.append(f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']}" if "ATEN_CPU_CAPABILITY" in os.environ
                   else f"torch's CPU capability {cap}")
    if not onednn:
        off.append(f"ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if "ONEDNN_MAX_CPU_ISA" in os.environ
                   else "no oneDNN bf16 matmuls")
    return Bf16Support(False, f"this CPU's {', '.join(isa)} not used ({', '.join(off)})")


@functools.lru_cache(maxsize=None)
def cuda_bf16() -> Bf16Support:
    """Whether the CUDA device computes bf16 natively; without one here, the profile's GPU is taken to."""
    if not torch.cuda.is_available():
        return Bf16Support(True, "planned for the profile's GPU, taken to have bf16 tensor cores")
    name, (major, minor) = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    if major >= 8 and torch.cuda.is_bf16_supported(including_emulation=False):
        return Bf16Support(True, f"{name} (sm{major}{minor}) has bf16 tensor cores")
    return Bf16Support(False, f"{name} (sm{major}{minor}) has no bf16 tensor cores")


def bf16_support(device: str) -> Bf16Support:
    return cuda_bf16() if device == "cuda" else cpu_bf16()


def resolve_precision(requested: str, device: str) -> str:
    """train.precision for `device` ('cpu' or 'cuda'): 'bf16' or 'fp32' as given; 'auto': bf16 where the device
    computes it natively, else fp32."""
    if requested != "auto":
        return requested
    return "bf16" if bf16_support(device).native else "fp32"


def precision_line(precision: str, device: str, bf16_slowdown: float | None = None) -> str:
    """The one line of the start summary and of `megatrain plan`: the resolved precision and why. bf16_slowdown: a
    bf16 layer's time over an fp32 one's on this CPU, when measured (planner.plan.run_profile)."""
    s = bf16_support(device)
    if precision == "bf16" and s.native:
        return f"precision: bf16: {s.why}, bf16 runs natively"
    if precision == "fp32" and not s.native:
        return f"precision: fp32: {s.why}, bf16 would be emulated"
    if precision == "fp32":
        return f"precision: fp32, as set ({s.why}: train.precision auto would choose bf16)"
    cost = f"{bf16_slowdown:.1f}x the time of fp32 per layer, measured here" if bf16_slowdown else \
        "its matmuls ~10x slower than fp32"
    return f"precision: bf16, as set, but {s.why}: torch emulates bf16, {cost} (auto or fp32 runs fp32)"
