"""The run manifest (diloco_node/manifest.py): built from a node's config, parsed as hostile input,
taken by a joiner with its own node-level options, refused in one line when tampered with or
when an option the joiner gave differs from the run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_node.config import NodeConfig
from diloco_node.swarm.manifests import parse_header
from diloco_node.train import manifest
from diloco_node.train.manifest import Manifest, ManifestConflict, ManifestError, build, parse, take
from diloco_node.train.tokenizer import train_tokenizer

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TEXTS = ["the quick brown fox jumps over the lazy dog", "a manifest names the run's files"] * 40


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(iter(TEXTS), 300, out)
    return out


@pytest.fixture(scope="module")
def hf_run(tokenizer_dir: Path) -> tuple[NodeConfig, Manifest]:
    cfg = NodeConfig(run_id="hand", model="llama-2m", tokenizer=str(tokenizer_dir), sync="blocking", inner_steps=7,
                     seq_len=64, batch_size=4, compression="int8")
    return cfg, build(cfg, 1_705_600)


def tiny_manifest(**settings: object) -> Manifest:
    return build(NodeConfig(run_id="tiny-run", **settings), 1234)  # type: ignore[arg-type]


# --- build and digests ------------------------------------------------------------------------


def test_build_holds_the_run_and_its_files(hf_run: tuple[NodeConfig, Manifest], tokenizer_dir: Path) -> None:
    cfg, m = hf_run
    assert m.run_id == "hand" and m.fingerprint == cfg.fingerprint()  # today's fingerprint: existing runs keep theirs
    assert m.settings["inner_steps"] == 7 and m.settings["sync"] == "blocking" and m.settings["compression"] == "int8"
    assert m.model == "llama-2m" and m.model_config is not None and json.loads(m.model_config)["model_type"] == "llama"
    assert m.model_digest == manifest.sha256(m.model_config)
    text = (tokenizer_dir / "tokenizer.json").read_text()
    assert m.tokenizer == text and m.tokenizer_digest == manifest.sha256(text)
    assert m.data is None and m.data_kind == "embedded" and m.eval_digest is None
    # a built-in preset is named, not shipped: every node has its shape
    tiny = tiny_manifest()
    assert tiny.model == "tiny" and tiny.model_config is None and tiny.tokenizer is None


def test_round_trip_and_digest(hf_run: tuple[NodeConfig, Manifest]) -> None:
    _, m = hf_run
    assert parse(m.encode()) == m
    assert parse(m.encode()).digest == m.digest and len(m.digest) == 16


def test_taken_config_has_the_run_fingerprint(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path) -> None:
    cfg, m = hf_run
    own = {"peer": ["/ip4/127.0.0.1/tcp/1/p2p/QmeSev1BKG3Kmiv7T6PYYCy2aFZguvEDGo54MbRj2gtUNd"], "threads": "1",
           "status": "127.0.0.1:0", "label": "eu", "micro_batch_size": "2", "checkpoint_dir": str(tmp_path)}
    taken = take(parse(m.encode()), own, tmp_path / "hand")
    assert taken.fingerprint() == cfg.fingerprint()
    assert (taken.swarm.run_id, taken.inner.inner_steps, taken.inputs.seq_len, taken.codec.compression) == \
        ("hand", 7, 64, "int8")
    # node-level: the user's
    assert (taken.local.threads, taken.swarm.label, taken.local.micro_batch_size) == (1, "eu", 2)
    assert Path(taken.inputs.model).read_text() == m.model_config  # the config.json, written as the manifest holds it
    assert (Path(str(taken.inputs.tokenizer)) / "tokenizer.json").read_text() == m.tokenizer


def test_schedule_given_overrides_and_same_values_pass(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path) -> None:
    _, m = hf_run
    # flags travel as text: the run's own values given again are no conflict
    taken = take(m, {"inner_steps": "3", "sync": "blocking", "compression": "int8", "outer_lr": "1.0",
                     "run_id": "hand", "model": "llama-2m"}, tmp_path)
    assert taken.inner.inner_steps == 3 and taken.fingerprint() == m.fingerprint


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "line"), [
    ({"sync": "eager"}, "--sync: the run's is blocking, given eager"),
    ({"compression": "none"}, "--compression: the run's is int8, given none"),
    ({"run_id": "other"}, "--run-id: the run's is hand, given other"),
    ({"outer_lr": "0.5"}, "--outer-lr: the run's is 1.0, given 0.5"),
    ({"model": "tiny"}, "--model: the run's is llama-2m (hf:llama), given tiny"),
    ({"tokenizer": ""}, None),  # bytes against the run's BPE: refused naming --tokenizer
])
def test_a_differing_run_level_option_is_one_short_line(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path,
                                                        given: dict[str, str], line: str | None) -> None:
    _, m = hf_run
    with pytest.raises(ManifestConflict) as caught:
        take(m, given, tmp_path)
    text = str(caught.value)
    assert "\n" not in text and len(text) < 160, text
    assert text.startswith(line or "--tokenizer: the run's is ")


def test_local_data_tells_what_to_pass(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 20))
    m = tiny_manifest(data=str(corpus))
    assert m.data_kind == "local" and m.eval_digest
    with pytest.raises(ManifestConflict, match=r"pass --data PATH .*held-out split digest " + str(m.eval_digest)):
        take(m, {}, tmp_path)
    assert take(m, {"data": str(corpus)}, tmp_path).fingerprint() == m.fingerprint
    other = tmp_path / "other.txt"
    other.write_text("\n".join(reversed(TEXTS * 20)) + "\nsomething else entirely")
    with pytest.raises(ManifestConflict, match=rf"--data: the run's held-out split digest is {m.eval_digest}, "
                       rf"'{other}' gives [0-9a-f]{{16}}: pass a copy of the run's data"):
        take(m, {"data": str(other)}, tmp_path)


def test_tampered_files_are_refused(hf_run: tuple[NodeConfig, Manifest]) -> None:
    _, m = hf_run
    raw = m.to_json()
    raw["tokenizer"]["text"] = raw["tokenizer"]["text"].replace("fox", "cat")
    with pytest.raises(ManifestError, match="tokenizer's file does not match the manifest's digest"):
        parse(json.dumps(raw).encode())
    raw = m.to_json()
    config = json.loads(raw["model"]["config"])
    config["num_hidden_layers"] += 1
    raw["model"]["config"] = json.dumps(config, sort_keys=True)
    with pytest.raises(ManifestError, match="config.json does not match"):
        parse(json.dumps(raw).encode())


def test_settings_that_do_not_give_the_fingerprint_are_refused(hf_run: tuple[NodeConfig, Manifest],
                                                               tmp_path: Path) -> None:
    _, m = hf_run
    raw = m.to_json()
    raw["settings"]["outer_lr"] = 0.9  # a changed run-level value under the old fingerprint
    with pytest.raises(ManifestError, match="not the .* the manifest names"):
        take(parse(json.dumps(raw).encode()), {}, tmp_path)


@pytest.mark.parametrize(("data", "match"), [
    (b"x" * (manifest.MAX_MANIFEST_BYTES + 1), "exceeds the limit"),
    (b"[" * 10 + b"]" * 10, "nested deeper"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"format": 2}', "format 2 is not 1"),
    (b'{"format": 1, "run_id": "a b"}', "run_id is not a run id"),
    (b'{"format": NaN}', "not JSON"),
])
def test_malformed_and_oversized_input_is_one_line(data: bytes, match: str) -> None:
    with pytest.raises(ManifestError, match=match) as caught:
        parse(data)
    assert "\n" not in str(caught.value)


def test_a_lone_surrogate_in_any_text_is_refused(hf_run: tuple[NodeConfig, Manifest]) -> None:
    """JSON's \\udc80 loads as a lone surrogate that no digest or file can encode: refused by parse
    (a tokenizer text holding one raised UnicodeEncodeError out of it, a model name out of encode)."""
    for path in (("model", "name"), ("data", "source"), ("settings", "sync"), ("tokenizer", "text")):
        raw = hf_run[1].to_json()
        raw[path[0]][path[1]] = "\udc80"
        with pytest.raises(ManifestError, match="is not a text of at most"):
            parse(json.dumps(raw).encode())


def test_another_protocol_names_the_fix(hf_run: tuple[NodeConfig, Manifest]) -> None:
    raw = hf_run[1].to_json()
    raw["protocol"] = 4
    with pytest.raises(ManifestError, match="protocol version 4.*install the run's version"):
        parse(json.dumps(raw).encode())


def test_local_copy_round_trips(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path) -> None:
    m = hf_run[1]
    path = manifest.local_path(str(tmp_path), m.run_id)
    manifest.write_local(m, path)
    assert manifest.find_local(str(tmp_path), "hand") == path
    assert manifest.find_local(str(tmp_path), None) == path  # the only run there: no run id needed
    assert manifest.find_local(str(tmp_path), "other") is None and manifest.find_local("", None) is None
    assert manifest.read_local(path) == m
    path.write_text("{")
    with pytest.raises(ManifestError, match=f"run manifest '{path}': malformed manifest"):
        manifest.read_local(path)


def test_a_node_serves_the_manifest_it_took(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path) -> None:
    _, m = hf_run
    taken = take(m, {"checkpoint_dir": str(tmp_path)}, tmp_path / "hand")
    assert manifest.served(taken, m.parameters).model == "model"  # its own would name the written config's directory
    manifest.write_local(m, manifest.local_path(str(tmp_path), "hand"))
    assert manifest.served(taken, m.parameters) == m  # the first node's, as it took it


def test_summary_and_show(hf_run: tuple[NodeConfig, Manifest]) -> None:
    m = hf_run[1]
    line = m.summary()
    assert "\n" not in line
    vocabulary = hf_run[0].fingerprint_fields()["tokenizer"]  # what `tokenizer train` printed for it
    for part in ("took run hand", "llama-2m (hf:llama)", "1,705,600 parameters", f"tokenizer digest {vocabulary}",
                 "codec int8", "sync blocking", "H=7", "the embedded corpus"):
        assert part in line, (part, line)
    assert "T=30s" in tiny_manifest(round_seconds=30.0).summary()
    shown = m.show()
    assert shown.startswith("run hand\n") and f"tokenizer digest {vocabulary}, tokenizer.json sha256 " \
        f"{m.tokenizer_digest}" in shown and 'sync = "blocking"' in shown


# --- fuzz: nothing a peer sends raises anything but ManifestError -------------------------------


def valid_bytes() -> bytes:
    return tiny_manifest(sync="blocking").encode()


@FUZZ
@given(data=st.binary(max_size=4096))
def test_arbitrary_bytes_only_ever_raise_manifest_error(data: bytes) -> None:
    try:
        parse(data)
    except ManifestError:
        pass


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=3), max_leaves=8)


@FUZZ
@given(path=st.sampled_from([("format",), ("run_id",), ("protocol",), ("fingerprint",), ("settings",),
                             ("settings", "sync"), ("settings", "inner_steps"), ("settings", "bogus"), ("model",),
                             ("model", "config"), ("model", "digest"), ("model", "parameters"), ("model", "name"),
                             ("tokenizer",), ("data",), ("data", "source"), ("data", "eval_digest")]),
       value=JSON_VALUES)
def test_a_valid_manifest_with_one_field_replaced_parses_or_is_refused(path: tuple[str, ...], value: object) -> None:
    raw = json.loads(valid_bytes())
    target = raw
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    try:
        got = parse(json.dumps(raw).encode())
    except ManifestError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(got, Manifest) and parse(got.encode()) == got


@FUZZ
@given(cut=st.integers(0, 400), junk=st.binary(max_size=64))
def test_a_damaged_valid_manifest_only_ever_raises_manifest_error(cut: int, junk: bytes) -> None:
    data = valid_bytes()
    damaged = data[:cut] + junk + data[cut + len(junk):]
    try:
        got = parse(damaged)
    except ManifestError:
        return
    assert isinstance(got, Manifest)


@FUZZ
@given(data=st.one_of(st.binary(max_size=600), JSON_VALUES.map(lambda v: json.dumps(v).encode())))
def test_a_server_header_only_ever_raises_manifest_error(data: bytes) -> None:
    try:
        run_id, size, signature = parse_header(data, None)
    except ManifestError:
        return
    assert isinstance(run_id, str) and 0 < size <= manifest.MAX_MANIFEST_BYTES
    assert signature is None or (isinstance(signature, str) and len(signature) <= manifest.MAX_SIGNATURE_CHARS)


# --- the CLI: a restart takes its run from the copy on disk, with no network --------------------


def test_join_takes_the_copy_beside_the_checkpoint_offline(hf_run: tuple[NodeConfig, Manifest], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from diloco_node.cli import main

    _, m = hf_run
    manifest.write_local(m, manifest.local_path(str(tmp_path / "ck"), m.run_id))
    started: list[NodeConfig] = []
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda cfg: started.append(cfg) or 0)

    def fetched(*_: object) -> None:
        raise AssertionError("the network was asked")

    monkeypatch.setattr("diloco_node.swarm.manifests.fetch", fetched)
    # a peer that does not exist: the copy on disk is taken before any network
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmeSev1BKG3Kmiv7T6PYYCy2aFZguvEDGo54MbRj2gtUNd"
    done = CliRunner().invoke(main, ["join", "--peer", peer, "--checkpoint-dir", str(tmp_path / "ck"),
                                     "--threads", "1"])
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("took run hand: ") and str(manifest.local_path(str(tmp_path / "ck"), "hand")) \
        in done.stdout
    assert started[0].fingerprint() == m.fingerprint and started[0].local.threads == 1
    # the same with --run-id alone (no peer at all); a conflicting run-level flag is one line, exit 2
    done = CliRunner().invoke(main, ["join", "--run-id", "hand", "--checkpoint-dir", str(tmp_path / "ck")])
    assert done.exit_code == 0 and started[1].fingerprint() == m.fingerprint
    done = CliRunner().invoke(main, ["join", "--run-id", "hand", "--checkpoint-dir", str(tmp_path / "ck"),
                                     "--compression", "none"])
    assert done.exit_code == 2 and done.stderr == \
        "diloco-node: error: --compression: the run's is int8, given none (leave it out to take the run's)\n"
    # naming neither a peer nor a run starts a run of one's own: the earlier run's copy is not taken
    done = CliRunner().invoke(main, ["join", "--checkpoint-dir", str(tmp_path / "ck")])
    assert done.exit_code == 0 and "took run" not in done.stdout and started[-1].swarm.run_id == "diloco-default"


def test_a_peer_without_a_manifest_stops_only_a_joiner_that_did_not_name_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An older or hostile --peer that serves no manifest: a joiner that named its run (--run-id, its
    own options) joins with them (the swarm's fingerprint check still holds); one with --peer alone
    has nothing to join with and exits 2 in one line."""
    from click.testing import CliRunner

    from diloco_node.cli import main
    from diloco_node.swarm.manifests import ManifestUnavailable

    started: list[NodeConfig] = []
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda cfg: started.append(cfg) or 0)

    def unavailable(addresses: list[str], wanted: str | None, *_: object) -> None:
        raise ManifestUnavailable(f"no run manifest taken from {addresses[0]}: it serves no manifest")

    monkeypatch.setattr("diloco_node.swarm.manifests.fetch", unavailable)
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmeSev1BKG3Kmiv7T6PYYCy2aFZguvEDGo54MbRj2gtUNd"
    common = ["--peer", peer, "--checkpoint-dir", str(tmp_path / "ck")]
    done = CliRunner().invoke(main, ["join", *common, "--run-id", "mine", "--compression", "int4"])
    assert done.exit_code == 0, done.output
    assert started[0].swarm.run_id == "mine" and started[0].codec.compression == "int4"
    assert "took run" not in done.stdout
    assert not (tmp_path / "ck" / "mine" / manifest.MANIFEST_NAME).exists()  # nothing taken, nothing written
    done = CliRunner().invoke(main, ["join", *common])
    assert done.exit_code == 2 and len(started) == 1
    assert done.stderr == f"diloco-node: error: no run manifest taken from {peer}: it serves no manifest\n"
