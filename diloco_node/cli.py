"""Command line: parses flags, env vars and the TOML file into a NodeConfig, and nothing more.

Options are generated from NodeConfig's fields so that a flag, DILOCO_<KEY> and a config key can
never drift apart, and defaults are only NodeConfig's. Every user-facing failure is a NodeError
(errors.py), and every command ends on one the same way (Commands.invoke): one line on stderr,
`diloco-node: error: <message>`, and the error's exit code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from click.core import ParameterSource

from diloco_node.config import DEFAULT_STATUS_PORT, FIELDS, NodeConfig, describe, load_config, unset_default
from diloco_node.errors import NodeError

if TYPE_CHECKING:
    from diloco_node.telemetry.progress import Meter


class InputError(NodeError, ValueError):
    """Bad input a command finds itself (a URL, an address), or a status server that will not answer."""


def fail(message: str) -> NoReturn:
    raise InputError(message) from None


class Commands(click.Group):
    """The one place a command's NodeError ends it: one line on stderr and the error's exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NodeError as exc:
            click.echo(f"diloco-node: error: {exc}", err=True)
            sys.exit(exc.exit_code)


def _option_for(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    field = FIELDS[name]
    flag = "--" + name.replace("_", "-")
    envvar = f"DILOCO_{name.upper()}"
    is_list = field.annotation == list[str]
    default = unset_default(name) or field.get_default(call_default_factory=True)
    help_text = f"{describe(name)} [default: {default}; env {envvar}]"
    if is_list:
        return click.option(flag, name, multiple=True, envvar=envvar, help=help_text)
    # numbers travel as text: pydantic parses them, so a bad one is the same one line as a bad file value
    # (click's own parsing would print its usage block)
    numbers: dict[Any, str] = {int: "INTEGER", float: "FLOAT", int | None: "INTEGER", float | None: "FLOAT"}
    return click.option(flag, name, type=str, default=None, envvar=envvar, help=help_text,
                        metavar=numbers.get(field.annotation, "TEXT"))


def node_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for name in reversed(list(FIELDS)):  # every section's fields, in SECTIONS' order
        func = _option_for(name)(func)
    return click.option("--config", "config_file", type=str, envvar="DILOCO_CONFIG",
                        help="TOML file with any of these options as keys")(func)


def explicit_values(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The options set by flag or environment variable (click already applied flag > env), by field name."""
    return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()
            if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
            and value not in (None, ())}


def resolve_config(ctx: click.Context, config_file: str | None, values: dict[str, Any]) -> NodeConfig:
    """Flags and env vars override the file; the file overrides defaults."""
    return load_config(config_file, explicit_values(ctx, values))  # or ConfigError


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # hivemind logs its internal retries, shutdown races between its helper processes and p2pd's
    # listener notices as errors, with tracebacks; whatever of that matters reaches the user as one
    # line from our own modules. Its errors stay visible for debugging.
    hivemind_level = logging.ERROR if level == "DEBUG" else logging.CRITICAL
    # hivemind sets its logger's level from this variable when it is first imported, which for a node
    # that names no --peer is after this call (and in every process it starts)
    os.environ["HIVEMIND_LOGLEVEL"] = logging.getLevelName(hivemind_level)
    logging.getLogger("hivemind").setLevel(hivemind_level)
    for handler in logging.getLogger("hivemind").handlers:
        handler.setLevel(hivemind_level)
    # hivemind's all-reduce cancels its own futures when a group falls apart; asyncio then reports
    # each as "Future exception was never retrieved" with a traceback (the failure itself is our one line)
    logging.getLogger("asyncio").addFilter(_not_a_cancelled_future)


def _not_a_cancelled_future(record: logging.LogRecord) -> bool:
    # uvloop's exception handler logs with exc_info=False when it has no exception: not a tuple
    cancelled = isinstance(record.exc_info, tuple) and isinstance(record.exc_info[1], asyncio.CancelledError)
    if cancelled and record.getMessage().startswith("Future exception was never retrieved"):
        return False
    # a manifest fetch whose p2p daemon failed to start (an unreachable --peer) has closed its loop when
    # asyncio's child watcher reaps the daemon: its one line already said why
    message = record.getMessage()
    return not (message.startswith("Loop ") and "that handles pid" in message and message.endswith("is closed"))


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """diloco-node: train one model together over the internet with DiLoCo over a hivemind swarm."""


@main.command()
@node_options
@click.option("--log-level", default="INFO", envvar="DILOCO_LOG_LEVEL",
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]), help="log verbosity")
@click.pass_context
def join(ctx: click.Context, config_file: str | None, log_level: str, **values: Any) -> None:
    """Join a swarm (or start one when no --peer is given) and train until stopped.

    Example: diloco-node join --peer /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
    """
    from diloco_node.commands.join import config_of_run

    cfg, taken = config_of_run(given_values(ctx, config_file, values), lambda: resolve_config(ctx, config_file, values),
                               lambda: setup_logging(log_level))
    if taken is not None:
        click.echo(taken)
    # after the config: checking a --peer imports hivemind, whose import sets its own log handler up
    setup_logging(log_level)
    cfg.fingerprint()  # reads the tokenizer and the data once: a bad one ends here, before anything is made
    from diloco_node.daemon.runner import run_node  # heavy imports (torch, hivemind) only once input is valid

    sys.exit(run_node(cfg))


def given_values(ctx: click.Context, config_file: str | None, values: dict[str, Any]) -> dict[str, Any]:
    """The options the user set (flags and env over the file), by field name; defaults left out."""
    from diloco_node.config import read_toml

    given = read_toml(config_file) if config_file else {}
    given.update(explicit_values(ctx, values))
    return given


@main.group(cls=Commands)
def run() -> None:
    """A run's manifest: its settings, model, tokenizer and data, as its nodes serve it."""


def _manifest_at(address: str, run_id: str | None) -> Any:
    """The manifest a node serves at ADDRESS (a peer multiaddr), or a run.json (with the run.sig beside
    it), as it is: its signature, if any, not checked."""
    from diloco_node.train import manifest

    if Path(address).is_file():
        return manifest.read_local(Path(address))
    from diloco_node.config import build_config

    build_config({"peer": [address]}, "the address")  # or one line saying what is wrong with it
    setup_logging("WARNING")
    from diloco_node.swarm.manifests import fetch

    return fetch([address], run_id, signed=False)[0]  # or ManifestUnavailable


@run.command("show")
@click.option("--run-id", default=None, help="the run to show (default: the one the node serves)")
@click.option("--json", "as_json", is_flag=True, help="the manifest itself, as JSON")
@click.argument("address")
def run_show(run_id: str | None, as_json: bool, address: str) -> None:
    """Print the manifest of the run a node serves, from its ADDRESS (a peer multiaddr, as given to
    --peer) or a run.json a joiner wrote beside its checkpoint, without joining; for a permissioned
    run, whether its owner signed it.

    Example: diloco-node run show /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
    """
    taken = _manifest_at(address, run_id)
    click.echo(json.dumps(taken.to_json(), indent=1, sort_keys=True) if as_json else taken.show())


@run.command("sign")
@click.option("--owner-key", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the run owner's key (from keygen)")
@click.option("--run-id", default=None, help="the run to sign (default: the one the node serves)")
@click.option("--checkpoint-dir", default="checkpoints", show_default=True,
              help="write run.json and run.sig under DIR/<run id>/ (the --checkpoint-dir of a node to serve them)")
@click.argument("address")
def run_sign(owner_key: Path, run_id: str | None, checkpoint_dir: str, address: str) -> None:
    """Sign a permissioned run's manifest with the owner's key: read it from a node's ADDRESS (as
    given to --peer) or a run.json, check that it names this key as its --run-owner, and write it
    with the signature (run.json, run.sig) under DIR/<run id>/. A node whose --checkpoint-dir is DIR
    serves the signature beside the manifest (a running one from its next answer on), and so does
    every joiner that took it; joiners of the run take only a manifest its owner signed.

    Example: diloco-node run sign --owner-key owner.key /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...
    """
    from diloco_node.train import manifest
    from diloco_node.trust.admission import load_owner_key

    if not checkpoint_dir:
        fail("--checkpoint-dir: give the directory of the node that is to serve the signed manifest")
    key = load_owner_key(owner_key)  # or AdmissionError, before any network
    signed = manifest.sign(_manifest_at(address, run_id), key)  # or ManifestError: an open run, another owner
    path = manifest.local_path(checkpoint_dir, signed.run_id)
    manifest.write_local(signed, path)
    click.echo(f"signed run {signed.run_id}'s manifest {signed.digest} (fingerprint {signed.fingerprint}): "
               f"{path}, {manifest.signature_path(path)}")


@main.command("config")
@node_options
@click.pass_context
def show_config(ctx: click.Context, config_file: str | None, **values: Any) -> None:
    """Print the effective configuration (flags > env > file > defaults) as TOML, a table per section
    (a file `--config` reads back), and its fingerprint.

    Example: DILOCO_INNER_STEPS=100 diloco-node config --config run.toml --batch-size 8
    """
    from diloco_node.config import as_toml

    cfg = resolve_config(ctx, config_file, values)
    click.echo(as_toml(cfg), nl=False)
    click.echo(f"# fingerprint {cfg.fingerprint()}")


@main.command("identity")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def make_identity(path: Path) -> None:
    """Create a node's libp2p key at PATH (kept if it exists) and print its peer id, so that its
    address is known before the node first starts; give it to `join --identity PATH`.

    Example: diloco-node identity checkpoints/identity.key
    """
    from diloco_node.swarm.identity import create

    click.echo(create(path))  # or IdentityError


@main.command()
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
def keygen(path: Path) -> None:
    """Create a run owner's key at PATH (never overwriting one) and print its public key, which
    every node of a permissioned run is given as --run-owner.

    Example: diloco-node keygen owner.key
    """
    from diloco_node.trust.admission import generate_owner_key

    click.echo(generate_owner_key(path))  # or AdmissionError


def _signed(owner_key: Path, kind: str, run_id: str, peer_id: str, expires: str = "never") -> str:
    from diloco_node.trust.admission import Claims, check_peer_id, load_owner_key, parse_expiry, sign

    claims = Claims(kind, run_id, check_peer_id(peer_id), parse_expiry(expires) if kind == "admit" else None)
    return sign(load_owner_key(owner_key), claims)  # or AdmissionError


@main.command()
@click.option("--owner-key", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the run owner's key (from keygen)")
@click.option("--run-id", required=True, help="the run the admission is for")
@click.option("--expires", default="never", show_default=True,
              help="never, a duration (90m, 12h, 30d, 2w) or a date (2026-12-31, UTC)")
@click.argument("peer_id")
def admit(owner_key: Path, run_id: str, expires: str, peer_id: str) -> None:
    """Print an admission to run RUN for PEER_ID (from `diloco-node identity PATH`), signed with
    the owner's key; the node joins with --admission TOKEN (or a file holding it).

    Example: diloco-node admit --owner-key owner.key --run-id demo --expires 30d QmYy...
    """
    click.echo(_signed(owner_key, "admit", run_id, peer_id, expires))


@main.command()
@click.option("--owner-key", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the run owner's key (from keygen)")
@click.option("--run-id", required=True, help="the run to revoke the admission in")
@click.option("--peer", "peers", multiple=True, required=True, help="a node of the run to publish through")
@click.argument("peer_id")
def revoke(owner_key: Path, run_id: str, peers: tuple[str, ...], peer_id: str) -> None:
    """Revoke PEER_ID's admission to run RUN: the revocation is published in the run's DHT, where
    every node reads it within one heartbeat and stops dealing with that peer.

    Example: diloco-node revoke --owner-key owner.key --run-id demo --peer /ip4/203.0.113.7/tcp/31337/p2p/Qm... QmYy...
    """
    token = _signed(owner_key, "revoke", run_id, peer_id)
    from diloco_node.swarm.addresses import check_multiaddr

    for peer in peers:
        try:
            check_multiaddr(peer)
        except ValueError as exc:
            fail(str(exc))
    setup_logging("WARNING")
    from diloco_node.swarm import publish_revocation
    from diloco_node.trust.admission import load_owner_key

    publish_revocation(list(peers), run_id, token, load_owner_key(owner_key).public_key())  # or SwarmError
    click.echo(f"revoked {peer_id} in run {run_id}")


@contextmanager
def _progress(label: str, **options: Any) -> Iterator[Meter]:
    """A long command's progress (telemetry/progress.meter: a bar on a terminal, else a line each
    tenth) on stderr, as a bar is: stdout keeps the command's one result line."""
    from diloco_node.telemetry.progress import meter

    progress = meter(label, emit=lambda line: click.echo(line, err=True), **options)
    try:
        yield progress
    finally:
        progress.close()


@main.group(cls=Commands)
def tokenizer() -> None:
    """Tokenizers for --tokenizer."""


@tokenizer.command("train")
@click.option("--data", "data", default=None, help="local text, .jsonl, .parquet or .arrow file or directory "
              "(default: the embedded corpus)")
@click.option("--vocab-size", required=True, type=click.IntRange(1), help="tokens in the vocabulary")
@click.option("--text-column", default="text", show_default=True, help="the datasets column that holds the text")
@click.argument("out", type=click.Path(path_type=Path))
def tokenizer_train(data: str | None, vocab_size: int, text_column: str, out: Path) -> None:
    """Train a byte-level BPE tokenizer on local data, offline, and write it to OUT (a directory that gets a
    tokenizer.json, or a .json file); give it to `join --tokenizer OUT`.

    Example: diloco-node tokenizer train --data examples/tiny-stories.jsonl --vocab-size 2048 my-tokenizer
    """
    from diloco_node.train.prepare import train_tokenizer_from

    # reading a large dataset is most of the time: its documents are what the progress counts
    with _progress("tokenizer train, reading", unit="documents", scale=1, count_unit="characters",
                   bar_unit="doc") as progress:
        trained = train_tokenizer_from(data, vocab_size, out, text_column, progress)  # or DataError, TokenizerError
    click.echo(f"wrote {trained.name}: vocabulary {trained.vocab_size}, digest {trained.digest}")


@main.command()
@click.option("--data", "data", default=None, help="any --data source: local files, hf:NAME[:CONFIG][:SPLIT] or "
              "shards (default: the embedded corpus)")
@click.option("--tokenizer", "tokenizer_spec", default=None, help="tokenizer.json or its directory (default: bytes)")
@click.option("--text-column", default="text", show_default=True, help="the datasets column that holds the text")
@click.option("--max-tokens", default=0, show_default=True, type=click.IntRange(0),
              help="most train tokens to write (0: all; bounds a hub stream)")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def tokenize(data: str | None, tokenizer_spec: str | None, text_column: str, max_tokens: int, out: Path) -> None:
    """Tokenize --data into token shards under OUT (llm.c's layout: a 256-int32 header, then uint16 or uint32
    tokens; the held-out split in *_val_* files), which `join --data OUT` memory-maps.

    Example: diloco-node tokenize --data examples/tiny-stories.jsonl --tokenizer my-tokenizer tokens/
    """
    from diloco_node.train.prepare import write_shards

    # minutes on a large dataset: its documents counted (every few seconds of a hub stream, whose
    # length is unknown)
    with _progress("tokenize", unit="documents", scale=1, count_unit="tokens", bar_unit="doc") as progress:
        paths, train, held = write_shards(data, tokenizer_spec, out, text_column, max_tokens,
                                          tally=progress)  # or DataError
    click.echo(f"wrote {len(paths)} shards to {out}: {train} train tokens, {held} eval tokens")


@main.command("export")
@click.option("--checkpoint-dir", default="checkpoints", show_default=True, help="the run's --checkpoint-dir")
@click.option("--run-id", required=True, help="the run whose latest checkpoint to export")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
def export_model(checkpoint_dir: str, run_id: str, out: Path) -> None:
    """Write the run's φ (its latest checkpoint) as a Hugging Face model directory OUT: config.json,
    model.safetensors and the run's tokenizer files, for AutoModelForCausalLM.from_pretrained(OUT).

    Example: diloco-node export --checkpoint-dir checkpoints --run-id demo my-model/
    """
    from diloco_node.commands.export import export

    with _progress("export") as progress:  # a large checkpoint's check and the weights' write, in bytes
        written = export(checkpoint_dir, run_id, str(out), progress)  # or ExportError
    click.echo(f"wrote {written}")


@main.command()
@click.option("--nodes", default=2, show_default=True, type=click.IntRange(1, 8), help="local node processes")
@click.option("--rounds", default=12, show_default=True, type=click.IntRange(1), help="outer rounds")
@click.option("--inner-steps", default=40, show_default=True, type=click.IntRange(1), help="H per round")
@click.option("--model", default="tiny", show_default=True, help="model preset")
def demo(nodes: int, rounds: int, inner_steps: int, model: str) -> None:
    """Train the default model on the embedded corpus with a local swarm, then print a summary.

    Example: diloco-node demo --nodes 2
    """
    from diloco_node.commands.demo import run_demo

    sys.exit(run_demo(nodes=nodes, rounds=rounds, inner_steps=inner_steps, model=model))


def _fetch_json(base_url: str, path: str) -> dict[str, Any]:
    """GET base_url + path as a JSON object, or fail() with one line saying what went wrong."""
    import http.client
    import urllib.error
    import urllib.request

    url = base_url.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        from diloco_node.commands.status_view import shown  # the reason phrase is the server's text: escaped

        fail(f"{url} answered HTTP {exc.code} {shown(exc.reason)}")
    except urllib.error.URLError as exc:
        fail(f"cannot reach {url}: {exc.reason}")
    except (OSError, http.client.HTTPException) as exc:
        fail(f"cannot read {url}: {exc or type(exc).__name__}")
    except ValueError:
        fail(f"{url} did not answer JSON; is this a diloco-node status address?")
    if not isinstance(body, dict):
        fail(f"{url} answered JSON that is not an object; is this a diloco-node status address?")
    return body


@main.command()
@click.argument("url", default=f"http://127.0.0.1:{DEFAULT_STATUS_PORT}")
def status(url: str) -> None:
    """Print a running node's state and the swarm it sees, from its status server.

    Example: diloco-node status http://127.0.0.1:7781 (or 127.0.0.1:7781, as given to --status)
    """
    import time
    import urllib.parse

    from diloco_node.commands.status_view import render

    if "://" not in url:  # HOST:PORT, as the node's --status takes it
        url = "http://" + url
    try:
        parts = urllib.parse.urlsplit(url)
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # e.g. an unclosed IPv6 bracket or a port that is not a number
        valid = False
    if not valid:
        fail(f"'{url}' is not an http(s) URL like http://127.0.0.1:{DEFAULT_STATUS_PORT}")
    node_status = _fetch_json(url, "/api/status")
    peers = _fetch_json(url, "/api/peers")
    click.echo(render(node_status, peers, now=time.time()))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
