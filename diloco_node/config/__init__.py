"""Node configuration: every setting, its default and its validation.

The settings are grouped by concern in config/sections.py (one model per section: swarm, inputs,
local, inner, outer, averaging, noloco, codec, persistence, permission); NodeConfig is all of them,
with the checks across sections, the fingerprint and the loading of flags, environment and files.

The CLI builds its options from these fields, so a key in a TOML file, an env var DILOCO_<KEY>
and a flag --<key> always mean the same thing. Precedence: flag > env > file > default.

A leaf (docs/architecture.md, import rules): it imports no domain module. What only a package
knows (its model presets, codecs and their default parameters, how to check a multiaddr or a
public key) it declares in registry.py, and the checks here read it from there; turning a config
into a package's own objects is that package's job (codec.codec_config_of, replica.settings_of).
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from diloco_node.config.defaults import (
    AUTO_BUTTERFLY_FROM,
    DEFAULT_STATUS_PORT,
    DILOCO_MOMENTUM,
    FEEDBACK_CODECS,
    FEEDBACK_OUTER,
    SYNC_MOMENTUM,
    keeps_residual,
)
from diloco_node.config.sections import (
    SECTIONS,
    Averaging,
    Codec,
    Inner,
    Inputs,
    Local,
    NoLoCo,
    Outer,
    Permission,
    Persistence,
    Swarm,
    model_shape,
)
from diloco_node.errors import NodeError
from diloco_node.fingerprint import PROTOCOL, fingerprint_of
from diloco_node.registry import CODEC_CHECK, CODECS, DATA_IDENTITY, MODEL_PRESETS, TOKENIZER_VOCAB, Registry

__all__ = ["DEFAULT_STATUS_PORT", "FEEDBACK_OUTER", "SECTIONS", "ConfigError", "NodeConfig", "build_config",
           "as_toml", "describe", "flat_keys", "load_config", "model_shape", "read_toml", "unset_default"]


class ConfigError(NodeError, ValueError):
    """A configuration problem, phrased for the person who made it (one line)."""


# pydantic collects fields from the last base first: listed in reverse, --help keeps SECTIONS' order
class NodeConfig(Permission, Persistence, Codec, NoLoCo, Averaging, Outer, Inner, Local, Inputs, Swarm):
    """Every setting of a node (config/sections.py, by concern; extra keys forbidden and frozen, as
    each Section), checked together."""

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
        if keeps_residual(data.get("compression")) and data.get("algorithm", "diloco") == "diloco":
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

    @property
    def checkpoint_path(self) -> Path | None:
        return Path(self.checkpoint_dir) / self.run_id if self.checkpoint_dir else None

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
    """A config file's keys, flat (`flat_keys`)."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file '{path}' cannot be read: {exc}") from None
    return flat_keys(data, f"config file '{path}'")


def flat_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """A file's keys as field names: written either with dashes like the flags or with underscores,
    at the top or inside their section's table (`[outer]` holding outer_lr; SECTIONS). A key in
    another section's table, or given twice, is one line naming it."""
    flat: dict[str, Any] = {}

    def add(key: str, value: Any, where: str) -> None:
        if key in flat:
            raise ConfigError(f"config key '{key}' is given twice in {source} ({where} and before)")
        flat[key] = value

    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in SECTIONS or not isinstance(value, dict):
            add(name, value, "at the top")
            continue
        for inner_key, inner_value in value.items():
            field = inner_key.replace("-", "_")
            if field not in SECTIONS[name].model_fields:
                home = next((section for section, model in SECTIONS.items() if field in model.model_fields), None)
                raise ConfigError(f"config key '{field}' in [{name}] of {source}: " +
                                  (f"it belongs in [{home}]" if home else "no such key"))
            add(field, inner_value, f"in [{name}]")
    return flat


def as_toml(cfg: NodeConfig) -> str:
    """`cfg` as a config file, a table per section (SECTIONS): what was given (or follows from what was:
    `_defaults_that_follow`) as keys, the defaults as comments, unset keys left out. Read back
    (read_toml), it is the same config: a default left a comment stays one that follows the others."""
    given = cfg.model_fields_set
    lines: list[str] = []
    for name, section in SECTIONS.items():
        lines.append(f"[{name}]")
        lines += [f"{'' if key in given else '# '}{key} = {json.dumps(getattr(cfg, key))}"
                  for key in section.model_fields if getattr(cfg, key) is not None]
        lines.append("")
    return "\n".join(lines)


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


