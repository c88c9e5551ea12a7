"""Node configuration: every setting, its default and its validation.

The settings are grouped by concern in config/sections.py (one model per section: swarm, inputs,
local, inner, outer, averaging, noloco, codec, persistence, permission); NodeConfig holds one field
per section, named as in SECTIONS, and the code reads a setting through its section
(`cfg.outer.outer_lr`, `cfg.inner.inner_steps`). NodeConfig keeps the checks across sections, what
is derived from several (butterfly_from, round_inner_steps, ...), the fingerprint and the loading
of flags, environment and files.

A setting keeps one flat name everywhere outside the code: the flag --outer-lr, the env var
DILOCO_OUTER_LR, the TOML key outer_lr (also under its table [outer]), and the key in manifests,
checkpoints and the fingerprint. NodeConfig is built from those flat keys (`NodeConfig._by_section`
distributes them, after `_defaults_that_follow` has read them), and `flat()` gives them back; FIELDS
lists every setting by that name and SECTION_OF its section. The CLI builds its options from FIELDS,
so a key in a TOML file, an env var DILOCO_<KEY> and a flag --<key> always mean the same thing.
Precedence: flag > env > file > default.

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

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from diloco_node.config.defaults import (
    AUTO_BUTTERFLY_FROM,
    BLOCKING_STEP,
    DEFAULT_STATUS_PORT,
    DILOCO_MOMENTUM,
    FEEDBACK_CODECS,
    FEEDBACK_OUTER,
    INNER_LR,
    OUTER_LR,
    SYNC_MOMENTUM,
    keeps_residual,
)
from diloco_node.config.sections import (
    FIELDS,
    SECTION_OF,
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

__all__ = ["DEFAULT_STATUS_PORT", "FEEDBACK_OUTER", "FIELDS", "SECTIONS", "SECTION_OF", "ConfigError", "NodeConfig",
           "build_config", "as_toml", "describe", "flat_keys", "load_config", "model_shape", "read_toml",
           "unset_default"]


class ConfigError(NodeError, ValueError):
    """A configuration problem, phrased for the person who made it (one line)."""


class NodeConfig(BaseModel):
    """Every setting of a node, one field per section (config/sections.py, SECTIONS: `cfg.outer.outer_lr`),
    checked together; extra keys forbidden and frozen, as each Section.

    Built from flat keys as the flags, env vars, files and manifests give them (`outer_lr`), or from
    sections (`{"outer": {"outer_lr": ...}}`, or an Outer): `_by_section` distributes them. `flat()` is
    the flat dict again, for whatever is written out (manifests, checkpoints, the fingerprint's fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    swarm: Swarm
    inputs: Inputs
    local: Local
    inner: Inner
    outer: Outer
    averaging: Averaging
    noloco: NoLoCo
    codec: Codec
    persistence: Persistence
    permission: Permission

    @model_validator(mode="before")
    @classmethod
    def _by_section(cls, data: Any) -> Any:
        """Flat keys (and those of sections given as tables or models), with the defaults that follow
        them, distributed into their sections. A key no section has stays at the top, where pydantic
        refuses it naming it; one in the wrong section's table stays there, refused the same way."""
        if not isinstance(data, dict):
            return data
        flat, stray = _flattened(data)
        nested: dict[str, Any] = {name: dict(stray.get(name, {})) for name in SECTIONS}
        others: dict[str, Any] = {}
        for key, value in _defaults_that_follow(flat).items():
            if key in SECTION_OF:
                nested[SECTION_OF[key]][key] = value
            else:
                others[key] = value
        return nested | others

    @model_validator(mode="after")
    def _admission_fits(self) -> NodeConfig:
        run_owner, admission = self.permission.run_owner, self.permission.admission
        if run_owner and not admission:
            raise ValueError("a run with --run-owner needs this node's --admission (ask the run owner for one)")
        if admission and not run_owner:
            raise ValueError("--admission needs the --run-owner it was issued under")
        if run_owner and self.persistence.identity_path is None:
            raise ValueError("a run with --run-owner needs a lasting peer id, which the owner admits: "
                             "give --identity PATH (or keep --checkpoint-dir)")
        return self

    @model_validator(mode="after")
    def _one_round_length(self) -> NodeConfig:
        """A round is H steps or T seconds, never both, but under speed_spent batch, where it is H steps
        of a batch sized to end by T (docs/architecture.md §13)."""
        inner = self.inner
        if inner.round_seconds is None:
            if inner.speed_spent == "batch":
                raise ValueError("speed_spent batch needs --round-seconds T: the deadline each node sizes its "
                                 "batch to")
            return self
        if not (math.isfinite(inner.round_seconds) and inner.round_seconds > 0):
            raise ValueError(f"round_seconds must be a number of seconds > 0, not {inner.round_seconds}")
        if "inner_steps" in inner.model_fields_set and inner.speed_spent == "steps":
            raise ValueError("give --round-seconds (a round of T seconds) or --inner-steps (a round of H steps), "
                             "not both (or --speed-spent batch: H steps whose batch fits T)")
        if inner.speed_spent == "batch" and self.local.parallel == "pipeline":
            # the pipeline's schedule runs one batch per step; accumulating several is not built there
            raise ValueError("speed_spent batch is not available with parallel pipeline (use none or fsdp)")
        return self

    @property
    def steps_agreed(self) -> bool:
        """Whether every node runs the same H inner steps a round, so that the learning-rate schedule is
        indexed by steps (a fixed H, or --speed-spent batch); False under --round-seconds with speed
        spent on steps, where the decay follows the run's rounds (docs/architecture.md §13)."""
        return self.inner.round_seconds is None or self.inner.speed_spent == "batch"

    @model_validator(mode="after")
    def _noloco_is_blocking(self) -> NodeConfig:
        if self.noloco.algorithm == "noloco" and self.outer.sync != "blocking":
            raise ValueError(f"algorithm noloco runs with sync blocking only, not {self.outer.sync} (its small groups "
                             "already keep exchanges short)")
        noloco, smallest = self.noloco, self.averaging.min_group_size
        if noloco.algorithm == "noloco" and noloco.group_size < smallest:
            raise ValueError(f"group_size {noloco.group_size} is below min_group_size {smallest}: no drawn group "
                             "could ever average")
        return self

    @model_validator(mode="after")
    def _fragments_have_steps(self) -> NodeConfig:
        fragments, steps = self.outer.fragments, self.inner.inner_steps
        if self.steps_agreed and fragments > steps:  # by time alone: rounds of T/P seconds
            raise ValueError(f"fragments {fragments} is more than inner_steps {steps}: each round runs H/P inner "
                             "steps, so some rounds would train nothing")
        return self

    @model_validator(mode="after")
    def _butterfly_fits(self) -> NodeConfig:
        if self.averaging.exchange == "butterfly" and (why := self._no_butterfly()):
            raise ValueError(f"exchange butterfly {why}")
        if self.averaging.reachability == "private" and not self.butterfly_possible:
            raise ValueError("reachability private needs a run that can exchange by butterfly (a client cannot be "
                             "fetched from): " + (self._no_butterfly() or self._no_client_butterfly()))
        return self

    def _no_butterfly(self) -> str | None:
        """Why this run cannot exchange by butterfly; None when it can."""
        if self.noloco.algorithm == "noloco":
            return "is for DiLoCo: NoLoCo's groups are small by design (--group-size), so all-gather costs the same"
        if CODECS[self.codec.compression].feedback:
            return (f"needs a dense codec: averaging sparse parts and sparsifying again would drop what "
                    f"{self.codec.compression} keeps")
        if self.averaging.aggregator == "centered-clip":
            return "cannot run centered-clip, which measures distances between whole vectors"
        return None

    def _no_client_butterfly(self) -> str:
        return ("exchange is allgather" if self.averaging.exchange == "allgather" else
                "an open run exchanges by butterfly only with --exchange butterfly")

    @property
    def butterfly_possible(self) -> bool:
        """Whether this run can exchange by butterfly at all: a group with a client always does.

        auto: only in permissioned runs. A client flag is self-declared in a peer's record, so in an
        open run it would let any peer switch its group to the butterfly and hand its other
        identities parts to own (docs/architecture.md §9); there the operator must ask for it."""
        if self._no_butterfly() is not None:
            return False
        exchange = self.averaging.exchange
        return exchange == "butterfly" or (exchange == "auto" and bool(self.permission.run_owner))

    @property
    def butterfly_from(self) -> int | None:
        """Groups of at least this many members exchange by butterfly; None: always all-gather.

        auto: from 3 (at 2 both move one payload each way, and all-gather needs no second encoding),
        and only in permissioned runs: a part's owner computes that part's mean for everyone, which
        admitted peers can be trusted with; in an open run every member checks every contribution."""
        if self.averaging.exchange == "allgather" or self._no_butterfly():
            return None
        if self.averaging.exchange == "butterfly":
            return 2
        return AUTO_BUTTERFLY_FROM if self.permission.run_owner else None

    @model_validator(mode="after")
    def _local_ranks_fit(self) -> NodeConfig:
        local, inputs = self.local, self.inputs
        shape = model_shape(inputs.model)
        k, layers, batch = local.local_ranks, shape.n_layer, inputs.batch_size
        if why := shape.layout_refusal(local.parallel):
            raise ValueError(why)
        if local.parallel == "none" and k > 1:
            raise ValueError(f"local_ranks {k} needs parallel fsdp or pipeline")
        if local.parallel != "none" and k < 2:
            raise ValueError(f"parallel {local.parallel} needs local_ranks 2 or more")
        if local.devices and len(local.devices.split(",")) != k:
            raise ValueError(f"devices lists {len(local.devices.split(','))} devices for local_ranks {k}")
        if local.parallel == "pipeline" and k > layers:
            raise ValueError(f"a pipeline of {k} stages needs {k} layers; model '{inputs.model}' has {layers}")
        if batch % k:
            raise ValueError(f"batch_size {batch} does not split over {k} local ranks")
        if local.micro_batch_size == "auto" and local.parallel != "none":
            raise ValueError(f"micro_batch_size auto needs parallel none (a rank that backs off alone would "
                             f"stall the others of parallel {local.parallel}); give a number")
        if isinstance(local.micro_batch_size, int) and local.micro_batch_size and \
                (batch // k) % local.micro_batch_size:
            raise ValueError(f"micro_batch_size {local.micro_batch_size} does not divide the {batch // k} "
                             f"sequences per local rank (batch_size {batch} over {k})")
        if local.compile == "on" and local.parallel == "pipeline":
            raise ValueError("compile on is not available with parallel pipeline (use none or fsdp)")
        if inputs.init == "pretrained" and not getattr(shape, "has_weights", False):
            raise ValueError(f"init pretrained needs a Hugging Face model directory with *.safetensors weights; "
                             f"model '{inputs.model}' has none")
        return self

    @model_validator(mode="after")
    def _fits_model(self) -> NodeConfig:
        inputs = self.inputs
        limit = model_shape(inputs.model).max_seq_len
        if inputs.seq_len > limit:
            raise ValueError(f"seq_len {inputs.seq_len} exceeds model '{inputs.model}' limit of {limit}")
        tokens, vocab = TOKENIZER_VOCAB.get()(inputs.tokenizer), model_shape(inputs.model).vocab_size
        if tokens > vocab:
            raise ValueError(f"tokenizer '{inputs.tokenizer or 'bytes'}' has {tokens} tokens, more than model "
                             f"'{inputs.model}' has in its vocabulary ({vocab})")
        CODEC_CHECK.get()(self)  # the codec's own range checks, phrased for the user
        return self

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, in SECTIONS' order: what is written out (manifests, checkpoints,
        a config file) and what NodeConfig.model_validate reads back."""
        return {key: value for name in SECTIONS for key, value in getattr(self, name).model_dump().items()}

    @property
    def given(self) -> frozenset[str]:
        """The settings given (or following from given ones: `_defaults_that_follow`), by flat name."""
        return frozenset(key for name in SECTIONS for key in getattr(self, name).model_fields_set)

    def replaced(self, **changes: Any) -> NodeConfig:
        """A copy with these settings (by flat name) replaced, as pydantic's model_copy: unchecked, the
        caller's values taken as they are, and counted as given. A name no section has is a KeyError."""
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key not in SECTION_OF:
                raise KeyError(f"no config key '{key}'")
            by_section.setdefault(SECTION_OF[key], {})[key] = value
        return self.model_copy(update={name: getattr(self, name).model_copy(update=values)
                                       for name, values in by_section.items()})

    @property
    def checkpoint_path(self) -> Path | None:
        persistence = self.persistence
        return Path(persistence.checkpoint_dir) / self.swarm.run_id if persistence.checkpoint_dir else None

    def round_inner_steps(self, round_: int) -> int:
        """Inner steps of round `round_`: H, or with P fragments H cut into P near-equal shares in a
        cycle, so that any P consecutive rounds (one exchange of each fragment) run exactly H steps
        (docs/architecture.md §15)."""
        k = round_ % self.outer.fragments
        steps, fragments = self.inner.inner_steps, self.outer.fragments
        return steps * (k + 1) // fragments - steps * k // fragments

    @property
    def round_budget(self) -> float | None:
        """Seconds of one round under --round-seconds: T, or with P fragments T/P, so that P consecutive
        rounds (one exchange of each fragment) last T, as P rounds run H steps (docs/architecture.md §13,
        §15); None without a time budget."""
        return None if self.inner.round_seconds is None else self.inner.round_seconds / self.outer.fragments

    def inner_steps_before(self, round_: int) -> int:
        """Inner steps the rounds before `round_` run together (the learning-rate schedule's position)."""
        cycles, k = divmod(round_, self.outer.fragments)
        return cycles * self.inner.inner_steps + self.inner.inner_steps * k // self.outer.fragments

    def fingerprint_fields(self) -> dict[str, Any]:
        """What peers must share to average together: the protocol, the model's shape and the outer
        algorithm."""
        return {
            "protocol": PROTOCOL,
            **model_shape(self.inputs.model).fingerprint_fields(),  # the preset's shape, or every entry of an HF config
            **({"init": self.inputs.init} if self.inputs.init != "random" else {}),
            **DATA_IDENTITY.get()(self),  # the tokenizer's and the eval split's digests, when given
            "algorithm": self.noloco.algorithm, "sync": self.outer.sync, **self._outer_fingerprint(),
            **self.codec.codec_fingerprint(),
            "aggregator": self.averaging.aggregator, "max_tokens_per_round": self.averaging.max_tokens_per_round,
            # every member must weight alike, or φ splits (docs/architecture.md §13); left out for
            # tokens, the default before equal, so that a run of those nodes keeps its fingerprint
            **({"weighting": self.averaging.weighting} if self.averaging.weighting != "tokens" else {}),
            # every member must hold rounds alike, or a pair would split φ (docs/architecture.md §9)
            **({"min_group_size": self.averaging.min_group_size} if self.averaging.min_group_size != 2 else {}),
            # every member must end its rounds on the same deadlines (docs/architecture.md §13)
            **({"round_seconds": self.inner.round_seconds} if self.inner.round_seconds is not None else {}),
            # every member must run the same H, so that every Δ covers the same point of the schedule (§13)
            **({"speed_spent": self.inner.speed_spent, "inner_steps": self.inner.inner_steps}
               if self.inner.speed_spent != "steps" else {}),
            # which fragment a round exchanges, and how long its payload is (docs/architecture.md §15)
            **({"fragments": self.outer.fragments} if self.outer.fragments != 1 else {}),
            **({"run_owner": self.permission.run_owner} if self.permission.run_owner else {}),
            # with run_owner, codec, algorithm and aggregator this fixes which groups use butterfly
            **({"exchange": self.averaging.exchange} if self.averaging.exchange != "auto" else {}),
        }

    def _outer_fingerprint(self) -> dict[str, Any]:
        if self.noloco.algorithm == "noloco":
            # every node draws the round's groups itself: with another size it would draw others
            return {"group_size": self.noloco.group_size, "noloco_alpha": self.noloco.noloco_alpha,
                    "noloco_beta": self.noloco.noloco_beta, "noloco_gamma": self.noloco.consensus_weight}
        return {"outer_lr": self.outer.outer_lr, "outer_momentum": self.outer.outer_momentum,
                **({"eager_proxy": self.outer.eager_proxy} if self.outer.sync == "eager" else {})}

    def fingerprint(self) -> str:
        return fingerprint_of(self.fingerprint_fields())

    def checkpoint_fingerprint(self) -> str:
        """What a checkpoint must match to be resumed: the fingerprint less the protocol version,
        which changes how nodes talk, not the state they keep (an upgrade resumes its checkpoints)."""
        fields = self.fingerprint_fields()
        del fields["protocol"]
        return fingerprint_of(fields)


def _flattened(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """`data`'s settings by flat key, those of a section's table or model (only the keys it was given)
    included; and, by section, the keys of its table that it has no field for (refused in place)."""
    flat: dict[str, Any] = {}
    stray: dict[str, dict[str, Any]] = {}

    def add(field: str, value: Any) -> None:
        if field in flat:
            raise ValueError(f"config key '{field}' is given twice (flat and in its section's table)")
        flat[field] = value

    for key, value in data.items():
        if key not in SECTIONS or not isinstance(value, dict | SECTIONS[key]):
            add(key, value)  # a flat key, an unknown one or a section of the wrong type: pydantic judges
            continue
        given = value if isinstance(value, dict) else {field: getattr(value, field) for field in value.model_fields_set}
        for field, item in given.items():
            if SECTION_OF.get(field) == key:
                add(field, item)
            else:
                stray.setdefault(key, {})[field] = item
    return flat, stray


def _defaults_that_follow(data: dict[str, Any]) -> dict[str, Any]:
    """Unset sync is blocking. The step follows the mode: a DiLoCo run with an error-feedback codec
    takes FEEDBACK_OUTER for whichever of its settings are unset; a blocking DiLoCo run without one
    takes BLOCKING_STEP when neither outer lr nor momentum is given (its inner lr only where unset,
    so that the inner lr stays a node's own, outside the fingerprint; one outer setting given keeps
    DiLoCo's published rest of the step, since the step was measured as a whole); the rest keep
    INNER_LR and OUTER_LR, and unset momentum follows sync (a step that lands a round late already
    acts as momentum). Unset local_ranks follows the number of --devices. On the flat keys, before
    they are distributed into their sections (NodeConfig._by_section)."""
    if data.get("sync") is None:
        data = {**data, "sync": "blocking"}
    if data.get("local_ranks") is None and data.get("devices"):
        data = {**data, "local_ranks": len(str(data["devices"]).split(","))}
    diloco = data.get("algorithm", "diloco") == "diloco"
    untouched = data.get("outer_lr") is None and data.get("outer_momentum") is None
    step = FEEDBACK_OUTER if keeps_residual(data.get("compression")) and diloco else \
        BLOCKING_STEP if diloco and data["sync"] == "blocking" and untouched else {}
    step = {"inner_lr": INNER_LR, "outer_lr": OUTER_LR, **step}
    data = {**data, **{key: value for key, value in step.items() if data.get(key) is None}}
    if data.get("outer_momentum") is None:
        # an unknown sync keeps DiLoCo's; the sync field's own check then names the mistake
        data = {**data, "outer_momentum": SYNC_MOMENTUM.get(data["sync"], DILOCO_MOMENTUM)}
    return data


# Fields whose values a registry lists: --help names the known ones after the description.
CHOICES: dict[str, Registry[Any]] = {"model": MODEL_PRESETS, "compression": CODECS}


def _feedback_codecs_named(text: str) -> str:
    return text.replace(FEEDBACK_CODECS, " or ".join(c for c in CODECS.names() if CODECS[c].feedback))


def describe(name: str) -> str:
    """The help text of field `name`: its description, with the values it may take where a registry lists them,
    after the codecs it tunes where it is a codec's parameter, and with the error-feedback codecs named."""
    text = _feedback_codecs_named(str(FIELDS[name].description))
    if tuned := [codec for codec in CODECS.names() if name in CODECS[codec].knobs]:
        text = f"{'/'.join(tuned)}: {text}"
    known = CHOICES.get(name)
    return f"{text}: {', '.join(known.names())}" if known else text


def unset_default(name: str) -> str | None:
    """What field `name` means when left unset, in words (its `_unset` text, error-feedback codecs
    named); None where its Field default says it."""
    extra = FIELDS[name].json_schema_extra
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
            if SECTION_OF.get(field) != name:
                home = SECTION_OF.get(field)
                raise ConfigError(f"config key '{field}' in [{name}] of {source}: " +
                                  (f"it belongs in [{home}]" if home else "no such key"))
            add(field, inner_value, f"in [{name}]")
    return flat


def as_toml(cfg: NodeConfig) -> str:
    """`cfg` as a config file, a table per section (SECTIONS): what was given (or follows from what was:
    `_defaults_that_follow`) as keys, the defaults as comments, unset keys left out. Read back
    (read_toml), it is the same config: a default left a comment stays one that follows the others."""
    given, flat = cfg.given, cfg.flat()
    lines: list[str] = []
    for name, section in SECTIONS.items():
        lines.append(f"[{name}]")
        lines += [f"{'' if key in given else '# '}{key} = {json.dumps(flat[key])}"
                  for key in section.model_fields if flat[key] is not None]
        lines.append("")
    return "\n".join(lines)


def build_config(values: dict[str, Any], source: str = "options") -> NodeConfig:
    """Validate merged values, turning pydantic's report into one line naming the key."""
    try:
        return NodeConfig(**values)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = error["loc"][1:] if len(error["loc"]) > 1 and error["loc"][0] in SECTIONS else error["loc"]
        key = ".".join(str(part) for part in loc) or "config"  # a setting's flat name, not its section's
        # a section's name given a value (not its table) is no setting either: flat keys are the interface
        if error["type"] == "extra_forbidden" or (error["type"] == "model_type" and len(error["loc"]) == 1):
            raise ConfigError(f"unknown config key '{key}' in {source}") from None
        message = error["msg"].removeprefix("Value error, ")
        if not loc:  # a check across several keys: the message names them
            raise ConfigError(f"invalid configuration: {message}") from None
        raise ConfigError(f"invalid value for '{key}': {message}") from None


def load_config(file: str | None, overrides: dict[str, Any]) -> NodeConfig:
    """File values first, then overrides (env and flags, already resolved by the CLI)."""
    values = read_toml(file) if file else {}
    source = f"config file '{file}'" if file else "options"
    values.update(overrides)
    return build_config(values, source)


