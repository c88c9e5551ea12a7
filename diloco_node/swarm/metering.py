"""Counting the payload bytes that hivemind's all-reduce puts on and takes off the wire.

hivemind calls a CompressionBase only for the tensor parts a peer *sends* to reducers; replies and
received parts go through module-level (de)serialisers we cannot hook. In a butterfly all-reduce
the traffic is symmetric, though: every part we send comes back averaged (same size), and every
one of the M-1 other peers sends us our own span and receives it back averaged. So the counts of
what went through `compress` plus the group size determine both directions exactly.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from dataclasses import dataclass

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression
from hivemind.proto import runtime_pb2


class MeteredCompression(CompressionBase):
    """Wraps a compression and counts, in shared memory, the elements and bytes it serialised.

    The counters are mp.Values because hivemind runs the averager in a forked child process.
    """

    def __init__(self, inner: CompressionBase | None = None):
        self.inner = inner or NoCompression()
        self.compression_type = self.inner.compression_type
        self._bytes = mp.Value(ctypes.c_uint64, 0)
        self._elements = mp.Value(ctypes.c_uint64, 0)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        serialized = self.inner.compress(tensor, info, allow_inplace)
        with self._bytes.get_lock():
            self._bytes.value += len(serialized.buffer)
            self._elements.value += tensor.numel()
        return serialized

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return self.inner.extract(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.inner.estimate_compression_ratio(info)

    def snapshot(self) -> tuple[int, int]:
        """(bytes, elements) sent through compress() so far."""
        return int(self._bytes.value), int(self._elements.value)


@dataclass(frozen=True)
class RoundTraffic:
    bytes_sent: int
    bytes_received: int


def butterfly_traffic(sent_bytes: int, sent_elements: int, total_elements: int, group_size: int) -> RoundTraffic:
    """Both directions of one all-reduce from what we serialised (see the module docstring)."""
    if group_size <= 1:
        return RoundTraffic(0, 0)
    own_span = max(total_elements - sent_elements, 0)
    bytes_per_element = sent_bytes / sent_elements if sent_elements else 4.0
    span_traffic = round((group_size - 1) * own_span * bytes_per_element)
    return RoundTraffic(bytes_sent=sent_bytes + span_traffic, bytes_received=sent_bytes + span_traffic)
