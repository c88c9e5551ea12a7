"""Rank 0's side of a multi-rank replica: it starts ranks 1..K−1, forms the node's process group
with them and runs every replica call on all ranks at once (SPMD).

Each call is one control message (the method's name, broadcast over gloo) followed by the same
method on every rank; the values only rank 0 holds (φ, checkpoints) travel inside the method, by
its own collectives. The group never spans two nodes.

φ and the outer momentum live on rank 0, in CPU memory, in the canonical layout — not sharded per
rank as in torchft or prime. The swarm exchanges full canonical vectors (a node of any layout must
be able to average with any other), so rank 0 needs the full Δ anyway; the ranks' accelerator
memory, the scarce resource on consumer cards, then holds only θ's shard, its gradients and AdamW.

Ranks are started before hivemind forks anything, from the main thread, as fresh interpreters in
their own process group (a terminal's Ctrl-C reaches rank 0 only, which stops them at a safe
point); each dies with rank 0 (PDEATHSIG). A rank that dies takes the node down: the next
collective fails, `ReplicaError` reaches the round engine, which stops without saving, and the
node resumes from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from diloco_node.replica.base import Compute, ReplicaError, ReplicaSettings
from diloco_node.replica.common import RankContext

logger = logging.getLogger(__name__)

RANK_TIMEOUT = timedelta(minutes=10)  # a collective that waits longer than this fails
CLOSE_TIMEOUT = 30.0
WATCH_INTERVAL = 0.2
DIAGNOSE_TIMEOUT = 3.0
# After a rank died, how long the round engine has to notice (its next collective fails at once)
# before the process ends itself rather than hang on a collective that never returns.
FAILURE_GRACE = 30.0


def settings_to_env(settings: ReplicaSettings) -> str:
    return json.dumps(dataclasses.asdict(settings))


def settings_from_env(text: str) -> ReplicaSettings:
    values = json.loads(text)
    return ReplicaSettings(**{**values, "devices": tuple(values["devices"])})


def backend_for(settings: ReplicaSettings) -> str:
    return "nccl" if settings.devices[0].startswith("cuda") else "gloo"


def join_group(settings: ReplicaSettings, rank: int, rendezvous: str) -> RankContext:
    """Every rank: join the node's process group; control messages go over gloo in any case."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the node's ranks are always on this machine
    world = len(settings.devices)
    backend = backend_for(settings)
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=RANK_TIMEOUT)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return RankContext(rank, world, control)


def make_compute(settings: ReplicaSettings, ctx: RankContext) -> Compute:
    if settings.parallel == "fsdp":
        from diloco_node.replica.fsdp import FsdpCompute
        return FsdpCompute(settings, ctx)
    from diloco_node.replica.pipeline import PipelineCompute
    return PipelineCompute(settings, ctx)


class RankedReplica:
    """The Replica a node with K > 1 local ranks uses (rank 0)."""

    def __init__(self, settings: ReplicaSettings, on_failure: Any = None):
        self.settings = settings
        self._on_failure = on_failure
        self.failure: str | None = None
        self._closing = False
        self._dir = tempfile.TemporaryDirectory(prefix="diloco-ranks-")
        rendezvous = str(Path(self._dir.name) / "rendezvous")
        self._ranks = [self._spawn(rank, rendezvous) for rank in range(1, len(settings.devices))]
        threading.Thread(target=self._watch, name="local-ranks", daemon=True).start()
        try:
            ctx = join_group(settings, 0, rendezvous)
            self._ctx = ctx
            self._compute = self._guard(lambda: make_compute(settings, ctx))
        except BaseException:
            self.close()
            raise
        logger.info("local ranks ready parallel=%s ranks=%d devices=%s", settings.parallel, ctx.world,
                    ",".join(settings.devices))

    def _spawn(self, rank: int, rendezvous: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "DILOCO_LOCAL_RANK": str(rank), "DILOCO_RENDEZVOUS": rendezvous,
               "DILOCO_REPLICA": settings_to_env(self.settings), "DILOCO_PARENT": str(os.getpid())}
        # stdout stays the node's own (scripts read its address lines); ranks log to stderr
        return subprocess.Popen([sys.executable, "-m", "diloco_node.replica.worker"], env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, process_group=0)

    def _watch(self) -> None:
        while not self._closing:
            for rank, process in enumerate(self._ranks, start=1):
                code = process.poll()
                if code is not None and not self._closing:
                    self._fail(self.failure or f"local rank {rank} exited with code {code}")
                    return
            time.sleep(WATCH_INTERVAL)

    def _fail(self, why: str) -> None:
        self.failure = why
        logger.error("%s; stopping this node (it resumes from its last checkpoint)", why)
        if self._on_failure is not None:
            self._on_failure()

        def last_resort() -> None:
            os.write(2, f"diloco-node: {why}; the node did not stop in {FAILURE_GRACE:.0f}s, ending it\n".encode())
            os._exit(1)

        timer = threading.Timer(FAILURE_GRACE, last_resort)
        timer.daemon = True
        timer.start()

    def _guard(self, call: Any) -> Any:
        if self.failure:
            raise ReplicaError(self.failure)
        try:
            return call()
        except (RuntimeError, dist.DistBackendError) as exc:
            self.failure = self.failure or self._dead_rank() or f"local ranks failed: {str(exc).splitlines()[0]}"
            raise ReplicaError(self.failure) from None

    def _dead_rank(self) -> str | None:
        """Which rank died, when a collective failed because one did (its exit may take a moment to show)."""
        deadline = time.monotonic() + DIAGNOSE_TIMEOUT
        while time.monotonic() < deadline:
            for rank, process in enumerate(self._ranks, start=1):
                if process.poll() is not None:
                    return f"local rank {rank} exited with code {process.returncode}"
            time.sleep(WATCH_INTERVAL)
        return None

    def _run(self, method: str, local_args: tuple[Any, ...], remote_args: tuple[Any, ...] | None = None) -> Any:
        """`method` on every rank: rank 0 with `local_args`, the others with `remote_args`."""
        message = [method, local_args if remote_args is None else remote_args]

        def call() -> Any:
            dist.broadcast_object_list(message, src=0, group=self._ctx.control)
            return getattr(self._compute, method)(*local_args)
        return self._guard(call)

    def load(self, phi: list[torch.Tensor] | None) -> None:
        self._run("load", (phi,), (None,))

    def train_step(self, stream_seed: int, position: int, batches: int = 1) -> float:
        return float(self._run("train_step", (stream_seed, position, batches)))

    def theta(self) -> list[torch.Tensor] | None:
        return self._run("theta", ())  # type: ignore[no-any-return]

    def evaluate(self) -> float:
        return float(self._run("evaluate", ()))

    def inner_state(self) -> dict[str, Any] | None:
        return self._run("inner_state", ())  # type: ignore[no-any-return]

    def load_inner_state(self, state: dict[str, Any] | None) -> None:
        self._run("load_inner_state", (state,), (None,))

    def advance_schedule(self, step: int) -> None:
        self._run("advance_schedule", (step,))

    def set_progress(self, progress: float) -> None:
        self._run("set_progress", (progress,))

    def prepare_data(self, stream_seed: int, position: int) -> None:
        self._run("prepare_data", (stream_seed, position))

    def peak_memory(self) -> list[int] | None:
        return self._run("peak_memory", ())  # type: ignore[no-any-return]

    def micro_batch(self) -> int:
        # fixed over a run here (no back-off across ranks): as set, else the rank's share (FSDP) or
        # one of the K microbatches (pipeline), which are the same number of sequences
        return self.settings.micro_batch_size or self.settings.batch_size // len(self.settings.devices)

    def close(self) -> None:
        """Tell the ranks to finish and wait for them; a failed node only reaps what is left."""
        if self._closing:
            return
        self._closing = True
        orderly = self.failure is None and hasattr(self, "_compute")  # else the ranks cannot be told
        if orderly:
            try:
                dist.broadcast_object_list(["close", ()], src=0, group=self._ctx.control)
            except (RuntimeError, dist.DistBackendError) as exc:
                logger.warning("local ranks did not take the stop: %s", str(exc).splitlines()[0])
        for rank, process in enumerate(self._ranks, start=1):
            try:
                process.wait(CLOSE_TIMEOUT if orderly else 1.0)
            except subprocess.TimeoutExpired:
                if orderly:
                    logger.warning("local rank %d did not stop in time; terminating it", rank)
                process.terminate()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        self._dir.cleanup()
