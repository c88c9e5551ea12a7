"""A config's fingerprint: what peers compare to tell whether they can average together.

Its own module because both sides compute it: config/ of the fields it fingerprints, and the
swarm's records of a config a peer published, to check that it is the one its fingerprint names.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

# The version of what nodes exchange: DHT records, payload and stream formats, the round protocol.
# It is part of every fingerprint, so nodes of different versions refuse each other with a message
# naming it instead of misreading each other. Raise it with any change to those formats.
PROTOCOL = 5


def fingerprint_of(fields: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of the fields as canonical JSON."""
    canonical = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
