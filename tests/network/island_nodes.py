"""Real `diloco-node join` processes inside islands (network namespaces), for the network tests."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from tests.integration.nodes import FAST, NodeProcess
from tests.network.islands import Island

_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@dataclass
class IslandNode(NodeProcess):
    """A node inside an island; its status server is on the island's loopback, so reads go through it."""

    island: Island | None = None

    def _popen(self, command: list[str], **options: Any) -> subprocess.Popen[str]:
        # inside the island's namespace, and killed with the islands at teardown if still running
        assert self.island is not None
        return self.island.run(command, **options)

    def get(self, path: str) -> Any:
        assert self.island is not None and self.status_url
        return json.loads(self.island.check_output([sys.executable, "-c", _GET, f"{self.status_url}{path}"]))


def node_options(island: Island, run_id: str) -> list[str]:
    """Fast test-node flags, listening on the island's address; no checkpoints, runs until stopped."""
    options = list(FAST)
    options[options.index("--listen") + 1] = f"/ip4/{island.address}/tcp/0"
    return [*options, "--run-id", run_id, "--min-peers", "2", "--checkpoint-dir", "", "--max-outer-steps", "0"]
