"""README.md stays true to the code: every config key is documented with its flag."""

from __future__ import annotations

from pathlib import Path

from diloco_node.config import NodeConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_config_key_has_a_row_in_the_configuration_table() -> None:
    for key in NodeConfig.model_fields:
        flag = "--" + key.replace("_", "-")
        assert f"| `{key}` | `{flag}` |" in README, f"README's configuration table lacks {key}"


def test_status_fields_are_the_documented_ones() -> None:
    from diloco_node.telemetry.meter import STATUS_FIELDS

    start = README.index("`GET /api/status` → JSON with")
    documented = README[start:README.index("\n\n", start)]
    for field in STATUS_FIELDS:
        assert f"`{field}`" in documented, f"README's /api/status paragraph lacks {field}"
