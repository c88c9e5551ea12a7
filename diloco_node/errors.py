"""The one base of every error a user may see (docs/architecture.md, "Errors and exit codes").

Each error says what went wrong in one line, fit to print after `diloco-node: error:`, and carries
the exit code the command ends with: 2 for bad input or a swarm that will not have us (fix and
retry), 1 for a failure of this machine mid-run (resume from the last checkpoint). Subclasses keep
the builtin base they always had (ValueError, RuntimeError), so callers that catch those still do.
"""

from __future__ import annotations


class NodeError(Exception):
    """A problem phrased as one line for the person running the node."""

    exit_code = 2
