"""A node's local compute (docs/architecture.md §2, §5): the `Replica` seam and its layouts.

A replica loads φ, trains inner steps over the node's K local ranks and hands back θ, always in
the canonical layout (layout.py), so the round engine never knows how the node splits the model:
  single.py    one process, one device
  fsdp.py      FSDP2 shards over K ranks (each holds ~1/K of θ, its gradients and AdamW state)
  pipeline.py  K pipeline stages (each holds its own layers)
  ranks.py     rank 0's side of a multi-rank replica: starts ranks 1..K−1 and drives them
"""

from diloco_node.replica.base import Replica, ReplicaError, ReplicaSettings, settings_of
from diloco_node.replica.factory import make_replica

__all__ = ["Replica", "ReplicaError", "ReplicaSettings", "make_replica", "settings_of"]
