"""Real `diloco-node join` processes inside islands (network namespaces), for the network tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

from tests.integration.nodes import FAST, NodeProcess
from tests.network.islands import Island

_GET = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"


@dataclass
class IslandNode(NodeProcess):
    """A node inside an island; its status server is on the island's loopback, so reads go through it."""

    island: Island | None = None

    def start(self) -> IslandNode:
        assert self.island is not None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = self.island.run([sys.executable, "-m", "diloco_node", "join", *self.args],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                       cwd=self.workdir)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        return self

    def get(self, path: str) -> Any:
        assert self.island is not None and self.status_url
        return json.loads(self.island.check_output([sys.executable, "-c", _GET, f"{self.status_url}{path}"]))


def node_options(island: Island, run_id: str) -> list[str]:
    """Fast test-node flags, listening on the island's address; no checkpoints, runs until stopped."""
    options = list(FAST)
    options[options.index("--listen") + 1] = f"/ip4/{island.address}/tcp/0"
    return [*options, "--run-id", run_id, "--min-peers", "2", "--checkpoint-dir", "", "--max-outer-steps", "0"]
