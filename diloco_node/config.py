"""Node configuration: every setting, its default and its validation.

The CLI builds its options from these fields, so a key in a TOML file, an env var DILOCO_<KEY>
and a flag --<key> always mean the same thing. Precedence: flag > env > file > default.

A leaf (docs/architecture.md, import rules): it imports no domain module. What only a package
knows (its model presets, codecs and their default parameters, how to check a multiaddr or a
public key) it declares in registry.py, and the checks here read it from there; turning a config
into a package's own objects is that package's job (codec.codec_config_of, replica.settings_of).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from diloco_node.errors import NodeError
from diloco_node.fingerprint import PROTOCOL, fingerprint_of
from diloco_node.rates import parse_rate
from diloco_node.registry import (
    CODEC_CHECK,
    CODEC_DEFAULTS,
    CODECS,
    DATA_IDENTITY,
    MODEL_PRESETS,
    MODELS,
    MULTIADDR_CHECK,
    PUBLIC_KEY_CHECK,
    TOKENIZER_VOCAB,
    Registry,
)

DEFAULT_STATUS_PORT = 7780
DILOCO_MOMENTUM = 0.9  # DiLoCo's outer Nesterov momentum (docs/architecture.md §3)
# Under eager, half of each step (the others' Δ) lands a round late, which already carries momentum;
# 0.6 kept eager within 1 % of blocking in benchmarks/wide_area.py, 0.9 did not (see docs/configuration.md,
# sync modes).
EAGER_MOMENTUM = 0.6
# Delayed applies every Δ one round late, and its inner phases start from a φ that lacks the last
# one; momentum on top overshoots: at H=100 it ended 1.73× blocking's eval loss with 0.9, 1.39× with
# 0.3, 1.17× with 0 (benchmarks/eager_loss.py --modes
# blocking,delayed:0.9,delayed:0.6,delayed:0.3,delayed:0 --repeats 1).
DELAYED_MOMENTUM = 0.0
AUTO_BUTTERFLY_FROM = 3  # see NodeConfig.butterfly_from and benchmarks/scale.py
SYNC_MOMENTUM = {"blocking": DILOCO_MOMENTUM, "delayed": DELAYED_MOMENTUM, "eager": EAGER_MOMENTUM}
# With a codec that keeps an error-feedback residual (topk, sign), the residual does momentum's job
# (SparseLoCo): unset outer settings follow. benchmarks/codecs.py, sign at 0.094 B/param, final eval
# loss vs none: Nesterov 0.9 on top of error feedback +8.0 %; momentum 0 with outer lr 1 +2.7 %,
# 1.4 +0.3 %, 1.7 −0.3 %, 2 −0.5 % (β = 0.95; β = 0.9 and 1 within 0.2 % of it).
FEEDBACK_OUTER = {"outer_momentum": 0.0, "outer_lr": 2.0, "ef_decay": 0.95}
FEEDBACK_CODECS = "<error-feedback codecs>"  # in a description: describe() names them (registry.CODECS)


class ConfigError(NodeError, ValueError):
    """A configuration problem, phrased for the person who made it (one line)."""


def _codec_default(key: str) -> Callable[[], Any]:
    """The codec's own default for one of its parameters (CodecConfig's), read on first use."""
    return lambda: CODEC_DEFAULTS.get()[key]


def _keeps_residual(compression: Any) -> bool:
    """Whether a codec, by name, drops values and keeps an error-feedback residual (its spec's `feedback`)."""
    return isinstance(compression, str) and compression in CODECS.names() and CODECS[compression].feedback


def _unset(text: str) -> dict[str, Any]:
    """A Field's json_schema_extra for a setting whose Field default does not say what a node runs
    with when it is left unset (None, or a value _defaults_that_follow replaces from other
    settings): --help and the configuration reference show `text` as its default (`unset_default`)."""
    return {"unset": text}


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- the swarm ---
    run_id: str = Field("diloco-default", description="name of the training run; peers never mix runs",
                        pattern=r"^[A-Za-z0-9_-]{1,64}$")
    peer: list[str] = Field(default_factory=list, description="multiaddr of a node already in the swarm (repeatable)")
    listen: list[str] = Field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"],
                              description="multiaddr to listen on for peers (repeatable)")
    announce: list[str] = Field(default_factory=list, description="public multiaddr to announce to peers (repeatable)")
    manifest: str = Field("auto", pattern=r"^(auto|off)$",
                          description="auto: with --peer, take the run's settings, model config and tokenizer from "
                          "the peer's run manifest (or the copy beside the checkpoint); off: this node's own options "
                          "only, checked against the run's fingerprint (docs/running.md)")
    label: str = Field("", max_length=64, description="a public name for this node in the swarm table (e.g. a region)")
    status: str = Field(f"127.0.0.1:{DEFAULT_STATUS_PORT}",
                        description="HOST:PORT of the status server (port 0 picks a free one)")
    min_peers: int = Field(1, ge=1, description="nodes (this one included) to wait for before the first round")
    round_timeout: float = Field(60.0, gt=0, description="seconds to wait for peers at the end of a round")
    matchmaking_time: float = Field(3.0, gt=0, description="seconds to gather a group before averaging")
    upload_limit: str = Field("0", description="most this node sends for the run (payloads, butterfly parts, state "
                              "served), e.g. 5mbit, 10Mbit/s, 20Mbps, 2MB/s, 500kB/s; 0 = no cap. b, bit and bps are "
                              "bits, B and byte bytes; k, M, G powers of 1000, Ki, Mi, Gi of 1024; a bare number other "
                              "than 0 is refused (docs/scale-and-networks.md, bandwidth caps)")
    download_limit: str = Field("0", description="most this node receives for the run (payloads, parts, state "
                                "downloaded), written as --upload-limit; 0 = no cap")

    # --- the model and data ---
    model: str = Field("tiny", description="model: a Hugging Face model directory, its config.json, a hub id "
                       "(org/name, when the hub is reachable) or a preset (tiny, small and gpt-* built in, llama-* "
                       "from configs/*.json; docs/models.md)")  # --help lists the presets (CHOICES)
    init: str = Field("random", pattern=r"^(random|pretrained)$",
                      description="initial weights: random (a pure function of --seed) or pretrained (the model "
                      "directory's *.safetensors: continued pretraining)")
    data: str | None = Field(None, description="training data: a text, .jsonl, .parquet or .arrow file or a "
                             "directory of them (read through datasets, offline), token shards (.bin: llm.c or nanoGPT "
                             "layout, memory-mapped) or hf:NAME[:CONFIG][:SPLIT] (a hub dataset, streamed; "
                             "docs/models.md, train your own model)", json_schema_extra=_unset("the embedded corpus"))
    tokenizer: str | None = Field(None, description="a tokenizer.json or a directory holding one (from `diloco-node "
                                  "tokenizer train` or any Hugging Face tokenizer)",
                                  json_schema_extra=_unset("bytes (vocabulary 256)"))
    text_column: str = Field("text", min_length=1, description="the column of --data's datasets (jsonl, parquet, "
                             "arrow, hub) that holds the text")
    seq_len: int = Field(128, gt=0, description="tokens (bytes) per training sequence")
    batch_size: int = Field(16, gt=0, description="sequences per inner step")
    eval_batches: int = Field(8, gt=0, description="held-out batches for eval loss each round")
    seed: int = Field(0, ge=0, description="seed for the initial model and this node's data order")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where inner steps run: auto (cuda when available), cpu, cuda or cuda:N")
    threads: int = Field(0, ge=0, description="torch CPU threads per local rank (0 = torch's default; with "
                         "several local ranks, the cores shared out)")

    # --- the node's own devices (docs/architecture.md §5): one replica over K local ranks ---
    parallel: str = Field("none", pattern=r"^(none|fsdp|pipeline)$",
                          description="how the node splits its replica over its local ranks: none, fsdp "
                          "(shards) or pipeline (stages)")
    local_ranks: int = Field(1, ge=1, le=64, description="K: processes (one per device) the replica runs on",
                             json_schema_extra=_unset("the number of --devices, else 1"))
    devices: str = Field("", pattern=r"^$|^(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*$",
                         description="comma-separated device per local rank, e.g. cuda:0,cuda:1",
                         json_schema_extra=_unset("cuda:0..K-1 when --device is cuda, else cpu"))
    precision: str = Field("auto", pattern=r"^(auto|fp32|bf16)$",
                           description="inner steps in fp32 or bf16 autocast; auto: bf16 on a GPU that has it, "
                           "else fp32 (φ and the outer step stay fp32)")
    compile: str = Field("off", pattern=r"^(on|off)$", description="on: torch.compile the model for the inner "
                         "steps (--parallel none or fsdp); off")
    micro_batch_size: int | str = Field(0, description="sequences per forward/backward pass on each local rank, "
                                        "gradients accumulated up to --batch-size (0: the whole batch at once; "
                                        "auto: the largest that fits the device, docs/models.md, a batch that "
                                        "fits)")

    # --- inner optimizer (AdamW) ---
    inner_steps: int = Field(50, gt=0, description="H: inner AdamW steps per outer round (under "
                             "--speed-spent batch the run's: every node runs it)")
    round_seconds: float | None = Field(None, description="T: rounds by time budget instead of --inner-steps (not "
                                        "both): a round ends on a deadline of the swarm's clock every T seconds and "
                                        "each node trains as many inner steps as fit; with --fragments P a round "
                                        "lasts T/P, a round per fragment (docs/configuration.md, rounds by time "
                                        "budget; docs/architecture.md §13)",
                                        json_schema_extra=_unset("rounds of --inner-steps"))
    speed_spent: str = Field("steps", pattern=r"^(steps|batch)$",
                             description="under --round-seconds, what a faster node spends its speed on: steps "
                             "(as many inner steps as fit before the deadline) or batch (every node --inner-steps "
                             "H steps, a faster node accumulating more batches of --batch-size into each; "
                             "docs/architecture.md §13)")
    inner_lr: float = Field(4e-4, gt=0, description="peak inner learning rate (linear warmup, then cosine decay "
                            "when --max-outer-steps is set)")
    warmup_steps: int = Field(50, ge=0, description="inner linear warmup steps")
    weight_decay: float = Field(0.1, ge=0, description="inner AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="inner gradient norm clip")

    # --- outer optimizer (Nesterov SGD on pseudo-gradients) ---
    outer_lr: float = Field(0.7, gt=0, description="outer learning rate (an error-feedback codec's residual does "
                            "momentum's job, so its runs step further: docs/configuration.md, compression)",
                            json_schema_extra=_unset(f"0.7; {FEEDBACK_OUTER['outer_lr']:g} with {FEEDBACK_CODECS}"))
    outer_momentum: float = Field(DILOCO_MOMENTUM, ge=0, lt=1, description=(
        "outer Nesterov momentum; unset, it follows --sync (a step that lands a round late already acts as "
        "momentum) and is 0 with an error-feedback codec, whose residual does momentum's job "
        "(docs/configuration.md, sync modes and compression)"),
        json_schema_extra=_unset(f"{DILOCO_MOMENTUM:g} blocking, {EAGER_MOMENTUM:g} eager, "
                                 f"{DELAYED_MOMENTUM:g} delayed; 0 with {FEEDBACK_CODECS}"))
    sync: str = Field("eager", pattern=r"^(blocking|delayed|eager)$",
                      description="when the exchange runs: blocking, delayed or eager (overlaps the next round; "
                      "docs/configuration.md, sync modes)",
                      json_schema_extra=_unset("eager; blocking with --algorithm noloco"))
    eager_proxy: str = Field("full", pattern=r"^(full|share)$",
                             description="eager: weight of our fresh Δ in the proxy: full (it stands in for the "
                             "group's mean until that arrives) or share (our token share, 1/M, as in "
                             "docs/architecture.md §3)")
    sync_timeout: float = Field(120.0, gt=0, description="delayed/eager: seconds to wait for the previous "
                                "round's exchange before going on without it (it is applied when it lands)")
    max_outer_steps: int = Field(0, ge=0, description="stop after this many rounds (0 = run forever)")
    aggregator: str = Field("clip", pattern=r"^(mean|clip|trimmed|centered-clip)$",
                            description="how the group's pseudo-gradients are averaged: mean, clip (each to 1.25x "
                            "the median norm), trimmed or centered-clip (docs/configuration.md, aggregation; "
                            "docs/trust.md)")
    weighting: str = Field("tokens", pattern=r"^(tokens|sqrt-tokens|equal)$",
                           description="each peer's weight in the mean, from its tokens after the cap: tokens, "
                           "sqrt-tokens or equal (docs/configuration.md, rounds by time budget; docs/architecture.md "
                           "§13)")
    reachability: str = Field("auto", pattern=r"^(auto|public|private)$",
                              description="whether peers can connect to this node: public, private (behind a NAT: "
                              "it joins as a client that pushes its parts and owns none) or auto (asks a peer to "
                              "dial it back at start-up; docs/scale-and-networks.md)")
    exchange: str = Field("auto", pattern=r"^(auto|allgather|butterfly)$",
                          description="how a group's pseudo-gradients travel: allgather (every member fetches every "
                          "payload), butterfly (each member averages one part: per-node traffic that does not grow "
                          "with the group) or auto (butterfly for groups of 3 or more in a --run-owner run, else "
                          "allgather; see docs/scale-and-networks.md)")
    max_tokens_per_round: int = Field(0, ge=0, description="most tokens a peer's contribution to a round counts "
                                      "for (0: only the group's median declaration)")
    fragments: int = Field(1, ge=1, description="P: φ is exchanged in P fragments of whole tensors, one per round "
                           "in turn, each round running H/P inner steps (with --round-seconds T: lasting T/P "
                           "seconds), so a round sends about 1/P of the model (Streaming DiLoCo; "
                           "docs/configuration.md, sync modes; docs/architecture.md §15); at most the model's "
                           "parameter tensors and --inner-steps")
    min_group_size: int = Field(2, ge=2, le=64, description="fewest nodes, this one included, whose mean φ steps "
                                "on; a round with a smaller group takes no outer step (an open run should set 3, "
                                "as a pair cannot tell who lies; docs/trust.md, docs/architecture.md §9)")

    # --- NoLoCo: gossip in small random groups instead of averaging over the swarm (docs/architecture.md §3) ---
    algorithm: str = Field("diloco", pattern=r"^(diloco|noloco)$",
                           description="outer algorithm: diloco (the group is everyone) or noloco (random small "
                           "groups; docs/configuration.md, NoLoCo)")
    group_size: int = Field(2, ge=2, le=64, description="noloco: most nodes in a group (n)")
    noloco_alpha: float = Field(0.7, gt=0, description="noloco: α, weight of the group's mean progress")
    noloco_beta: float = Field(0.5, ge=0, lt=1, description="noloco: β, momentum")
    noloco_gamma: float | None = Field(None, ge=0, description="noloco: γ, pull towards the group's mean φ",
                                       json_schema_extra=_unset("α (--noloco-alpha)"))

    # --- pseudo-gradient compression (docs/architecture.md §3, codecs) ---
    # the codec parameters' defaults are the codecs' own (codec/codecs.py, CodecSpec), and so are the
    # codecs each one tunes, which --help names before its description (describe)
    compression: str = Field("none", description="pseudo-gradient codec")  # --help lists the codecs (CHOICES)
    block_size: int = Field(default_factory=_codec_default("block_size"), gt=0, description="values per scale")
    topk_chunk: int = Field(default_factory=_codec_default("topk_chunk"), gt=0, description="values per chunk")
    topk_k: int = Field(default_factory=_codec_default("topk_k"), gt=0, description="values kept per chunk")
    topk_bits: int = Field(default_factory=_codec_default("topk_bits"),
                           description="bits per kept value: 8, 4, 2 or 1")
    sign_block: int = Field(default_factory=_codec_default("sign_block"), gt=0,
                            description="values per scale (a multiple of 8)")
    sign_keep: float = Field(default_factory=_codec_default("sign_keep"), gt=0, le=1,
                             description="share of blocks sent per round (those of largest norm)")
    ef_decay: float = Field(default_factory=_codec_default("ef_decay"), ge=0, le=1,
                            description="error-feedback decay β",
                            json_schema_extra=_unset(f"{FEEDBACK_OUTER['ef_decay']:g} with diloco, 1 with noloco"))
    zstd: str = Field("auto", pattern=r"^(auto|on|off)$",
                      description="zstd as the last stage: auto (where it pays), on, off")
    zstd_level: int = Field(default_factory=_codec_default("zstd_level"), ge=-7, le=22,
                            description="zstd compression level")

    # --- persistence ---
    checkpoint_dir: str = Field("checkpoints", description="checkpoints go to DIR/<run_id>/ and join resumes from "
                                "there; '' turns checkpoints off")
    events: str = Field("", description="machine-readable events, one JSON object per line: '-' for stdout or a "
                        "file path ('' = none; docs/operations.md)")
    checkpoint_every: int = Field(1, ge=0, description="checkpoint every N rounds (0 = never)")
    identity: str = Field("", description="libp2p key file that keeps this node's peer id (and so its peer "
                          "address) across restarts, created when missing; '' = identity.key in --checkpoint-dir "
                          "(a new id each start when checkpoints are off). A corrupt key, or one others can read, "
                          "is refused (exit 2)")

    # --- permissioned runs (trust/admission.py) ---
    run_owner: str = Field("", description="the run owner's public key (from `diloco-node keygen`): only peers it "
                           "admitted take part, and with --peer only a manifest this key signed (`diloco-node run "
                           "sign`) is taken ('' = an open run; docs/trust.md)")
    admission: str = Field("", description="this node's admission for a --run-owner run: the token from "
                           "`diloco-node admit`, or a file holding it. A missing, expired, revoked or someone "
                           "else's admission exits 2 with one line")

    @field_validator("peer", "listen", "announce")
    @classmethod
    def _multiaddrs(cls, values: list[str]) -> list[str]:
        check = MULTIADDR_CHECK.get()
        for value in values:
            check(value)
        return values

    @field_validator("peer")
    @classmethod
    def _peer_has_id(cls, values: list[str]) -> list[str]:
        for value in values:
            if "/p2p/" not in value:
                raise ValueError(f"peer address '{value}' lacks its /p2p/<peer id> part")
        return values

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _micro_batch(cls, value: Any) -> int | str:
        """A count ≥ 0 or "auto" (train/fit.py, docs/architecture.md §11); the CLI hands over text."""
        if value == "auto":
            return value
        text = str(value).strip()
        if isinstance(value, bool) or not (text.isdigit() and isinstance(value, int | str)):
            raise ValueError(f"'{value}' is neither a number of sequences (0 or more) nor auto")
        return int(text)

    @field_validator("upload_limit", "download_limit", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> str:
        """A rate rates.parse_rate reads (ValueError in one line otherwise), kept as written."""
        parse_rate(value)
        return str(value).strip()

    @property
    def upload_rate(self) -> float:
        """--upload-limit in bytes/s, 0 for no cap."""
        return parse_rate(self.upload_limit)

    @property
    def download_rate(self) -> float:
        """--download-limit in bytes/s, 0 for no cap."""
        return parse_rate(self.download_limit)

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        model_shape(value)  # ValueError naming what is wrong with it
        return value

    @field_validator("compression")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        return CODECS.check(value)

    @field_validator("status")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"status address '{value}' is not HOST:PORT")
        return value

    @field_validator("run_owner")
    @classmethod
    def _owner_key(cls, value: str) -> str:
        if value:
            PUBLIC_KEY_CHECK.get()(value)  # AdmissionError is a ValueError: phrased for the user
        return value

    @model_validator(mode="after")
    def _admission_fits(self) -> NodeConfig:
        if self.run_owner and not self.admission:
            raise ValueError("a run with --run-owner needs this node's --admission (ask the run owner for one)")
        if self.admission and not self.run_owner:
            raise ValueError("--admission needs the --run-owner it was issued under")
        if self.run_owner and self.identity_path is None:
            raise ValueError("a run with --run-owner needs a lasting peer id, which the owner admits: "
                             "give --identity PATH (or keep --checkpoint-dir)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _defaults_that_follow(cls, data: Any) -> Any:
        """Unset sync follows the algorithm (NoLoCo's small groups exchange blocking), and unset
        momentum follows sync: a step that lands a round late already acts as momentum. Unset
        local_ranks follows the number of --devices. A DiLoCo run with an error-feedback codec takes
        FEEDBACK_OUTER for whichever of those settings are unset."""
        if not isinstance(data, dict):
            return data
        if data.get("sync") is None:
            data = {**data, "sync": "blocking" if data.get("algorithm") == "noloco" else "eager"}
        if data.get("local_ranks") is None and data.get("devices"):
            data = {**data, "local_ranks": len(str(data["devices"]).split(","))}
        if _keeps_residual(data.get("compression")) and data.get("algorithm", "diloco") == "diloco":
            data = {**data, **{key: value for key, value in FEEDBACK_OUTER.items() if data.get(key) is None}}
        if data.get("outer_momentum") is None:
            # an unknown sync keeps DiLoCo's; the sync field's own check then names the mistake
            data = {**data, "outer_momentum": SYNC_MOMENTUM.get(data["sync"], DILOCO_MOMENTUM)}
        return data

    @model_validator(mode="after")
    def _one_round_length(self) -> NodeConfig:
        """A round is H steps or T seconds, never both, but under speed_spent batch, where it is H steps
        of a batch sized to end by T (docs/architecture.md §13)."""
        if self.round_seconds is None:
            if self.speed_spent == "batch":
                raise ValueError("speed_spent batch needs --round-seconds T: the deadline each node sizes its "
                                 "batch to")
            return self
        if not (math.isfinite(self.round_seconds) and self.round_seconds > 0):
            raise ValueError(f"round_seconds must be a number of seconds > 0, not {self.round_seconds}")
        if "inner_steps" in self.model_fields_set and self.speed_spent == "steps":
            raise ValueError("give --round-seconds (a round of T seconds) or --inner-steps (a round of H steps), "
                             "not both (or --speed-spent batch: H steps whose batch fits T)")
        if self.speed_spent == "batch" and self.parallel == "pipeline":
            # the pipeline's schedule runs one batch per step; accumulating several is not built there
            raise ValueError("speed_spent batch is not available with parallel pipeline (use none or fsdp)")
        return self

    @property
    def steps_agreed(self) -> bool:
        """Whether every node runs the same H inner steps a round, so that the learning-rate schedule is
        indexed by steps (a fixed H, or --speed-spent batch); False under --round-seconds with speed
        spent on steps, where the decay follows the run's rounds (docs/architecture.md §13)."""
        return self.round_seconds is None or self.speed_spent == "batch"

    @model_validator(mode="after")
    def _noloco_is_blocking(self) -> NodeConfig:
        if self.algorithm == "noloco" and self.sync != "blocking":
            raise ValueError(f"algorithm noloco runs with sync blocking only, not {self.sync} (its small groups "
                             "already keep exchanges short)")
        if self.algorithm == "noloco" and self.group_size < self.min_group_size:
            raise ValueError(f"group_size {self.group_size} is below min_group_size {self.min_group_size}: no "
                             "drawn group could ever average")
        return self

    @model_validator(mode="after")
    def _fragments_have_steps(self) -> NodeConfig:
        if self.steps_agreed and self.fragments > self.inner_steps:  # by time alone: rounds of T/P seconds
            raise ValueError(f"fragments {self.fragments} is more than inner_steps {self.inner_steps}: each round "
                             "runs H/P inner steps, so some rounds would train nothing")
        return self

    @model_validator(mode="after")
    def _butterfly_fits(self) -> NodeConfig:
        if self.exchange == "butterfly" and (why := self._no_butterfly()):
            raise ValueError(f"exchange butterfly {why}")
        if self.reachability == "private" and not self.butterfly_possible:
            raise ValueError("reachability private needs a run that can exchange by butterfly (a client cannot be "
                             "fetched from): " + (self._no_butterfly() or self._no_client_butterfly()))
        return self

    def _no_butterfly(self) -> str | None:
        """Why this run cannot exchange by butterfly; None when it can."""
        if self.algorithm == "noloco":
            return "is for DiLoCo: NoLoCo's groups are small by design (--group-size), so all-gather costs the same"
        if CODECS[self.compression].feedback:
            return (f"needs a dense codec: averaging sparse parts and sparsifying again would drop what "
                    f"{self.compression} keeps")
        if self.aggregator == "centered-clip":
            return "cannot run centered-clip, which measures distances between whole vectors"
        return None

    def _no_client_butterfly(self) -> str:
        return ("exchange is allgather" if self.exchange == "allgather" else
                "an open run exchanges by butterfly only with --exchange butterfly")

    @property
    def butterfly_possible(self) -> bool:
        """Whether this run can exchange by butterfly at all: a group with a client always does.

        auto: only in permissioned runs. A client flag is self-declared in a peer's record, so in an
        open run it would let any peer switch its group to the butterfly and hand its other
        identities parts to own (docs/architecture.md §9); there the operator must ask for it."""
        if self._no_butterfly() is not None:
            return False
        return self.exchange == "butterfly" or (self.exchange == "auto" and bool(self.run_owner))

    @property
    def butterfly_from(self) -> int | None:
        """Groups of at least this many members exchange by butterfly; None: always all-gather.

        auto: from 3 (at 2 both move one payload each way, and all-gather needs no second encoding),
        and only in permissioned runs: a part's owner computes that part's mean for everyone, which
        admitted peers can be trusted with; in an open run every member checks every contribution."""
        if self.exchange == "allgather" or self._no_butterfly():
            return None
        if self.exchange == "butterfly":
            return 2
        return AUTO_BUTTERFLY_FROM if self.run_owner else None

    @property
    def part_align(self) -> int:
        """Where butterfly parts may be cut: on the codec's blocks, so a part encodes as its slice of the whole."""
        blocks = CODECS[self.compression].blocks
        return int(getattr(self, blocks)) if blocks else 1

    @model_validator(mode="after")
    def _local_ranks_fit(self) -> NodeConfig:
        shape = model_shape(self.model)
        k, layers = self.local_ranks, shape.n_layer
        if why := shape.layout_refusal(self.parallel):
            raise ValueError(why)
        if self.parallel == "none" and k > 1:
            raise ValueError(f"local_ranks {k} needs parallel fsdp or pipeline")
        if self.parallel != "none" and k < 2:
            raise ValueError(f"parallel {self.parallel} needs local_ranks 2 or more")
        if self.devices and len(self.devices.split(",")) != k:
            raise ValueError(f"devices lists {len(self.devices.split(','))} devices for local_ranks {k}")
        if self.parallel == "pipeline" and k > layers:
            raise ValueError(f"a pipeline of {k} stages needs {k} layers; model '{self.model}' has {layers}")
        if self.batch_size % k:
            raise ValueError(f"batch_size {self.batch_size} does not split over {k} local ranks")
        if self.micro_batch_size == "auto" and self.parallel != "none":
            raise ValueError(f"micro_batch_size auto needs parallel none (a rank that backs off alone would "
                             f"stall the others of parallel {self.parallel}); give a number")
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size and \
                (self.batch_size // k) % self.micro_batch_size:
            raise ValueError(f"micro_batch_size {self.micro_batch_size} does not divide the {self.batch_size // k} "
                             f"sequences per local rank (batch_size {self.batch_size} over {k})")
        if self.compile == "on" and self.parallel == "pipeline":
            raise ValueError("compile on is not available with parallel pipeline (use none or fsdp)")
        if self.init == "pretrained" and not getattr(shape, "has_weights", False):
            raise ValueError(f"init pretrained needs a Hugging Face model directory with *.safetensors weights; "
                             f"model '{self.model}' has none")
        return self

    @property
    def consensus_weight(self) -> float:
        """NoLoCo's γ: as set, else α (docs/architecture.md §3)."""
        return self.noloco_alpha if self.noloco_gamma is None else self.noloco_gamma

    @model_validator(mode="after")
    def _fits_model(self) -> NodeConfig:
        limit = model_shape(self.model).max_seq_len
        if self.seq_len > limit:
            raise ValueError(f"seq_len {self.seq_len} exceeds model '{self.model}' limit of {limit}")
        tokens, vocab = TOKENIZER_VOCAB.get()(self.tokenizer), model_shape(self.model).vocab_size
        if tokens > vocab:
            raise ValueError(f"tokenizer '{self.tokenizer or 'bytes'}' has {tokens} tokens, more than model "
                             f"'{self.model}' has in its vocabulary ({vocab})")
        CODEC_CHECK.get()(self)  # the codec's own range checks, phrased for the user
        return self

    def codec_fingerprint(self) -> dict[str, Any]:
        """The codec parameters a peer needs to decode our payloads (zstd is flagged per payload)."""
        return {"compression": self.compression,
                **{key: getattr(self, key) for key in CODECS[self.compression].params}}

    @property
    def checkpoint_path(self) -> Path | None:
        return Path(self.checkpoint_dir) / self.run_id if self.checkpoint_dir else None

    @property
    def identity_path(self) -> Path | None:
        if self.identity:
            return Path(self.identity)
        return Path(self.checkpoint_dir) / "identity.key" if self.checkpoint_dir else None

    @property
    def status_host_port(self) -> tuple[str, int]:
        host, _, port = self.status.rpartition(":")
        return host, int(port)

    def rank_threads(self) -> int:
        """torch threads per local rank: as set, else the cores shared out when there are several ranks."""
        if self.threads or self.local_ranks == 1:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.local_ranks)

    def round_inner_steps(self, round_: int) -> int:
        """Inner steps of round `round_`: H, or with P fragments H cut into P near-equal shares in a
        cycle, so that any P consecutive rounds (one exchange of each fragment) run exactly H steps
        (docs/architecture.md §15)."""
        k = round_ % self.fragments
        return self.inner_steps * (k + 1) // self.fragments - self.inner_steps * k // self.fragments

    @property
    def round_budget(self) -> float | None:
        """Seconds of one round under --round-seconds: T, or with P fragments T/P, so that P consecutive
        rounds (one exchange of each fragment) last T, as P rounds run H steps (docs/architecture.md §13,
        §15); None without a time budget."""
        return None if self.round_seconds is None else self.round_seconds / self.fragments

    def inner_steps_before(self, round_: int) -> int:
        """Inner steps the rounds before `round_` run together (the learning-rate schedule's position)."""
        cycles, k = divmod(round_, self.fragments)
        return cycles * self.inner_steps + self.inner_steps * k // self.fragments

    def fingerprint_fields(self) -> dict[str, Any]:
        """What peers must share to average together: the protocol, the model's shape and the outer
        algorithm."""
        return {
            "protocol": PROTOCOL,
            **model_shape(self.model).fingerprint_fields(),  # the preset's shape, or every entry of an HF config
            **({"init": self.init} if self.init != "random" else {}),
            **DATA_IDENTITY.get()(self),  # the tokenizer's and the eval split's digests, when given
            "algorithm": self.algorithm, "sync": self.sync, **self._outer_fingerprint(), **self.codec_fingerprint(),
            "aggregator": self.aggregator, "max_tokens_per_round": self.max_tokens_per_round,
            # every member must weight alike, or φ splits (docs/architecture.md §13)
            **({"weighting": self.weighting} if self.weighting != "tokens" else {}),
            # every member must hold rounds alike, or a pair would split φ (docs/architecture.md §9)
            **({"min_group_size": self.min_group_size} if self.min_group_size != 2 else {}),
            # every member must end its rounds on the same deadlines (docs/architecture.md §13)
            **({"round_seconds": self.round_seconds} if self.round_seconds is not None else {}),
            # every member must run the same H, so that every Δ covers the same point of the schedule (§13)
            **({"speed_spent": self.speed_spent, "inner_steps": self.inner_steps}
               if self.speed_spent != "steps" else {}),
            # which fragment a round exchanges, and how long its payload is (docs/architecture.md §15)
            **({"fragments": self.fragments} if self.fragments != 1 else {}),
            **({"run_owner": self.run_owner} if self.run_owner else {}),
            # with run_owner, codec, algorithm and aggregator this fixes which groups use butterfly
            **({"exchange": self.exchange} if self.exchange != "auto" else {}),
        }

    def _outer_fingerprint(self) -> dict[str, Any]:
        if self.algorithm == "noloco":
            # every node draws the round's groups itself: with another size it would draw others
            return {"group_size": self.group_size, "noloco_alpha": self.noloco_alpha,
                    "noloco_beta": self.noloco_beta, "noloco_gamma": self.consensus_weight}
        return {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
                **({"eager_proxy": self.eager_proxy} if self.sync == "eager" else {})}

    def fingerprint(self) -> str:
        return fingerprint_of(self.fingerprint_fields())

    def checkpoint_fingerprint(self) -> str:
        """What a checkpoint must match to be resumed: the fingerprint less the protocol version,
        which changes how nodes talk, not the state they keep (an upgrade resumes its checkpoints)."""
        fields = self.fingerprint_fields()
        del fields["protocol"]
        return fingerprint_of(fields)


def model_shape(model: str) -> Any:
    """What `--model` names (registry.MODELS; resolved once per name): ValueError, one line, if nothing."""
    return MODELS.get()(model)


# Fields whose values a registry lists: --help names the known ones after the description.
CHOICES: dict[str, Registry[Any]] = {"model": MODEL_PRESETS, "compression": CODECS}


def _feedback_codecs_named(text: str) -> str:
    return text.replace(FEEDBACK_CODECS, " or ".join(c for c in CODECS.names() if CODECS[c].feedback))


def describe(name: str) -> str:
    """The help text of field `name`: its description, with the values it may take where a registry lists them,
    after the codecs it tunes where it is a codec's parameter, and with the error-feedback codecs named."""
    text = _feedback_codecs_named(str(NodeConfig.model_fields[name].description))
    if tuned := [codec for codec in CODECS.names() if name in CODECS[codec].knobs]:
        text = f"{'/'.join(tuned)}: {text}"
    known = CHOICES.get(name)
    return f"{text}: {', '.join(known.names())}" if known else text


def unset_default(name: str) -> str | None:
    """What field `name` means when left unset, in words (its `_unset` text, error-feedback codecs
    named); None where its Field default says it."""
    extra = NodeConfig.model_fields[name].json_schema_extra
    text = extra.get("unset") if isinstance(extra, dict) else None
    return _feedback_codecs_named(text) if isinstance(text, str) else None


def read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from None
    # TOML users write either-case keys with dashes like the flags; normalise to field names.
    return {key.replace("-", "_"): value for key, value in data.items()}


def build_config(values: dict[str, Any], source: str = "options") -> NodeConfig:
    """Validate merged values, turning pydantic's report into one line naming the key."""
    try:
        return NodeConfig(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"]) or "config"
        if error["type"] == "extra_forbidden":
            raise ConfigError(f"unknown config key '{key}' in {source}") from None
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:  # a check across several keys: the message names them
            raise ConfigError(f"invalid configuration: {message}") from None
        raise ConfigError(f"invalid value for '{key}': {message}") from None


def load_config(file: str | None, overrides: dict[str, Any]) -> NodeConfig:
    """File values first, then overrides (env and flags, already resolved by the CLI)."""
    values = read_toml(file) if file else {}
    source = f"config file '{file}'" if file else "options"
    values.update(overrides)
    return build_config(values, source)


