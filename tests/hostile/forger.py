"""A hostile peer built on hivemind's own API only: it joins the run's DHT, copies an honest
presence record, changes it, signs it with a key of its own and keeps it fresh.
Usage: forger.py PEER_MULTIADDR RUN_ID ahead|config
- ahead: the record claims a far-ahead round (config and fingerprint as the honest one's);
- config: the record claims another config (fingerprint and one config value changed).

It prints `forging` once its record is stored, then refreshes it until SIGTERM, on which it shuts
its DHT down and exits 0.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from hivemind import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

FAR_AHEAD = 10**6
REFRESH_SECONDS = 2.0
TTL = 15.0


def honest_record(dht: DHT, key: str) -> dict:
    while True:
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict):
            for item in found.value.values():
                if isinstance(item.value, dict) and not item.value.get("left"):
                    return dict(item.value)
        time.sleep(0.5)


def main() -> None:
    peer, run_id, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    signer = RSASignatureValidator()  # our own key: the record is validly signed, by us
    dht = DHT(initial_peers=[peer], start=True, record_validators=[signer], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    key = f"{run_id}_nodes"
    me = str(dht.peer_id)
    honest = honest_record(dht, key)
    if mode == "ahead":
        forged = {**honest, "peer_id": me, "round": FAR_AHEAD, "ready_round": FAR_AHEAD, "exchanged_round": FAR_AHEAD}
    else:
        forged = {**honest, "peer_id": me, "fingerprint": "0" * 16, "config": {**honest["config"], "model": "forged"}}
    subkey = me.encode() + signer.local_public_key
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after the DHT's process has forked
    announced = False
    while not stop.is_set():
        stored = dht.store(key, subkey=subkey, value=forged, expiration_time=get_dht_time() + TTL)
        if stored and not announced:
            print("forging", flush=True)
            announced = True
        stop.wait(REFRESH_SECONDS)
    dht.shutdown()


if __name__ == "__main__":
    main()
