"""Where the inner steps run: one device per local rank."""

from __future__ import annotations

import os

import torch

from diloco_node.errors import NodeError


class DeviceError(NodeError, RuntimeError):
    """The requested accelerator is not there, or too few of them."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device '{name}' requested but no CUDA device is available")
    device = torch.device(name)
    # a bare "cuda" names no GPU, and torch.cuda.set_device refuses it: it means the first one
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def resolve_devices(device: str, devices: str, local_ranks: int) -> tuple[str, ...]:
    """The device of each local rank: `devices` as listed, else cuda:0..K−1 or cpu for all."""
    if devices:
        chosen = tuple(devices.split(","))
    else:
        base = resolve_device(device)
        if base.type == "cuda" and local_ranks > 1:
            chosen = tuple(f"cuda:{i}" for i in range(local_ranks))
        else:
            chosen = (str(base),) * local_ranks
    cuda = [name for name in chosen if name.startswith("cuda")]
    if cuda:
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError(f"devices {','.join(chosen)} requested but no CUDA device is available")
        missing = [name for name in cuda if int(name.partition(":")[2] or 0) >= count]
        if missing:
            raise DeviceError(f"{local_ranks} local ranks need devices {','.join(chosen)}; this machine has "
                              f"{count} CUDA device(s)")
    cores = os.cpu_count() or 1
    if not cuda and local_ranks > cores:
        raise DeviceError(f"{local_ranks} local ranks on the CPU need as many cores; this machine has {cores}")
    return chosen
