"""The run manifest: everything a node given one address needs to know of the run it joins
(docs/architecture.md §17).

Every node serves its run's manifest (swarm/manifests.py): the run id, every run-level setting the
fingerprint covers, the run's schedule (H or T, sequence length, batch size, the inner optimizer's
settings, the seed), the model (a built-in preset by name; a Hugging Face model with its config.json
as the run uses it), the tokenizer's file and the data source, each file with its SHA-256. A joiner
started with only `--peer` takes it (`take`): run-level settings come from it, node-level ones
(devices, layout, micro-batch, threads, caps, listen/announce, status, checkpoint directory, label,
the path of local data) stay the user's, and a run-level option the user gave that differs from it
ends the node with one line naming it (exit 2).

The fingerprint is today's (config.fingerprint_fields, so existing runs and checkpoints keep
theirs): the manifest carries it, and a joiner takes a manifest only when the config it builds
from it has that very fingerprint, so a manifest whose contents do not give its fingerprint is
refused. A peer's manifest is hostile input: `parse` bounds its size, nesting and every field,
and refuses anything else with one line (ManifestError).

A permissioned run's manifest is signed by the run owner (`sign`; `diloco-node run sign`): a
detached Ed25519 signature with the owner's key (trust/admission.py) over `SIGNING_CONTEXT` and
the manifest's canonical bytes (`encode`), kept beside the copy on disk (`run.sig`) and served
beside the manifest. A joiner that knows the run's owner (`--run-owner`, else the owner the
manifest names) takes only a manifest that owner signed (`check_signed`); an open run's manifest
is taken as its `--peer` serves it. The signature is no part of the manifest's bytes: its digest
and the fingerprint stay what they were.

Torch- and hivemind-free at import: `diloco-node join`'s refusals stay cheap (tests/unit/test_cli_imports.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_node.config import FIELDS, ConfigError, NodeConfig, build_config, model_shape
from diloco_node.errors import NodeError
from diloco_node.fingerprint import PROTOCOL
from diloco_node.train.tokenizer import vocabulary_digest
from diloco_node.trust.admission import MAX_SIGNATURE_CHARS, public_key_text, sign_bytes, signature_refusal
from diloco_node.trust.shown import shown

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

logger = logging.getLogger(__name__)

FORMAT = 1
# A manifest holds a tokenizer.json inline (GPT-2's is 1.4 MB, Llama 3's 9 MB) and a config.json (a few KB)
MAX_MANIFEST_BYTES = 16 << 20
MAX_TEXT_BYTES = 12 << 20  # one file's text
MAX_DEPTH = 4  # {"settings": {...}} nests 2 deep; {"model": {...}} too
MAX_CONFIG_DEPTH = 16  # a model's config.json (a text in the manifest): Hugging Face configs nest 3 or 4 deep
MANIFEST_NAME = "run.json"  # beside the checkpoint: checkpoint_dir/<run_id>/run.json
SIGNATURE_NAME = "run.sig"  # the run owner's signature of run.json, beside it
# what the owner signs: this line, then the manifest's canonical bytes (an admission token signs a
# JSON object: neither can pass for the other)
SIGNING_CONTEXT = b"dn1.manifest\n"
FILES_DIR = "run-files"  # the model's config.json and the tokenizer, as the manifest holds them
HEX64 = re.compile(r"[0-9a-f]{64}")
HEX16 = re.compile(r"[0-9a-f]{16}")
RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
SHORT_TEXT = 200  # most characters of a name, a data source, a setting's text

# Run-level options the fingerprint covers (model, tokenizer and data apart): a joiner takes the
# run's, and one given otherwise is refused (exit 2).
CHECKED = ("init", "text_column", "algorithm", "sync", "outer_lr", "outer_momentum", "eager_proxy", "group_size",
           "noloco_alpha", "noloco_beta", "noloco_gamma", "compression", "block_size", "topk_chunk", "topk_k",
           "topk_bits", "sign_block", "sign_keep", "ef_decay", "aggregator", "max_tokens_per_round", "weighting",
           "min_group_size", "round_seconds", "speed_spent", "fragments", "run_owner", "exchange")
# The run's schedule: not in the fingerprint (nodes of a run may differ), so a joiner takes the
# run's unless it gives its own (a slower node may run fewer steps per round).
SCHEDULE = ("inner_steps", "seq_len", "batch_size", "eval_batches", "inner_lr", "warmup_steps", "weight_decay",
            "grad_clip", "seed", "matchmaking_time", "round_timeout")
# Run-level options a manifest leaves out at their default, so that a run that does not use them serves
# the manifest it served before they existed (and older nodes can read it)
OMITTED_AT = {"speed_spent": "steps"}
RUN_LEVEL = ("run_id", "model", "tokenizer", "data", *CHECKED)  # what `take` checks the user's values against


class ManifestError(NodeError, ValueError):
    """A manifest that cannot be taken (malformed, oversized, a digest or fingerprint that fails)."""


class ManifestUnsigned(ManifestError):
    """A manifest of a permissioned run that its owner did not sign (`check_signed`): the run is
    known to be permissioned, so a joiner refuses it even where it could join with its own options."""


class ManifestConflict(NodeError, ValueError):
    """A run-level option the user gave differs from the run's (one short line naming it)."""


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A run's manifest, as served and as parsed (`parse` checked every field)."""

    run_id: str
    protocol: int
    fingerprint: str
    settings: dict[str, Any]  # CHECKED and SCHEDULE options → the run's values
    model: str  # as its first node named it (a preset's name, else informational)
    model_config: str | None  # a Hugging Face model's config.json as the run uses it; None: a built-in GPT preset
    model_digest: str | None
    parameters: int
    tokenizer: str | None  # tokenizer.json's text; None: bytes
    tokenizer_digest: str | None
    data: str | None  # the run's --data: None (the embedded corpus), hf:NAME… or a local path (its first node's)
    eval_digest: str | None  # the held-out split's digest, when --data is given
    # the run owner's detached signature, as it came (a peer's header, run.sig): checked by
    # `check_signed` / `signature_state`; no part of the manifest's bytes, its digest or equality
    signature: str | None = dataclasses.field(default=None, compare=False)

    @property
    def data_kind(self) -> str:
        if self.data is None:
            return "embedded"
        return "hub" if self.data.startswith("hf:") else "local"

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "run_id": self.run_id, "protocol": self.protocol, "fingerprint": self.fingerprint,
                "settings": dict(self.settings),  # a copy: the caller may change what it gets
                "model": {"name": self.model, "config": self.model_config, "digest": self.model_digest,
                          "parameters": self.parameters},
                "tokenizer": None if self.tokenizer is None else
                {"file": "tokenizer.json", "text": self.tokenizer, "digest": self.tokenizer_digest},
                "data": {"source": self.data, "kind": self.data_kind, "eval_digest": self.eval_digest}}

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), sort_keys=True, ensure_ascii=False).encode("utf-8")

    @property
    def owner(self) -> str:
        """The run owner's public key the manifest names ('': an open run)."""
        owner = self.settings.get("run_owner")
        return owner if isinstance(owner, str) else ""

    def signed_bytes(self) -> bytes:
        """What the run owner signs: `SIGNING_CONTEXT` and the canonical bytes."""
        return SIGNING_CONTEXT + self.encode()

    def signature_state(self) -> str | None:
        """Whether the owner the manifest names signed it, in words; None for an open run."""
        if not self.owner:
            return None
        if self.signature is None:
            return "not signed by the run owner"
        why = signature_refusal(self.owner, self.signed_bytes(), self.signature)
        return "signed by the run owner" if why is None else f"its signature {why}"

    @property
    def digest(self) -> str:
        """16 hex digits of the manifest's own SHA-256: what `run show` names it by."""
        return hashlib.sha256(self.encode()).hexdigest()[:16]

    def summary(self, parameters_shown: int | None = None) -> str:
        """The one line a joiner prints of what it took."""
        s = {key: field.default for key, field in FIELDS.items()} | self.settings  # left out: default
        rounds = f"T={s['round_seconds']:g}s" if s.get("round_seconds") is not None else f"H={s['inner_steps']}"
        if s.get("speed_spent") == "batch":  # H steps whose batch each node sizes to T (§13)
            rounds += f", H={s['inner_steps']} by batch"
        tokenizer = "bytes" if self.tokenizer is None else f"digest {self.vocabulary_digest}"
        data = {"embedded": "the embedded corpus", "hub": str(self.data),
                "local": f"local {self.data} (eval {str(self.eval_digest)[:12]})"}[self.data_kind]
        signed = ", signed by the run owner" if self.signature_state() == "signed by the run owner" else ""
        return (f"took run {self.run_id}: model {self.model_label} ({parameters_shown or self.parameters:,} "
                f"parameters), tokenizer {tokenizer}, codec {s['compression']}, sync {s['sync']}, {rounds}, "
                f"data {data} (fingerprint {self.fingerprint}{signed})")

    @property
    def vocabulary_digest(self) -> str:
        """The tokenizer's digest as `diloco-node tokenizer train` prints it and the fingerprint holds
        (train/tokenizer.py): what a user compares, where the file's sha256 checks the bytes."""
        try:  # a peer's text, before `take` reads it: any JSON, a lone surrogate (UnicodeError), a deep nest
            spec = json.loads(self.tokenizer or "")
            return vocabulary_digest(spec) if isinstance(spec, dict) else "unreadable"
        except (ValueError, RecursionError):
            return "unreadable"

    @property
    def model_label(self) -> str:
        if self.model_config is None:
            return self.model
        model_type = json.loads(self.model_config).get("model_type", "?")
        return f"{self.model} (hf:{model_type})"

    def show(self) -> str:
        """`diloco-node run show`: the manifest as lines a person reads."""
        lines = [f"run {self.run_id}", f"fingerprint {self.fingerprint} (protocol {self.protocol})",
                 f"manifest digest {self.digest}",
                 f"model {self.model_label}, {self.parameters:,} parameters"
                 + (f", config.json sha256 {self.model_digest}" if self.model_digest else ""),
                 "tokenizer bytes (vocabulary 256)" if self.tokenizer is None else
                 f"tokenizer digest {self.vocabulary_digest}, tokenizer.json sha256 {self.tokenizer_digest}",
                 {"embedded": "data the embedded corpus", "hub": f"data {self.data} (a hub dataset, streamed)",
                  "local": f"data local files '{self.data}' (a joiner passes --data PATH to a copy; held-out "
                           f"split digest {self.eval_digest})"}[self.data_kind]]
        state = self.signature_state()
        if state is not None:
            lines.append(f"permissioned: run owner {self.owner}, manifest {state}"
                         + (" (joiners refuse it until the owner runs `diloco-node run sign`)"
                            if state != "signed by the run owner" else ""))
        lines += [f"{key} = {json.dumps(self.settings[key])}" for key in (*SCHEDULE, *CHECKED) if key in self.settings]
        return "\n".join(lines)


# --- building (the node that serves it) -------------------------------------------------------


def build(cfg: NodeConfig, parameters: int) -> Manifest:
    """The manifest of the run `cfg` configures (its φ has `parameters` parameters)."""
    fields = cfg.fingerprint_fields()  # the tokenizer's and the eval split's digests are read here
    shape = model_shape(cfg.inputs.model)
    config_json = getattr(shape, "config_json", None)
    tokenizer_text = None
    if cfg.inputs.tokenizer:
        from diloco_node.train.tokenizer import tokenizer_file

        tokenizer_text = tokenizer_file(cfg.inputs.tokenizer).read_text(encoding="utf-8")
    flat = cfg.flat()
    settings = {key: flat[key] for key in (*SCHEDULE, *CHECKED)}
    for key, default in OMITTED_AT.items():
        if settings[key] == default:
            del settings[key]
    if cfg.inner.round_seconds is not None and cfg.inner.speed_spent == "steps":
        del settings["inner_steps"]  # a round is T seconds: H is not the run's
    return Manifest(run_id=cfg.swarm.run_id, protocol=PROTOCOL, fingerprint=cfg.fingerprint(), settings=settings,
                    model=_model_name(cfg.inputs.model),
                    model_config=config_json, model_digest=sha256(config_json) if config_json else None,
                    parameters=parameters, tokenizer=tokenizer_text,
                    tokenizer_digest=sha256(tokenizer_text) if tokenizer_text is not None else None,
                    data=cfg.inputs.data, eval_digest=fields.get("eval_data"))


def served(cfg: NodeConfig, parameters: int) -> Manifest:
    """The manifest a node serves: the one it took (its copy beside the checkpoint, when it has the
    node's fingerprint), so that every node of a run serves the first node's, names and data source
    included; else its own (`build`)."""
    own = build(cfg, parameters)
    path = find_local(cfg.persistence.checkpoint_dir, cfg.swarm.run_id)
    if path is not None:
        try:
            taken = read_local(path)
        except ManifestError:
            return own
        if taken.fingerprint == own.fingerprint and taken.run_id == own.run_id:
            return taken
    return own


def _model_name(model: str) -> str:
    """What the manifest calls the model: a preset's or hub id's name, a local one's directory name
    (the path is the first node's own)."""
    path = Path(model)
    if not path.exists():
        return model
    return (path.parent.name if path.name == "config.json" else path.name) or model


# --- the run owner's signature (permissioned runs) ---------------------------------------------


def sign(manifest: Manifest, key: Ed25519PrivateKey) -> Manifest:
    """`manifest` with the run owner's signature; ManifestError when `key` is not the owner it names
    (an open run has none: its joiners take their --peer's manifest)."""
    owner = public_key_text(key.public_key())
    if not manifest.owner:
        raise ManifestError(f"run {manifest.run_id} is an open run (no --run-owner): its joiners take their "
                            "--peer's manifest, there is nothing to sign")
    if manifest.owner != owner:
        raise ManifestError(f"run {manifest.run_id}'s owner is {manifest.owner}, not this key's {owner}")
    return dataclasses.replace(manifest, signature=sign_bytes(key, manifest.signed_bytes()))


def check_signed(manifest: Manifest, owner: str = "") -> Manifest:
    """The peer's `manifest` as a joiner takes it: in a permissioned run only when the run owner
    signed it, the owner being the one the joiner was given (`owner`, its --run-owner) or, when it
    was given none, the one the manifest names; an open run's (no owner given or named) as it is,
    less any signature. ManifestUnsigned, one line, otherwise."""
    named = manifest.owner
    if owner and named != owner:
        raise ManifestUnsigned(f"its manifest is of {'an open run' if not named else 'a run of another owner'}, "
                               f"not of --run-owner {owner[:12]}…")
    key = owner or named
    if not key:
        return dataclasses.replace(manifest, signature=None)
    if manifest.signature is None:
        raise ManifestUnsigned("its manifest is not signed by the run owner (the owner signs it once: "
                               "diloco-node run sign)")
    why = signature_refusal(key, manifest.signed_bytes(), manifest.signature)
    if why is not None:
        raise ManifestUnsigned(f"its manifest's signature {why}")
    return manifest


def check_signature_text(value: Any) -> str | None:
    """A signature as a peer or a file gives it, bounded; None for none. ManifestError when it is
    no text of at most MAX_SIGNATURE_CHARS characters (whether it verifies is `check_signed`'s)."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SIGNATURE_CHARS:
        raise ManifestError(f"malformed signature: not a text of at most {MAX_SIGNATURE_CHARS} characters")
    return value


class ServedSignature:
    """The run owner's signature a node serves beside its manifest: `run.sig` beside its
    checkpoint, read again whenever the file changes (a node started before the owner signed serves
    the signature from the moment `diloco-node run sign` wrote it), and served only when it is the
    owner's signature of the very manifest served. None in an open run, or with no valid file."""

    def __init__(self, manifest: Manifest, owner: str, path: Path | None):
        self._owner, self._path = owner, path
        self._signed = manifest.signed_bytes() if owner and path is not None else b""
        self._seen: tuple[int, int] | None = None
        self._signature: str | None = None

    def __call__(self) -> str | None:
        if not self._owner or self._path is None:
            return None
        try:
            stat = self._path.stat()
        except OSError:
            self._seen, self._signature = None, None
            return None
        seen = (stat.st_mtime_ns, stat.st_size)
        if seen != self._seen:
            self._seen, self._signature = seen, None
            text = read_signature(self._path)
            why = "is malformed" if text is None else signature_refusal(self._owner, self._signed, text)
            if why is None:
                self._signature = text
            else:
                logger.warning("not serving the run owner's signature in %s: it %s (of another manifest? "
                               "sign this node's again: diloco-node run sign)", self._path, why)
        return self._signature


# --- parsing (what a peer sent, or our own copy on disk) --------------------------------------


def _json_object(text: str) -> bool:
    """Whether a model's config.json text is a JSON object nested at most MAX_CONFIG_DEPTH deep whose
    texts are all UTF-8: a `\\ud800` escape inside it loads as a lone surrogate, which transformers
    then writes into a warning that no UTF-8 log can print."""
    try:
        if not _depth_ok(text, MAX_CONFIG_DEPTH):
            return False
        loaded = json.loads(text, parse_constant=_refuse_constant)
        return isinstance(loaded, dict) and _encodes(json.dumps(loaded, ensure_ascii=False))
    except ValueError:
        return False


def _depth_ok(text: str, max_depth: int = MAX_DEPTH) -> bool:
    """Whether `text` nests at most `max_depth` deep (outside strings): json.loads recurses per level."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            escaped, in_string = (False, in_string) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > max_depth:
                return False
        elif char in "]}":
            depth -= 1
    return True


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"JSON constant {name}")


def _text(value: Any, what: str, limit: int = SHORT_TEXT, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > limit or not _encodes(value):
        raise ManifestError(f"malformed manifest: {what} is not a text of at most {limit} characters")
    return value


def _encodes(text: str) -> bool:
    """Whether `text` is UTF-8 text: JSON's \\ud800 escapes load as lone surrogates, which neither
    a digest, nor the manifest's own bytes, nor a written file can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _hex(value: Any, pattern: re.Pattern[str], what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ManifestError(f"malformed manifest: {what} is not a digest")
    return value


def _setting(key: str, value: Any) -> Any:
    """A setting's value: a JSON scalar (numbers finite), as NodeConfig then validates it."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > 1 << 62:
            raise ManifestError(f"malformed manifest: setting {key} is out of range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ManifestError(f"malformed manifest: setting {key} is not finite")
        return value
    return _text(value, f"setting {key}")


def parse(data: bytes) -> Manifest:
    """A manifest's bytes → the Manifest; ManifestError (one line) for anything else. Checks the
    form and every digest of the files it holds; what the settings mean is checked by `take`."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest of {len(data)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
    try:
        text = data.decode("utf-8")
        if not _depth_ok(text):
            raise ManifestError(f"malformed manifest: nested deeper than {MAX_DEPTH}")
        raw = json.loads(text, parse_constant=_refuse_constant)
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ManifestError(f"malformed manifest: not JSON ({str(exc)[:80]})") from None
    if not isinstance(raw, dict):
        raise ManifestError("malformed manifest: not a JSON object")
    if raw.get("format") != FORMAT:
        raise ManifestError(f"manifest format {str(raw.get('format'))[:20]} is not {FORMAT} (another version "
                            "of diloco-node?)")
    run_id = _text(raw.get("run_id"), "run_id")
    if not RUN_ID.fullmatch(run_id):
        raise ManifestError("malformed manifest: run_id is not a run id")
    protocol = raw.get("protocol")
    if isinstance(protocol, bool) or not isinstance(protocol, int):
        raise ManifestError("malformed manifest: protocol is not a number")
    if protocol != PROTOCOL:
        raise ManifestError(f"the run speaks protocol version {protocol}, this node {PROTOCOL}: "
                            "install the run's version of diloco-node")
    fingerprint = _hex(raw.get("fingerprint"), HEX16, "fingerprint")
    settings = raw.get("settings")
    if not isinstance(settings, dict) or len(settings) > 2 * len(CHECKED + SCHEDULE):
        raise ManifestError("malformed manifest: settings is not an object of the run's options")
    unknown = [key for key in settings if key not in CHECKED + SCHEDULE]
    if unknown:
        raise ManifestError(f"malformed manifest: unknown setting {str(unknown[0])[:40]!r}")
    settings = {key: _setting(key, value) for key, value in settings.items()}
    model = raw.get("model")
    if not isinstance(model, dict):
        raise ManifestError("malformed manifest: model is not an object")
    config = _text(model.get("config"), "model config", MAX_TEXT_BYTES, optional=True)
    model_digest = _hex(model.get("digest"), HEX64, "model digest", optional=config is None)
    if config is not None and sha256(config) != model_digest:
        raise ManifestError("the model's config.json does not match the manifest's digest: refused")
    if config is not None and not _json_object(config):
        raise ManifestError(f"malformed manifest: the model's config.json is not a JSON object of UTF-8 texts "
                            f"nested at most {MAX_CONFIG_DEPTH} deep")
    parameters = model.get("parameters")
    if isinstance(parameters, bool) or not isinstance(parameters, int) or not 0 < parameters < 1 << 50:
        raise ManifestError("malformed manifest: parameters is not a count")
    tokenizer = raw.get("tokenizer")
    tokenizer_text = tokenizer_digest = None
    if tokenizer is not None:
        if not isinstance(tokenizer, dict):
            raise ManifestError("malformed manifest: tokenizer is not an object")
        tokenizer_text = _text(tokenizer.get("text"), "tokenizer text", MAX_TEXT_BYTES)
        tokenizer_digest = _hex(tokenizer.get("digest"), HEX64, "tokenizer digest")
        if sha256(tokenizer_text) != tokenizer_digest:
            raise ManifestError("the tokenizer's file does not match the manifest's digest: refused")
    data_entry = raw.get("data")
    if not isinstance(data_entry, dict):
        raise ManifestError("malformed manifest: data is not an object")
    source = _text(data_entry.get("source"), "data source", optional=True)
    eval_digest = _hex(data_entry.get("eval_digest"), HEX16, "data digest", optional=source is None)
    return Manifest(run_id=run_id, protocol=protocol, fingerprint=fingerprint, settings=settings,
                    model=_text(model.get("name"), "model name"), model_config=config, model_digest=model_digest,
                    parameters=parameters, tokenizer=tokenizer_text, tokenizer_digest=tokenizer_digest,
                    data=source, eval_digest=eval_digest)


# --- taking it (the joiner) -------------------------------------------------------------------


def _same(key: str, given: Any, run: Any) -> bool:
    """Whether an option the user gave (flags and env travel as text) is the run's value."""
    from pydantic import TypeAdapter, ValidationError

    try:
        annotation: Any = FIELDS[key].annotation
        value = TypeAdapter(annotation).validate_python(given, strict=False)
    except ValidationError:
        return False  # not even of the option's type
    if isinstance(value, int | float) and isinstance(run, int | float) and not isinstance(value, bool):
        return float(value) == float(run)
    return bool(value == run)


def _shown(value: Any, limit: int = 40) -> str:
    """A peer's value in one of our lines: escaped (trust/shown.py) and cut."""
    return shown("none" if value is None else str(value), limit)


def conflict(option: str, run_value: Any, given: Any) -> ManifestConflict:
    flag = "--" + option.replace("_", "-")
    return ManifestConflict(f"{flag}: the run's is {_shown(run_value)}, given {_shown(given)} (leave it out to take "
                            "the run's)")


def materialize(manifest: Manifest, directory: Path) -> dict[str, str]:
    """Write the manifest's files under `directory` (FILES_DIR) and return the options naming them:
    --model (a Hugging Face model's config.json; a built-in preset's name) and --tokenizer."""
    options: dict[str, str] = {"model": manifest.model}
    files = directory / FILES_DIR
    try:
        if manifest.model_config is not None:
            (files / "model").mkdir(parents=True, exist_ok=True)
            (files / "model" / "config.json").write_text(manifest.model_config, encoding="utf-8")
            options["model"] = str(files / "model" / "config.json")
        if manifest.tokenizer is not None:
            (files / "tokenizer").mkdir(parents=True, exist_ok=True)
            (files / "tokenizer" / "tokenizer.json").write_text(manifest.tokenizer, encoding="utf-8")
            options["tokenizer"] = str(files / "tokenizer")
    except OSError as exc:
        raise ManifestError(f"cannot write the run's files under '{files}': {exc.strerror}") from None
    return options


def take(manifest: Manifest, given: dict[str, Any], directory: Path) -> NodeConfig:
    """The config a node runs with: the run's settings from `manifest`, the node's own from `given`
    (the options the user set: flags, env, file). ManifestConflict naming the first run-level option
    given otherwise than the run has it; ManifestError when the manifest's contents do not give its
    fingerprint (or its model, tokenizer or data cannot be used here). The model's and tokenizer's
    files are written under `directory`."""
    if "run_id" in given and given["run_id"] != manifest.run_id:
        raise conflict("run_id", manifest.run_id, given["run_id"])
    # under speed_spent batch every node runs the run's H (it is in the fingerprint, §13)
    agreed = ("inner_steps",) if manifest.settings.get("speed_spent") == "batch" else ()
    run_settings = {**OMITTED_AT, **manifest.settings}
    for key in (*CHECKED, *agreed):
        if key in given and key in run_settings and not _same(key, given[key], run_settings[key]):
            raise conflict(key, run_settings[key], given[key])
    if manifest.data_kind == "local" and not given.get("data"):
        raise ManifestConflict(f"run {manifest.run_id} trains on local files ('{_shown(manifest.data)}'): pass "
                               f"--data PATH to a copy of them (held-out split digest {manifest.eval_digest})")
    if manifest.data_kind != "local" and "data" in given and given["data"] != manifest.data:
        raise conflict("data", manifest.data or "the embedded corpus", given["data"])
    values: dict[str, Any] = {**manifest.settings, "run_id": manifest.run_id}
    if manifest.data is not None:
        values["data"] = manifest.data
    try:
        values.update(materialize(manifest, directory))
        values.update({key: value for key, value in given.items() if key not in ("model", "tokenizer")})
        if "model" in given or "tokenizer" in given:
            _check_model_and_tokenizer(manifest, given, values)
        if values.get("round_seconds") is not None and values.get("speed_spent", "steps") == "steps":
            values.pop("inner_steps", None)
        cfg = build_config(values, f"run {manifest.run_id}'s manifest")
        fields = cfg.fingerprint_fields()  # reads the model's config.json through transformers
        fingerprint = cfg.fingerprint()
    except (ManifestError, ManifestConflict):
        raise
    except ConfigError as exc:
        raise ManifestError(f"the run's manifest does not make a config here: {_shown(exc, 400)}") from None
    except (ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError) as exc:
        # a peer's model config.json read by transformers (any JSON object passes the digest): its
        # parsers raise whatever a hostile value makes them, and the joiner must end in one line
        raise ManifestError(f"the run's model config cannot be read here ({type(exc).__name__}: "
                            f"{_shown(exc, 200)})") from None
    if manifest.data_kind == "local" and (own := fields.get("eval_data")) != manifest.eval_digest:
        raise ManifestConflict(f"--data: the run's held-out split digest is {manifest.eval_digest}, "
                               f"'{given['data']}' gives {own}: pass a copy of the run's data")
    if fingerprint != manifest.fingerprint:
        raise ManifestError(f"the config taken from run {manifest.run_id}'s manifest has fingerprint "
                            f"{fingerprint}, not the {manifest.fingerprint} the manifest names: refused")
    return cfg


def _check_model_and_tokenizer(manifest: Manifest, given: dict[str, Any], values: dict[str, Any]) -> None:
    """A --model or --tokenizer the user gave is taken when it is the run's (the same architecture,
    the same vocabulary), else refused naming it."""
    if "model" in given:
        try:
            theirs = model_shape(values["model"]).fingerprint_fields()
            ours = model_shape(given["model"]).fingerprint_fields()
        except ValueError as exc:
            raise ManifestConflict(f"--model: {exc}") from None
        if ours != theirs:
            raise conflict("model", manifest.model_label, given["model"])
        values["model"] = given["model"]
    if "tokenizer" in given:
        from diloco_node.train.tokenizer import load_tokenizer

        run = load_tokenizer(values.get("tokenizer")).digest
        own = load_tokenizer(given["tokenizer"]).digest
        if run != own:
            raise conflict("tokenizer", "bytes" if manifest.tokenizer is None else run, given["tokenizer"])
        values["tokenizer"] = given["tokenizer"]


# --- on disk, beside the checkpoint -------------------------------------------------------------


def local_path(checkpoint_dir: str, run_id: str) -> Path:
    return Path(checkpoint_dir) / run_id / MANIFEST_NAME


def find_local(checkpoint_dir: str, run_id: str | None) -> Path | None:
    """The manifest a node that took one wrote beside its checkpoint: the run's (given `run_id`),
    else the only one under `checkpoint_dir`; None when there is none (or several and no run id)."""
    if not checkpoint_dir:
        return None
    if run_id is not None:
        path = local_path(checkpoint_dir, run_id)
        return path if path.is_file() else None
    found = sorted(Path(checkpoint_dir).glob(f"*/{MANIFEST_NAME}"))
    return found[0] if len(found) == 1 else None


def signature_path(path: Path) -> Path:
    """Where the run owner's signature of the manifest at `path` lies: beside it."""
    return path.with_name(SIGNATURE_NAME)


def read_signature(path: Path) -> str | None:
    """The signature text in the file at `path` (a regular file, bounded); None when there is none
    or it is not one."""
    try:
        if not path.is_file():
            return None
        with path.open("rb") as file:
            data = file.read(MAX_SIGNATURE_CHARS + 2)
        return check_signature_text(data.decode("ascii").strip())
    except (OSError, ValueError):  # ManifestError and UnicodeDecodeError are ValueErrors
        return None


def read_local(path: Path) -> Manifest:
    """The manifest at `path`, with the signature beside it (`run.sig`) when there is one."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"run manifest '{path}' cannot be read: {exc.strerror}") from None
    try:
        manifest = parse(data)
    except ManifestError as exc:
        raise ManifestError(f"run manifest '{path}': {exc}") from None
    return dataclasses.replace(manifest, signature=read_signature(signature_path(path)))


def write_local(manifest: Manifest, path: Path) -> None:
    """Atomically, and its signature beside it (a stale one removed): a restart reads either the
    previous copy or this one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(path, manifest.encode())
        if manifest.signature is not None:
            _write_atomically(signature_path(path), manifest.signature.encode("ascii") + b"\n")
        else:
            signature_path(path).unlink(missing_ok=True)
    except OSError as exc:
        raise ManifestError(f"cannot write the run's manifest to '{path}': {exc.strerror}") from None


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
