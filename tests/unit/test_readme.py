"""README.md stays true to the code: every config key is documented with its flag."""

from __future__ import annotations

from pathlib import Path

from diloco_node.config import NodeConfig

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_config_key_has_a_row_in_the_configuration_table() -> None:
    for key in NodeConfig.model_fields:
        flag = "--" + key.replace("_", "-")
        assert f"| `{key}` | `{flag}` |" in README, f"README's configuration table lacks {key}"
