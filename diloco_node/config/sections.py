"""NodeConfig's settings by concern: one model per section, holding its fields, their descriptions
and the checks that read that section alone (checks across sections are NodeConfig's, config/__init__.py).

NodeConfig holds one of each, under the name SECTIONS gives it, so the code reads a setting through
its section (`cfg.outer.outer_lr`). A field's name is the setting's one flat name everywhere else (the
flag --outer-lr, DILOCO_OUTER_LR, the TOML key outer_lr, the key in manifests and the fingerprint),
so no two sections share a field name and none is a section's; a file may also group keys under a
section's table (`[outer]`). SECTIONS names the sections in --help's order; the field order inside a
section is --help's and the configuration reference's. FIELDS and SECTION_OF index them by flat name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.fields import FieldInfo

from diloco_node.config.defaults import (
    BLOCKING_STEP,
    DEFAULT_STATUS_PORT,
    DELAYED_MOMENTUM,
    DILOCO_MOMENTUM,
    EAGER_MOMENTUM,
    FEEDBACK_CODECS,
    FEEDBACK_OUTER,
    INNER_LR,
    OUTER_LR,
    codec_default,
    unset,
)
from diloco_node.rates import parse_rate
from diloco_node.registry import CODECS, MODELS, MULTIADDR_CHECK, PUBLIC_KEY_CHECK


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Swarm(Section):
    """The swarm: which run, whom to reach and how, and what the node may send and receive."""

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

    @field_validator("upload_limit", "download_limit", mode="before")
    @classmethod
    def _rate(cls, value: Any) -> str:
        """A rate rates.parse_rate reads (ValueError in one line otherwise), kept as written."""
        parse_rate(value)
        return str(value).strip()

    @field_validator("status")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(f"status address '{value}' is not HOST:PORT")
        return value

    @property
    def upload_rate(self) -> float:
        """--upload-limit in bytes/s, 0 for no cap."""
        return parse_rate(self.upload_limit)

    @property
    def download_rate(self) -> float:
        """--download-limit in bytes/s, 0 for no cap."""
        return parse_rate(self.download_limit)

    @property
    def status_host_port(self) -> tuple[str, int]:
        host, _, port = self.status.rpartition(":")
        return host, int(port)


class Inputs(Section):
    """The model and the data: what is trained, on what, in which shape of batch."""

    model: str = Field("tiny", description="model: a Hugging Face model directory, its config.json, a hub id "
                       "(org/name, when the hub is reachable) or a preset (tiny, small and gpt-* built in, llama-* "
                       "from configs/*.json; docs/models.md)")  # --help lists the presets (CHOICES)
    init: str = Field("random", pattern=r"^(random|pretrained)$",
                      description="initial weights: random (a pure function of --seed) or pretrained (the model "
                      "directory's *.safetensors: continued pretraining)")
    data: str | None = Field(None, description="training data: a text, .jsonl, .parquet or .arrow file or a "
                             "directory of them (read through datasets, offline), token shards (.bin: llm.c or nanoGPT "
                             "layout, memory-mapped) or hf:NAME[:CONFIG][:SPLIT] (a hub dataset, streamed; "
                             "docs/models.md, train your own model)", json_schema_extra=unset("the embedded corpus"))
    tokenizer: str | None = Field(None, description="a tokenizer.json or a directory holding one (from `diloco-node "
                                  "tokenizer train` or any Hugging Face tokenizer)",
                                  json_schema_extra=unset("bytes (vocabulary 256)"))
    text_column: str = Field("text", min_length=1, description="the column of --data's datasets (jsonl, parquet, "
                             "arrow, hub) that holds the text")
    seq_len: int = Field(128, gt=0, description="tokens (bytes) per training sequence")
    batch_size: int = Field(16, gt=0, description="sequences per inner step")
    eval_batches: int = Field(8, gt=0, description="held-out batches for eval loss each round")
    seed: int = Field(0, ge=0, description="seed for the initial model and this node's data order")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        model_shape(value)  # ValueError naming what is wrong with it
        return value


class Local(Section):
    """The node's own devices (docs/architecture.md §5): one replica over K local ranks."""

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where inner steps run: auto (cuda when available), cpu, cuda or cuda:N")
    threads: int = Field(0, ge=0, description="torch CPU threads per local rank (0 = torch's default; with "
                         "several local ranks, the cores shared out)")
    parallel: str = Field("none", pattern=r"^(none|fsdp|pipeline)$",
                          description="how the node splits its replica over its local ranks: none, fsdp "
                          "(shards) or pipeline (stages)")
    local_ranks: int = Field(1, ge=1, le=64, description="K: processes (one per device) the replica runs on",
                             json_schema_extra=unset("the number of --devices, else 1"))
    devices: str = Field("", pattern=r"^$|^(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*$",
                         description="comma-separated device per local rank, e.g. cuda:0,cuda:1",
                         json_schema_extra=unset("cuda:0..K-1 when --device is cuda, else cpu"))
    precision: str = Field("auto", pattern=r"^(auto|fp32|bf16)$",
                           description="inner steps in fp32 or bf16 autocast; auto: bf16 on a GPU that has it, "
                           "else fp32 (φ and the outer step stay fp32)")
    compile: str = Field("off", pattern=r"^(on|off)$", description="on: torch.compile the model for the inner "
                         "steps (--parallel none or fsdp); off")
    micro_batch_size: int | str = Field(0, description="sequences per forward/backward pass on each local rank, "
                                        "gradients accumulated up to --batch-size (0: the whole batch at once; "
                                        "auto: the largest that fits the device, docs/models.md, a batch that "
                                        "fits)")

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

    def rank_threads(self) -> int:
        """torch threads per local rank: as set, else the cores shared out when there are several ranks."""
        if self.threads or self.local_ranks == 1:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.local_ranks)


class Inner(Section):
    """The inner optimizer (AdamW) and the length of a round."""

    inner_steps: int = Field(50, gt=0, description="H: inner AdamW steps per outer round (under "
                             "--speed-spent batch the run's: every node runs it)")
    round_seconds: float | None = Field(None, description="T: rounds by time budget instead of --inner-steps (not "
                                        "both): a round ends on a deadline of the swarm's clock every T seconds and "
                                        "each node trains as many inner steps as fit; with --fragments P a round "
                                        "lasts T/P, a round per fragment (docs/configuration.md, rounds by time "
                                        "budget; docs/architecture.md §13)",
                                        json_schema_extra=unset("rounds of --inner-steps"))
    speed_spent: str = Field("steps", pattern=r"^(steps|batch)$",
                             description="under --round-seconds, what a faster node spends its speed on: steps "
                             "(as many inner steps as fit before the deadline) or batch (every node --inner-steps "
                             "H steps, a faster node accumulating more batches of --batch-size into each; "
                             "docs/architecture.md §13)")
    inner_lr: float = Field(INNER_LR, gt=0, description="peak inner learning rate (linear warmup, then cosine "
                            "decay when --max-outer-steps is set); unset, it follows the outer step "
                            "(docs/configuration.md, sync modes)",
                            json_schema_extra=unset(f"{BLOCKING_STEP['inner_lr']:g} with blocking DiLoCo "
                                                    f"(no {FEEDBACK_CODECS}, no outer lr or momentum given); "
                                                    f"{INNER_LR:g} otherwise"))
    warmup_steps: int = Field(50, ge=0, description="inner linear warmup steps")
    weight_decay: float = Field(0.1, ge=0, description="inner AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="inner gradient norm clip")


class Outer(Section):
    """The outer optimizer (Nesterov SGD on pseudo-gradients): its step, when the exchange runs, and
    how much of φ a round exchanges."""

    outer_lr: float = Field(OUTER_LR, gt=0, description="outer learning rate (an error-feedback codec's residual "
                            "does momentum's job, so its runs step further: docs/configuration.md, compression)",
                            json_schema_extra=unset(f"{FEEDBACK_OUTER['outer_lr']:g} with {FEEDBACK_CODECS}; "
                                                    f"{BLOCKING_STEP['outer_lr']:g} with blocking DiLoCo "
                                                    f"(no momentum given); {OUTER_LR:g} otherwise"))
    outer_momentum: float = Field(DILOCO_MOMENTUM, ge=0, lt=1, description=(
        "outer Nesterov momentum; unset, it follows --sync (a step that lands a round late already acts as "
        "momentum) and is 0 with an error-feedback codec, whose residual does momentum's job "
        "(docs/configuration.md, sync modes and compression)"),
        json_schema_extra=unset(f"{BLOCKING_STEP['outer_momentum']:g} blocking DiLoCo (no outer lr given), "
                                 f"else {DILOCO_MOMENTUM:g} blocking, {EAGER_MOMENTUM:g} eager, "
                                 f"{DELAYED_MOMENTUM:g} delayed; 0 with {FEEDBACK_CODECS}"))
    sync: str = Field("blocking", pattern=r"^(blocking|delayed|eager)$",
                      description="when the exchange runs: blocking, delayed or eager (overlaps the next round at "
                      "a cost in tokens; docs/configuration.md, sync modes)")
    eager_proxy: str = Field("full", pattern=r"^(full|share)$",
                             description="eager: weight of our fresh Δ in the proxy: full (it stands in for the "
                             "group's mean until that arrives) or share (our token share, 1/M, as in "
                             "docs/architecture.md §3)")
    sync_timeout: float = Field(120.0, gt=0, description="delayed/eager: seconds to wait for the previous "
                                "round's exchange before going on without it (it is applied when it lands)")
    max_outer_steps: int = Field(0, ge=0, description="stop after this many rounds (0 = run forever)")
    fragments: int = Field(1, ge=1, description="P: φ is exchanged in P fragments of whole tensors, one per round "
                           "in turn, each round running H/P inner steps (with --round-seconds T: lasting T/P "
                           "seconds), so a round sends about 1/P of the model (Streaming DiLoCo; "
                           "docs/configuration.md, sync modes; docs/architecture.md §15); at most the model's "
                           "parameter tensors and --inner-steps")


class Averaging(Section):
    """How a group averages: who may reach whom, how contributions travel, are bounded and weighted."""

    aggregator: str = Field("clip", pattern=r"^(mean|clip|trimmed|centered-clip)$",
                            description="how the group's pseudo-gradients are averaged: mean, clip (each to 1.25x "
                            "the median norm), trimmed or centered-clip (docs/configuration.md, aggregation; "
                            "docs/trust.md)")
    weighting: str = Field("equal", pattern=r"^(tokens|sqrt-tokens|equal)$",
                           description="each peer's weight in the mean: equal, or from its declared tokens after "
                           "the cap: tokens or sqrt-tokens, which one peer's claim can tip when honest peers "
                           "differ in speed or batch (docs/architecture.md §13, docs/trust.md)")
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
    min_group_size: int = Field(2, ge=2, le=64, description="fewest nodes, this one included, whose mean φ steps "
                                "on; a round with a smaller group takes no outer step (an open run should set 3, "
                                "as a pair cannot tell who lies; docs/trust.md, docs/architecture.md §9)")


class NoLoCo(Section):
    """NoLoCo: gossip in small random groups instead of averaging over the swarm (docs/architecture.md §3)."""

    algorithm: str = Field("diloco", pattern=r"^(diloco|noloco)$",
                           description="outer algorithm: diloco (the group is everyone) or noloco (random small "
                           "groups; docs/configuration.md, NoLoCo)")
    group_size: int = Field(2, ge=2, le=64, description="noloco: most nodes in a group (n)")
    noloco_alpha: float = Field(0.7, gt=0, description="noloco: α, weight of the group's mean progress")
    noloco_beta: float = Field(0.5, ge=0, lt=1, description="noloco: β, momentum")
    noloco_gamma: float | None = Field(None, ge=0, description="noloco: γ, pull towards the group's mean φ",
                                       json_schema_extra=unset("α (--noloco-alpha)"))

    @property
    def consensus_weight(self) -> float:
        """NoLoCo's γ: as set, else α (docs/architecture.md §3)."""
        return self.noloco_alpha if self.noloco_gamma is None else self.noloco_gamma


class Codec(Section):
    """Pseudo-gradient compression (docs/architecture.md §3, codecs)."""

    # the codec parameters' defaults are the codecs' own (codec/codecs.py, CodecSpec), and so are the
    # codecs each one tunes, which --help names before its description (describe)
    # int4 by default: in the learning simulator (M = 4, H = 50, blocking, three seeds) it ended within
    # fp32's spread (5.38-5.42 against 5.40-5.42), and on the daemon it reached the same loss with the
    # same tokens per node in 7.6x fewer wire bytes (docs/benchmarks.md, "The defaults, on the daemon")
    compression: str = Field("int4", description="pseudo-gradient codec")  # --help lists the codecs (CHOICES)
    block_size: int = Field(default_factory=codec_default("block_size"), gt=0, description="values per scale")
    topk_chunk: int = Field(default_factory=codec_default("topk_chunk"), gt=0, description="values per chunk")
    topk_k: int = Field(default_factory=codec_default("topk_k"), gt=0, description="values kept per chunk")
    topk_bits: int = Field(default_factory=codec_default("topk_bits"),
                           description="bits per kept value: 8, 4, 2 or 1")
    sign_block: int = Field(default_factory=codec_default("sign_block"), gt=0,
                            description="values per scale (a multiple of 8)")
    sign_keep: float = Field(default_factory=codec_default("sign_keep"), gt=0, le=1,
                             description="share of blocks sent per round (those of largest norm)")
    ef_decay: float = Field(default_factory=codec_default("ef_decay"), ge=0, le=1,
                            description="error-feedback decay β",
                            json_schema_extra=unset(f"{FEEDBACK_OUTER['ef_decay']:g} with diloco, 1 with noloco"))
    zstd: str = Field("auto", pattern=r"^(auto|on|off)$",
                      description="zstd as the last stage: auto (where it pays), on, off")
    zstd_level: int = Field(default_factory=codec_default("zstd_level"), ge=-7, le=22,
                            description="zstd compression level")

    @field_validator("compression")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        return CODECS.check(value)

    def codec_fingerprint(self) -> dict[str, Any]:
        """The codec parameters a peer needs to decode our payloads (zstd is flagged per payload)."""
        return {"compression": self.compression,
                **{key: getattr(self, key) for key in CODECS[self.compression].params}}

    @property
    def part_align(self) -> int:
        """Where butterfly parts may be cut: on the codec's blocks, so a part encodes as its slice of the whole."""
        blocks = CODECS[self.compression].blocks
        return int(getattr(self, blocks)) if blocks else 1


class Persistence(Section):
    """What the node keeps on disk and writes out: checkpoints, events, its identity."""

    checkpoint_dir: str = Field("checkpoints", description="checkpoints go to DIR/<run_id>/ and join resumes from "
                                "there; '' turns checkpoints off")
    events: str = Field("", description="machine-readable events, one JSON object per line: '-' for stdout or a "
                        "file path ('' = none; docs/operations.md)")
    checkpoint_every: int = Field(1, ge=0, description="checkpoint every N rounds (0 = never)")
    identity: str = Field("", description="libp2p key file that keeps this node's peer id (and so its peer "
                          "address) across restarts, created when missing; '' = identity.key in --checkpoint-dir "
                          "(a new id each start when checkpoints are off). A corrupt key, or one others can read, "
                          "is refused (exit 2)")

    @property
    def identity_path(self) -> Path | None:
        if self.identity:
            return Path(self.identity)
        return Path(self.checkpoint_dir) / "identity.key" if self.checkpoint_dir else None


class Permission(Section):
    """Permissioned runs (trust/admission.py)."""

    run_owner: str = Field("", description="the run owner's public key (from `diloco-node keygen`): only peers it "
                           "admitted take part, and with --peer only a manifest this key signed (`diloco-node run "
                           "sign`) is taken ('' = an open run; docs/trust.md)")
    admission: str = Field("", description="this node's admission for a --run-owner run: the token from "
                           "`diloco-node admit`, or a file holding it. A missing, expired, revoked or someone "
                           "else's admission exits 2 with one line")

    @field_validator("run_owner")
    @classmethod
    def _owner_key(cls, value: str) -> str:
        if value:
            PUBLIC_KEY_CHECK.get()(value)  # AdmissionError is a ValueError: phrased for the user
        return value


def model_shape(model: str) -> Any:
    """What `--model` names (registry.MODELS; resolved once per name): ValueError, one line, if nothing."""
    return MODELS.get()(model)


# A TOML file's table for each section, in --help's order (a name no field has: a table never hides a key)
SECTIONS: dict[str, type[Section]] = {
    "swarm": Swarm, "inputs": Inputs, "local": Local, "inner": Inner, "outer": Outer, "averaging": Averaging,
    "noloco": NoLoCo, "codec": Codec, "persistence": Persistence, "permission": Permission,
}

# Every setting by its flat name (the flag, the env var, the TOML key), and the section that holds it
FIELDS: dict[str, FieldInfo] = {key: field for model in SECTIONS.values() for key, field in model.model_fields.items()}
SECTION_OF: dict[str, str] = {key: name for name, model in SECTIONS.items() for key in model.model_fields}
