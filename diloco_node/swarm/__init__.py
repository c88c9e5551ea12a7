"""The swarm: everything this node does with its peers, behind one facade (facade.Swarm)."""

from diloco_node.swarm.bounded import HelperTimeout
from diloco_node.swarm.dht import SwarmError, SwarmSettings, publish_revocation
from diloco_node.swarm.facade import Swarm

__all__ = ["HelperTimeout", "Swarm", "SwarmError", "SwarmSettings", "publish_revocation"]
