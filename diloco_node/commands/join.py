"""`diloco-node join`'s settings: the run's manifest taken, or the user's own options.

With --peer (or a manifest beside the checkpoint, which an earlier join wrote) the node takes the
run's manifest, fetched from a peer or read from disk, and keeps the user's node-level options
(train/manifest.take); a node naming neither a peer nor a run starts a run of its own. The command
line (cli.py) parses the options; this module decides whose settings the node runs with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diloco_node.config import FIELDS, NodeConfig

logger = logging.getLogger("diloco_node.cli")


def config_of_run(given: dict[str, Any], own: Callable[[], NodeConfig],
                  quiet_logs: Callable[[], None]) -> tuple[NodeConfig, str | None]:
    """The node's config and, when it is the run's, the line saying which run and from where.
    `given`: the options the user set (defaults left out); `own()`: the config of the user's options
    alone; `quiet_logs()`: set the log up before a fetch imports hivemind."""
    if given.get("manifest", "auto") == "off":
        return own(), None
    from diloco_node.config import build_config
    from diloco_node.train import manifest

    checkpoint_dir = str(given.get("checkpoint_dir", FIELDS["checkpoint_dir"].default))
    peers = list(given.get("peer") or [])
    # a node that names neither a peer nor a run starts a run of its own: no earlier run's copy is taken
    local = manifest.find_local(checkpoint_dir, given.get("run_id")) if peers or "run_id" in given else None
    if local is None and not peers:
        return own(), None
    if local is not None:
        taken, source = manifest.read_local(local), str(local)
    else:
        build_config({"peer": peers}, "options")  # a malformed --peer: its own one line, before any network
        owner = str(given.get("run_owner") or "")
        if owner:  # a permissioned run: only a manifest this key signed is taken; a malformed key is one line here
            from diloco_node.trust.admission import parse_public_key

            parse_public_key(owner)  # or AdmissionError
        quiet_logs()  # the check imported hivemind: its log is quieted before the fetch talks
        from diloco_node.swarm.manifests import ManifestUnavailable, fetch

        try:
            taken, source = fetch(peers, given.get("run_id"), owner)
        except ManifestUnavailable as exc:
            # A user who named the run set it up themselves: no peer (an older node, a hostile one)
            # stops them from joining with their own options, which the swarm's fingerprint check
            # still holds to the run's. Without a run id there is nothing to join with; and a user
            # who named the run's owner (--run-owner) joins on a manifest that owner signed only, run
            # id or not (check_signed). Without --run-owner a peer's claim that the run is
            # permissioned does not lock out a user who named the run: a hostile peer could serve it.
            if "run_id" not in given or (exc.unsigned and owner):
                raise
            logger.warning("%s; joining run %s with the options given", exc, given["run_id"])
            return own(), None
    if checkpoint_dir:
        directory = Path(checkpoint_dir) / taken.run_id
    else:  # no checkpoints: the run's files live as long as the process
        import atexit
        import shutil
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="diloco-run-"))
        atexit.register(shutil.rmtree, directory, True)
    cfg = manifest.take(taken, given, directory)  # or ManifestConflict, ManifestError
    if checkpoint_dir and local is None:
        manifest.write_local(taken, manifest.local_path(checkpoint_dir, taken.run_id))
    return cfg, f"{taken.summary()}, from {source}"
