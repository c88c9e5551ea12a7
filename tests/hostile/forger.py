"""A hostile peer built on hivemind's own API only (and the run's wire formats, which anyone can
read): it joins the run's DHT under an identity of its own, copies an honest presence record,
changes it, signs it with its own libp2p key (so the record is validly its own) and keeps it fresh.

Usage: forger.py PEER_MULTIADDR RUN_ID MODE
- ahead: the record claims a far-ahead round (config and fingerprint as the honest one's);
- config: the record claims another config (another fingerprint, whose config is not published);
- intruder: a permissioned run: the record carries an honest node's admission; every second it
  also asks each honest node for its payloads and its state, printing what it got;
- poison: serves the run's state with φ shifted by 1 (copied from an honest node, then changed),
  its record following an honest node's round and digest; its peer id sorts before the honest
  ones, so a joiner asks it first;
- drip: as poison, but serves the state one kilobyte a second;
- nested, far, named: as poison, but serves the honest bytes with a lying header: metadata nested
  30,000 deep within the size limit, a round 1,000 ahead of the records, or naming the honest node
  as the server (a joiner would complete the rounds in flight from the group that node names);
- huge: takes part in every round (hivemind's matchmaking, the run's payload protocol) with a
  pseudo-gradient ~1e6 times an honest one's norm, declaring 1e15 tokens (the most a node
  accepts: more is refused as malformed);
- fuzz: takes part in every round with a valid payload damaged at random (bytes flipped, cut,
  grown), a fresh one each round. It prints `contributed ROUND GROUP_SIZE` per round it averaged in.
- owner: a run exchanging by butterfly: takes part in every round and owns a part (pushing nothing
  of its own); it waits for every member's push of its part and answers with the mean of their
  slices and a well-formed report, sealed with its own key as an honest owner does: in even rounds
  times 1e16 to everyone, in odd rounds halved for every second pusher (two sealed versions:
  different bytes to different members, each within the clip bound).
- sybils N (N ≥ 2): N identities from one process, one record each, all following the honest
  round but never ready, all claiming a far-ahead exchanged round, listing each other as proven
  and vouched for, and announcing one served state: an honest node's, shifted by 1, which the
  first identity (the DHT's own) serves, after taking the bootstrap node's state. `sybils N T S`:
  T − 1 more identities (each from a libp2p daemon of its own) take that state too, one every S
  seconds once the records are out: each is then a newcomer that never gets ready
  (benchmarks/newcomer_sybils.py).

It prints `forging PEER_ID` once its record is stored, then refreshes it until SIGTERM, on which
it shuts its DHT down and exits 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

FAR_AHEAD = 10**6
REFRESH_SECONDS = 2.0
TTL = 15.0
HEADER = 8
ROUND_BITS = 24  # the run's matchmaking key: the round number in binary
MATCHMAKING_TIME = 2.0  # the honest nodes' --matchmaking-time in the tests
HUGE_TOKENS = 1e15  # mode huge's declaration: the most a node accepts (swarm/messages.py MAX_DECLARED)


def make_identity(below: list[str] | None = None) -> tuple[Path, RSASignatureValidator, str]:
    """A libp2p RSA key file, hivemind's record signer holding the same key, and its peer id (one
    that sorts before every id in `below`, when given)."""
    while True:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
        data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()
        peer_id = PeerID.from_identity(data).to_base58()
        if not below or peer_id < min(below):
            break
    path = Path(tempfile.mkdtemp()) / "forger.key"
    path.write_bytes(data)
    path.chmod(0o600)
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped.__setstate__({"_private_key": der})
    return path, RSASignatureValidator(wrapped), peer_id


class ManyKeys(RSASignatureValidator):
    """hivemind's record signer for several identities at once: a record is signed with the key
    whose public half its subkey carries (hivemind's own signer holds one key)."""

    def __init__(self, signers: list[RSASignatureValidator]):
        super().__init__(signers[0]._private_key)
        self._signers = signers

    def sign_value(self, record) -> bytes:  # type: ignore[no-untyped-def]
        for signer in self._signers:
            if signer.local_public_key in (record.subkey or b""):
                return signer.sign_value(record)
        return record.value


def take_state(run, bootstrap: str, namespace: str, keys: list[Path], spacing: float, stop: threading.Event) -> None:
    """The bootstrap node's state, taken by each identity of `keys` from a libp2p daemon of its own,
    `spacing` seconds apart (the node then vouches for each in its record)."""
    from hivemind.p2p import P2P

    for path in keys:
        if stop.wait(spacing):
            return
        p2p = run(P2P.create(initial_peers=[bootstrap], identity_path=str(path)))
        try:
            fetch_state(p2p, run, bootstrap.rpartition("/p2p/")[2], namespace)
        finally:
            run(p2p.shutdown())


def sybils(dht: DHT, p2p, run, namespace: str, key: str, identities: list[tuple[RSASignatureValidator, str]],
           honest: list[dict], bootstrap: str, keys: list[Path], spacing: float) -> None:
    """Mode `sybils`: serve a poisoned state from the first identity, publish every identity's
    record; identities of `keys` take the `bootstrap` node's state once those are out."""
    header, vectors = fetch_state(p2p, run, bootstrap.rpartition("/p2p/")[2], namespace)
    poisoned = (np.frombuffer(vectors, dtype=np.float32) + 1).astype(np.float32).tobytes()
    # the settled round and digest of the state it serves, as an honest record announces them
    served = (json.loads(header)["metadata"]["round"], hashlib.sha256(poisoned).hexdigest()[:16])

    async def serve(_info, reader, writer) -> None:
        await reader.readexactly(int.from_bytes(await reader.readexactly(HEADER), "big"))
        writer.write(len(header).to_bytes(HEADER, "big") + header + len(poisoned).to_bytes(HEADER, "big") + poisoned)
        await writer.drain()
        writer.close()

    run(p2p.add_binary_stream_handler(f"{namespace}_state", serve))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ids = [peer for _, peer in identities]
    announced = False
    while not stop.is_set():
        now = [r for r in honest_records(dht, key, stop) if r["peer_id"] not in ids]
        if not now:
            stop.wait(0.2)
            continue
        round_ = max(r["round"] for r in now)
        stored = 0
        for signer, me in identities:
            forged = {**now[0], "peer_id": me, "round": round_, "ready_round": round_ - 1,
                      "exchanged_round": FAR_AHEAD, "served_round": served[0], "served_digest": served[1],
                      "vouched": ids[:8]}
            if "proven" in forged:  # the records of this version list proven peers: claim each other
                forged["proven"] = ids[:16]
            stored += bool(dht.store(key, subkey=me.encode() + signer.local_public_key, value=forged,
                                     expiration_time=get_dht_time() + TTL))
        if stored == len(identities) and not announced:
            print(f"forging {' '.join(ids)}", flush=True)
            announced = True
            threading.Thread(target=take_state, args=(run, bootstrap, namespace, keys, spacing, stop),
                             daemon=True).start()
        stop.wait(REFRESH_SECONDS)


def honest_records(dht: DHT, key: str, stop: threading.Event | None = None) -> list[dict]:
    """The run's live records, sorted by peer id, once there are any ([] once `stop` is set)."""
    while stop is None or not stop.is_set():
        found = dht.get(key, latest=True)
        if found is not None and isinstance(found.value, dict):
            values = [dict(item.value) for item in found.value.values()
                      if isinstance(item.value, dict) and not item.value.get("left")]
            if values:
                return sorted(values, key=lambda v: v["peer_id"])
        time.sleep(0.5)
    return []


async def ask(p2p, peer: str, handler: str, request: dict, limit: int = 1 << 26) -> list[bytes]:
    """Send one request on `handler` and read the length-prefixed answers until the stream ends."""
    for attempt in range(5):  # the daemon may not have routed the peer yet
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), 10)
            break
        except Exception:
            if attempt == 4:
                raise
            await asyncio.sleep(1.0)
    body = json.dumps(request).encode()
    writer.write(len(body).to_bytes(HEADER, "big") + body)
    await writer.drain()
    answers = []
    try:
        while True:
            header = await asyncio.wait_for(reader.readexactly(HEADER), 10)
            size = int.from_bytes(header, "big")
            if size > limit:
                break
            answers.append(await asyncio.wait_for(reader.readexactly(size), 30))
            if request.get("round") is not None and len(answers) == 2:
                writer.write(b"\x01")  # the payload protocol's acknowledgement
                await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    writer.close()
    return answers


def fetch_state(p2p, run, peer: str, namespace: str) -> tuple[bytes, bytes]:
    """An honest node's state (its header, then its vectors), as any peer of an open run may ask."""
    while len(state := run(ask(p2p, peer, f"{namespace}_state", {"admission": ""}))) < 2:
        time.sleep(0.5)  # blocking nodes share between exchanges
    return state[0], state[1]


def bad_payload(mode: str, numel: int, rng: np.random.Generator) -> bytes:
    """A payload in the run's format (its codec module is public, like its wire format)."""
    from diloco_node.codec import CodecConfig, make_codec  # the format only: no node code runs here

    codec = make_codec(CodecConfig(name="none"))
    if mode == "huge":
        return codec.encode(torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)) * 1e3)
    valid = bytearray(codec.encode(torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)) * 1e-3))
    damage = rng.integers(3)
    if damage == 0:
        for index in rng.integers(len(valid), size=int(rng.integers(1, 16))):
            valid[index] ^= int(rng.integers(1, 256))
        return bytes(valid)
    if damage == 1:
        return bytes(valid[:int(rng.integers(1, len(valid)))])
    return bytes(valid) + rng.bytes(int(rng.integers(1, 4096)))


LOOP: list[asyncio.AbstractEventLoop] = []  # the loop p2p's streams run on (main sets it)


async def read_message(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readexactly(int.from_bytes(await reader.readexactly(HEADER), "big")), 60)


def message(body: bytes) -> bytes:
    return len(body).to_bytes(HEADER, "big") + body


async def push_nothing(p2p, owner_: str, namespace: str, round_: int, index: int, group: list[str]) -> None:
    """A butterfly push with no payload (we contribute nothing); its answer is read and dropped."""
    request = {"round": round_, "part": index, "group": group, "admission": "", "tokens": 0.0, "norm": 0.0,
               "norms": []}
    try:
        _, reader, writer = await asyncio.wait_for(
            p2p.call_binary_stream_handler(PeerID.from_base58(owner_), f"{namespace}_reduce"), 10)
        writer.write(message(json.dumps(request).encode()) + message(b""))
        await writer.drain()
        await read_message(reader)
        await read_message(reader)
        writer.write(b"\x01")
        await writer.drain()
        writer.close()
    except Exception:  # noqa: BLE001  (a round we were not counted in)
        pass


def owner(numel: int, me: str, namespace: str, key: rsa.RSAPrivateKey):
    """The push handler of a hostile butterfly owner (see the module's docstring)."""
    from diloco_node.codec import CodecConfig, make_codec  # the formats only: no node code runs here
    from diloco_node.round import part_bounds
    from diloco_node.swarm.butterfly import digest
    from diloco_node.trust.seals import Sealer, statement

    sealer = Sealer(key)

    codec = make_codec(CodecConfig(name="none"))
    pushes: dict[int, dict[str, tuple[dict, bytes]]] = {}
    answered: dict[int, int] = {}

    async def serve(info, reader, writer) -> None:
        request = json.loads(await read_message(reader))
        payload = await read_message(reader)
        round_, peer = request["round"], str(info.peer_id)
        pushes.setdefault(round_, {})[peer] = request, payload
        others = {p for p in request["group"] if p != me}
        for _ in range(100):  # every member's push, or 10 s
            if set(pushes[round_]) >= others:
                break
            await asyncio.sleep(0.1)
        start, end = part_bounds(numel, len(request["group"]), 1)[request["part"]]
        used = sorted(p for p, (_, body) in pushes[round_].items() if body)
        mean = sum(codec.decode(pushes[round_][p][1], end - start) for p in used) / max(len(used), 1)
        answered[round_] = answered.get(round_, 0) + 1
        if round_ % 2 == 0:
            mean = mean * 1e16
        elif answered[round_] % 2 == 0:
            mean = mean * 0.5
        report = {"used": used, "tokens": [pushes[round_][p][0]["tokens"] for p in used], "clipped": [],
                  "rejected": [], "declared": {p: [pushes[round_][p][0]["norm"], pushes[round_][p][0]["tokens"],
                                                   pushes[round_][p][0]["norms"]] for p in used}}
        averaged = codec.encode(mean) if used else b""
        signed = statement(namespace, round_, request["part"], sorted(request["group"]),
                           digest((averaged, json.loads(json.dumps(report)))))
        report["seal"] = sealer.seal(signed).to_wire()
        writer.write(message(json.dumps(report).encode()) + message(averaged))
        await writer.drain()
        await reader.read(1)
        writer.close()
    return serve


def contribute(dht: DHT, p2p, run, namespace: str, key: str, me: str, signer, mode: str, numel: int,
               stop: threading.Event, identity: Path) -> None:
    """Take part in every round the honest nodes are ready for, with a bad payload."""
    averager = DecentralizedAverager([torch.zeros(1)], dht, start=True, prefix=namespace,
                                     min_matchmaking_time=MATCHMAKING_TIME, request_timeout=1.0,
                                     allow_state_sharing=False)
    rng = np.random.default_rng(0)
    offers: dict[int, tuple[bytes, list[str] | None]] = {}

    async def serve(_info, reader, writer) -> None:
        request = json.loads(await reader.readexactly(int.from_bytes(await reader.readexactly(HEADER), "big")))
        payload, group = offers.get(request.get("round"), (b"", None))
        meta = json.dumps({"tokens": HUGE_TOKENS if mode == "huge" else 4096.0, "group": group}).encode()
        writer.write(len(meta).to_bytes(HEADER, "big") + meta + len(payload).to_bytes(HEADER, "big") + payload)
        await writer.drain()
        await reader.read(1)
        writer.close()

    run(p2p.add_binary_stream_handler(f"{namespace}_payload", serve))
    if mode == "owner":
        private = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(identity.read_bytes()).data,
                                                     password=None)
        assert isinstance(private, rsa.RSAPrivateKey)
        run(p2p.add_binary_stream_handler(f"{namespace}_reduce", owner(numel, me, namespace, private)))
    done = -1
    while not stop.is_set():
        honest = [r for r in honest_records(dht, key, stop) if r["peer_id"] != me]
        if not honest:  # the honest nodes have left (the run is over): wait for SIGTERM
            stop.wait(0.2)
            continue
        forged = {**honest[0], "peer_id": me}
        dht.store(key, subkey=me.encode() + signer.local_public_key, value=forged,
                  expiration_time=get_dht_time() + TTL)
        round_ = min(r["ready_round"] for r in honest)
        if round_ <= done or any(r["round"] != round_ for r in honest):
            stop.wait(0.2)  # not every honest node is ready for a round we have not done yet
            continue
        offers[round_] = (bad_payload(mode, numel, rng), None)
        averager.set_group_bits(format(round_ % 2**ROUND_BITS, f"0{ROUND_BITS}b"))
        control = averager.step(gather={"round": round_}, timeout=4 * MATCHMAKING_TIME + 5, wait=False,
                                scheduled_time=get_dht_time() + MATCHMAKING_TIME)
        while not control.done() and not stop.wait(0.1):
            pass  # a SIGTERM mid-step stops us now, not after the step's 13 s (the test allows 15 s in all)
        if not control.done():
            control.cancel()
            break
        try:
            group = sorted(str(peer) for peer in control.result())
        except Exception:  # no group this time
            group = []
        offers[round_] = (offers[round_][0], group or None)
        if group and mode == "owner":
            for index, other in enumerate(group):  # an empty push each: the owners need not wait for us
                if other != me:
                    asyncio.run_coroutine_threadsafe(push_nothing(p2p, other, namespace, round_, index, group),
                                                     LOOP[0])
        print(f"contributed {round_} {len(group)}", flush=True)
        done = round_
    averager.shutdown()


STATE_MODES = ("poison", "drip", "nested", "far", "named")


def lying_header(header: bytes, mode: str, me: str) -> bytes:
    """An honest state's answer header as the hostile server `me` sends it in `mode`."""
    fields = json.loads(header)
    metadata = {**fields["metadata"], "server": me}
    if mode == "nested":  # within the joiner's 64 KiB limit on the header
        return json.dumps({**fields, "metadata": metadata})[:-1].encode() + \
            b', "deep": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    if mode == "far":
        metadata["round"] += 1000
    if mode == "named":
        metadata["server"] = fields["metadata"]["server"]
    return json.dumps({**fields, "metadata": metadata}).encode()


def main() -> None:
    peer, run_id, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    count = int(sys.argv[4]) if mode == "sybils" else 1
    takers, spacing = (int(sys.argv[5]), float(sys.argv[6])) if mode == "sybils" and len(sys.argv) > 6 else (1, 0.0)
    key = f"{run_id}_nodes"
    scout = DHT(initial_peers=[peer], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                record_validators=[RSASignatureValidator()])  # strips the signatures off what it reads
    honest = honest_records(scout, key)
    scout.shutdown()
    path, signer, me = make_identity([r["peer_id"] for r in honest] if mode in STATE_MODES else None)
    more = [make_identity() for _ in range(count - 1)]
    identities = [(signer, me)] + [(other_signer, other_id) for _, other_signer, other_id in more]
    dht = DHT(initial_peers=[peer], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=str(path),
              record_validators=[ManyKeys([s for s, _ in identities]) if count > 1 else signer])
    assert str(dht.peer_id) == me
    namespace = f"{run_id}_{honest[0]['fingerprint']}"
    loop = asyncio.new_event_loop()
    LOOP.append(loop)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    run = lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result(120)  # noqa: E731
    p2p = run(dht.replicate_p2p())
    address, _, bootstrap_id = peer.rpartition("/p2p/")
    run(p2p._client.connect(PeerID.from_base58(bootstrap_id), [Multiaddr(address)]))  # so that its daemon routes it
    if mode == "sybils":
        sybils(dht, p2p, run, namespace, key, identities, honest, peer,
               [path for path, _, _ in more[:takers - 1]], spacing)
        dht.shutdown()
        return
    if mode in ("huge", "fuzz", "owner"):
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        header, vectors = fetch_state(p2p, run, honest[0]["peer_id"], namespace)
        numel = len(vectors) // 4 // json.loads(header)["vectors"]
        print(f"forging {me}", flush=True)
        contribute(dht, p2p, run, namespace, key, me, signer, mode, numel, stop, path)
        dht.shutdown()
        return
    if mode in STATE_MODES:  # from the highest peer id: the honest node (other forgers sort before it)
        header, vectors = fetch_state(p2p, run, honest[-1]["peer_id"], namespace)
        poisoned = (np.frombuffer(vectors, dtype=np.float32) + 1).astype(np.float32).tobytes() \
            if mode in ("poison", "drip") else vectors
        header = lying_header(header, mode, me)

        async def serve(_info, reader, writer) -> None:
            await reader.readexactly(int.from_bytes(await reader.readexactly(HEADER), "big"))
            writer.write(len(header).to_bytes(HEADER, "big") + header + len(poisoned).to_bytes(HEADER, "big"))
            for start in range(0, len(poisoned), 1024 if mode == "drip" else len(poisoned)):
                writer.write(poisoned[start:start + (1024 if mode == "drip" else len(poisoned))])
                await writer.drain()
                if mode == "drip":
                    await asyncio.sleep(1.0)
            writer.close()

        run(p2p.add_binary_stream_handler(f"{namespace}_state", serve))

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after the DHT's process has forked
    announced = False
    while not stop.is_set():
        source = [r for r in honest_records(dht, key) if r["peer_id"] != me][-1] if mode in STATE_MODES \
            else honest[0]
        forged = {**source, "peer_id": me}
        if mode == "ahead":
            forged.update(round=FAR_AHEAD, ready_round=FAR_AHEAD, exchanged_round=FAR_AHEAD)
        elif mode == "config":
            forged.update(fingerprint="0" * 16)
        stored = dht.store(key, subkey=me.encode() + signer.local_public_key, value=forged,
                           expiration_time=get_dht_time() + TTL)
        if stored and not announced:
            print(f"forging {me}", flush=True)
            announced = True
        if not announced:  # a store that failed under load: our first line names us, so try it again first
            stop.wait(1.0)
            continue
        if mode == "intruder":
            for target in honest:
                for round_ in range(max(0, target["round"] - 1), target["round"] + 2):
                    answers = run(ask(p2p, target["peer_id"], f"{namespace}_payload",
                                      {"round": round_, "admission": target["admission"]}))
                    print(f"payload {target['peer_id']} {round_} {len(answers[1]) if len(answers) > 1 else 0}",
                          flush=True)
                answers = run(ask(p2p, target["peer_id"], f"{namespace}_state", {"admission": target["admission"]}))
                sharing = bool(answers) and json.loads(answers[0]).get("sharing") is True
                print(f"state {target['peer_id']} {'served' if sharing else 'refused'}", flush=True)
        stop.wait(REFRESH_SECONDS)
    dht.shutdown()


if __name__ == "__main__":
    main()
