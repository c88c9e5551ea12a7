"""Where the inner steps run."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceError(f"device '{name}' requested but no CUDA device is available")
    return torch.device(name)


class DeviceError(RuntimeError):
    """The requested accelerator is not there."""
