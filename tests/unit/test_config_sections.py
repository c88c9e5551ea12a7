"""NodeConfig's sections by concern (diloco_node/config/sections.py): every setting still has its one
flat name as a flag, an environment variable and a TOML key, and a file may also group keys under
their section's table; `diloco-node config` prints a file that reads back to the same config."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from diloco_node.cli import main
from diloco_node.config import FIELDS, SECTIONS, ConfigError, NodeConfig, build_config, flat_keys, read_toml
from diloco_node.trust.admission import generate_owner_key

PEER = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWJZCFWqQH4SvZLraL276kcU6ZvaLyacnJUdUc1t4Cx8AZ"
# a tokenizer needs a trained tokenizer.json; its spellings are the same code path as every other
# key's, and test_data_input / test_model_input pass --tokenizer through the real CLI
LEFT_OUT = {"tokenizer"}


def test_the_sections_hold_every_key_once() -> None:
    keys = [key for section in SECTIONS.values() for key in section.model_fields]
    assert list(FIELDS) == keys and len(keys) == len(set(keys))  # --help and the reference follow the sections
    assert not set(SECTIONS) & set(FIELDS)  # a section's table never hides a key
    assert list(NodeConfig.model_fields) == list(SECTIONS)  # NodeConfig holds the sections, in their order


def every_setting(tmp_path: Path) -> dict[str, Any]:
    """A value for every key but LEFT_OUT, none of them empty: each is given in every spelling, and
    the printed config says which keys were given, so a spelling that is gone shows as a default."""
    data = tmp_path / "corpus.txt"
    data.write_text("some text to train on\n" * 50)
    values = {key: field.get_default(call_default_factory=True) for key, field in FIELDS.items()}
    values.update(peer=[PEER], announce=["/ip4/192.0.2.1/tcp/4001"], data=str(data), label="west",
                  round_seconds=5.0, speed_spent="batch", inner_steps=7, noloco_gamma=0.3, seq_len=64,
                  batch_size=4, outer_lr=0.5, outer_momentum=0.4, sync="blocking", compression="int8",
                  run_owner=generate_owner_key(tmp_path / "owner.key"), admission="dn1.a.b",
                  identity=str(tmp_path / "id.key"), upload_limit="5mbit", min_group_size=3, devices="cpu",
                  events=str(tmp_path / "events.jsonl"))  # an empty value would be no variable at all
    assert all(value not in ("", []) for value in values.values())
    for key in LEFT_OUT:
        del values[key]
    return values


def _config(args: list[str], env: dict[str, str] | None = None) -> str:
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DILOCO_")}
    done = CliRunner().invoke(main, ["config", *args], env={**unset, **(env or {})})
    assert done.exit_code == 0, done.output
    return done.stdout


def spellings(values: dict[str, Any], folder: Path) -> tuple[list[str], dict[str, str], list[Path]]:
    """Every spelling of `values` (by flat key): the flags --<key-with-dashes>, the environment variables
    DILOCO_<KEY>, and three TOML files written into `folder`, keyed flat, dashed, and under each key's
    [section] table. A list value is its flag repeated, and its items joined by spaces in its variable."""
    flags: list[str] = []
    env: dict[str, str] = {}
    for key, value in values.items():
        items = value if isinstance(value, list) else [value]
        for item in items:
            flags += ["--" + key.replace("_", "-"), str(item)]
        env[f"DILOCO_{key.upper()}"] = " ".join(str(item) for item in items)
    flat = folder / "flat.toml"
    flat.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    dashed = folder / "dashed.toml"
    dashed.write_text("".join(f"{key.replace('_', '-')} = {json.dumps(value)}\n" for key, value in values.items()))
    tables = folder / "tables.toml"
    tables.write_text("".join(f"[{name}]\n" + "".join(f"{key} = {json.dumps(values[key])}\n"
                                                       for key in section.model_fields if key in values)
                              for name, section in SECTIONS.items()))
    return flags, env, [flat, dashed, tables]


def test_every_flag_environment_variable_and_toml_spelling_gives_the_same_config(tmp_path: Path) -> None:
    flags, env, files = spellings(every_setting(tmp_path), tmp_path)
    by_flags = _config(flags)
    assert _config([], env) == by_flags
    for path in files:
        assert _config(["--config", str(path)]) == by_flags, path.name
    # every key was given: the printed file holds no default left as a comment but the one left out
    commented = [line for line in by_flags.splitlines() if line.startswith("# ") and " = " in line]
    assert [line.split(" = ")[0].removeprefix("# ") for line in commented] == [], commented


def test_config_prints_a_file_that_reads_back_to_the_same_config(tmp_path: Path) -> None:
    printed = _config(["--compression", "topk", "--round-seconds", "8", "--label", "zé \"1\"", "--peer", PEER])
    assert "\n[outer]\n" in printed and "\ncompression = \"topk\"\n" in printed
    assert "\n# inner_steps = 50\n" in printed  # a default stays a comment: with T given, H is not
    path = tmp_path / "printed.toml"
    path.write_text(printed)
    assert _config(["--config", str(path)]) == printed
    cfg = build_config(read_toml(str(path)))
    assert cfg.swarm.label == "zé \"1\"" and cfg.outer.outer_lr == 2.0  # as given, and as it follows the codec


@pytest.mark.parametrize(("data", "line"), [
    ({"outer": {"inner_lr": 0.1}}, "config key 'inner_lr' in [outer] of f: it belongs in [inner]"),
    ({"outer": {"learning_rate": 0.1}}, "config key 'learning_rate' in [outer] of f: no such key"),
    ({"inner_lr": 0.1, "inner": {"inner-lr": 0.2}},
     "config key 'inner_lr' is given twice in f (in [inner] and before)"),
    ({"inner-lr": 0.1, "inner_lr": 0.2}, "config key 'inner_lr' is given twice in f (at the top and before)"),
])
def test_a_key_in_the_wrong_table_or_given_twice_is_one_line(data: dict[str, Any], line: str) -> None:
    with pytest.raises(ConfigError) as refused:
        flat_keys(data, "f")
    assert str(refused.value) == line


def test_a_section_name_given_a_value_is_an_unknown_key() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'outer' in f"):
        build_config(flat_keys({"outer": 0.7}, "f"), "f")
