"""Which device each local rank gets (train/device.py)."""

from __future__ import annotations

import pytest
import torch

from diloco_node.train import device as device_module
from diloco_node.train.device import DeviceError, resolve_device, resolve_devices


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine that reports one CUDA device (nothing is allocated on it)."""
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(device_module.torch.cuda, "device_count", lambda: 1)


@pytest.mark.parametrize("name", ["auto", "cuda"])
def test_a_bare_cuda_names_the_first_gpu(one_gpu: None, name: str) -> None:
    # torch.cuda.set_device refuses a device without an index: a one-GPU node crashed at start-up
    assert resolve_device(name) == torch.device("cuda", 0)
    assert resolve_devices(name, "", 1) == ("cuda:0",)


def test_an_explicit_gpu_is_kept(one_gpu: None) -> None:
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


def test_ranks_beyond_the_gpus_are_refused(one_gpu: None) -> None:
    with pytest.raises(DeviceError, match="1 CUDA device"):
        resolve_devices("cuda", "", 2)


def test_cuda_without_a_gpu_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")
