"""Real `diloco-node join` processes for integration tests (diloco_node/launch.py), and their flags.

The launcher lives in the package, shared with the benchmarks and the demo; it is re-exported here
so that tests keep importing it from this module.
"""

from __future__ import annotations

from diloco_node.launch import NodeProcess, RoundLog, alive, descendants

__all__ = ["FAST", "NodeProcess", "RoundLog", "alive", "descendants"]

FAST = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status", "127.0.0.1:0", "--threads", "1", "--seq-len", "64",
        "--batch-size", "8", "--eval-batches", "2", "--warmup-steps", "5", "--matchmaking-time", "2",
        # most tests check that φ agrees bit for bit, which only blocking promises; a later --sync wins
        "--sync", "blocking"]
