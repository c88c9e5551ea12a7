"""The configuration reference (docs/config-reference.md) is generated from NodeConfig's fields
(diloco_node/commands/config_reference.py): the committed page is what the generator prints, so a
Field description is the one place an option's meaning is written, for the page and `--help` alike."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from diloco_node.cli import main
from diloco_node.commands import config_reference
from diloco_node.config import FIELDS, describe, unset_default

ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_what_the_generator_prints() -> None:
    committed = (ROOT / config_reference.PAGE).read_text()
    assert committed == config_reference.page(), \
        f"{config_reference.PAGE} differs from NodeConfig's fields: regenerate it with `{config_reference.REGENERATE}`"


def test_every_key_has_its_row_with_its_flag_and_environment_variable() -> None:
    page = config_reference.page()
    for key in FIELDS:
        flag = "--" + key.replace("_", "-")
        assert f"| `{key}` | `{flag}`<br>`DILOCO_{key.upper()}` |" in page, key


def test_a_row_says_whose_value_it_is_in_a_run() -> None:
    assert config_reference.whose("sync") == "the run's"  # the fingerprint covers it
    assert config_reference.whose("inner_steps") == "the run's unless given"  # the schedule
    assert config_reference.whose("threads") == "the node's"


def test_a_default_that_follows_other_settings_is_shown_in_words() -> None:
    """outer_momentum's Field default (0.9) is what only NoLoCo runs with: the page and --help say what
    unset means instead."""
    assert config_reference.default_cell("outer_momentum") == \
        "0 blocking DiLoCo (no outer lr given), else 0.9 blocking, 0.6 eager, 0 delayed; 0 with topk or sign"
    assert config_reference.default_cell("run_id") == '`"diloco-default"`'
    assert config_reference.default_cell("listen") == '`["/ip4/0.0.0.0/tcp/0"]`'
    assert unset_default("threads") is None


def test_a_description_is_a_table_cell_with_its_flags_as_code_and_its_pages_as_links() -> None:
    assert config_reference._markdown("DIR/<run_id>/ | *.bin, see --data's docs/models.md") == \
        r"DIR/&lt;run_id&gt;/ \| \*.bin, see `--data`'s [docs/models.md](models.md)"


def test_join_help_shows_the_same_descriptions_and_defaults() -> None:
    """The CLI builds its options from the same fields (cli._option_for): one description, two views."""
    shown = " ".join(CliRunner().invoke(main, ["join", "--help"], terminal_width=10_000).stdout.split())
    for key in ("outer_momentum", "upload_limit", "run_owner"):
        assert describe(key) in shown, key
    assert ("[default: 0 blocking DiLoCo (no outer lr given), else 0.9 blocking, 0.6 eager, 0 delayed; "
            "0 with topk or sign; env DILOCO_OUTER_MOMENTUM]") in shown
