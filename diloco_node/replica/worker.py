"""Local ranks 1..K−1 of a node (`python -m diloco_node.replica.worker`, started by ranks.py).

They only compute: each waits for rank 0's next call and runs it on its part of the replica,
until rank 0 says close. SIGINT is ignored (rank 0 stops them at a safe point), and a rank dies
with rank 0 whatever kills it.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from diloco_node.forks import become_helper
from diloco_node.replica.ranks import join_group, make_compute, settings_from_env


def main() -> int:
    become_helper()
    rank = int(os.environ["DILOCO_LOCAL_RANK"])
    if os.getppid() != int(os.environ["DILOCO_PARENT"]):
        return 1  # rank 0 died before PDEATHSIG was armed
    logging.basicConfig(level=os.environ.get("DILOCO_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", stream=sys.stderr)
    settings = settings_from_env(os.environ["DILOCO_REPLICA"])
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        ctx = join_group(settings, rank, os.environ["DILOCO_RENDEZVOUS"])
        compute = make_compute(settings, ctx)
        while True:
            message: list[object] = [None, None]
            dist.broadcast_object_list(message, src=0, group=ctx.control)
            method, args = message
            if method == "close":
                break
            getattr(compute, str(method))(*args)  # type: ignore[misc]
        dist.destroy_process_group()
    except Exception as exc:  # rank 0 reports the failure to the user; this is for the log
        logging.getLogger(__name__).error("local rank %d failed: %s", rank, str(exc).splitlines()[0] if str(exc)
                                          else type(exc).__name__)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
