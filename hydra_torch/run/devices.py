"""The devices a call trains on, as ht.train's arguments name them, and what the host gives them."""
from __future__ import annotations

import os

import torch

from hydra_torch.recipe.reals import integral, whole


def resolve_devices(devices) -> list[torch.device]:
    """"auto" (the first GPU, else the CPU), a device, or a list of devices. Repeating "cpu" k times gives
    k virtual CPU devices (one intra-op thread each). A device index (0) names a CUDA device, as in
    model.cuda(0)."""
    if devices == "auto":
        return [torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")]
    devices = integral(devices)  # a NumPy or tensor index, as an int
    if isinstance(devices, (str, torch.device, int)):
        devices = [devices]
    try:
        # torch.device(0) names the current accelerator, and on a machine without one fails without naming CUDA.
        resolved = [torch.device("cuda", d) if isinstance(d, int) and not isinstance(d, bool) else torch.device(d)
                    for d in map(integral, devices)]
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"cannot read devices={devices!r}: {error}") from None
    if not resolved:
        raise ValueError("devices is empty")
    out = []
    for device in resolved:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device} was asked for but CUDA is not available")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            if device.index >= torch.cuda.device_count():
                raise ValueError(f"device {device} does not exist: {torch.cuda.device_count()} CUDA devices")
            if device in out:
                raise ValueError(f"device {device} is listed twice")
        elif device.type != "cpu":
            raise ValueError(f"unsupported device {device}: use CPU or CUDA devices")
        out.append(device)
    if any(d.type == "cpu" for d in out) and any(d.type == "cuda" for d in out):
        raise ValueError("mixing CPU and CUDA devices in one call is not supported")
    return out


# The variables through which a user configures PyTorch's CUDA caching allocator (the second is the newer name).
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments(devices, environ=os.environ, configure=None) -> bool:
    """Before a run first allocates on a CUDA device, lets PyTorch's caching allocator grow segments in place
    (expandable_segments:True), unless the user configured the allocator. Why: a run fills its budget to the
    byte, and at its edge the default allocator frees cached segments (cudaFree synchronises the device) while
    small boundary tensors split the large blocks that the arena and the LM head reuse. Process-wide, and only
    new segments are affected. Returns whether it was set."""
    if not any(d.type == "cuda" for d in devices) or any(environ.get(v) for v in ALLOCATOR_VARIABLES):
        return False
    if configure is None:
        configure = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if configure is None:  # torch before 2.9
        configure = torch.cuda.memory._set_allocator_settings
    configure("expandable_segments:True")
    return True


def pinned(pin_memory, devices) -> bool:
    if not (isinstance(pin_memory, bool) or pin_memory == "auto"):  # "false" from a config file would pin
        raise ValueError(f"pin_memory must be 'auto', True or False, got {pin_memory!r}")
    if pin_memory == "auto":
        return any(d.type != "cpu" for d in devices)  # a CPU device copies host to host: pinning buys nothing
    return bool(pin_memory)


# What each accelerator needs of the host's cores: its worker (issuing the compute) and its two copy lanes.
CORES_PER_ACCELERATOR = 3


def host_step_threads(host_threads, devices=()) -> tuple[int, int]:
    """The host-step threads, and the OpenMP team each one's jobs open (0: the process's default, every core).

    With accelerators, the cores their workers and copy lanes need are held back and the steps get the rest:
    at most 4 threads (host steps stream through memory: a few saturate it), whose teams together fill those
    cores instead of each opening a team of every core. On CPU devices the compute takes the cores the steps
    would: half of them, at most 4, as teams of the default size."""
    if host_threads is not None and not whole(host_threads, 1):
        raise ValueError(f"host_threads must be a positive int, got {host_threads!r}")
    cores = os.cpu_count() or 1
    accelerators = sum(1 for d in devices if d.type != "cpu")
    if not accelerators:
        return host_threads or max(1, min(4, cores // 2)), 0
    spare = max(1, cores - CORES_PER_ACCELERATOR * accelerators)
    threads = host_threads or min(4, spare)
    return threads, max(1, spare // threads)
