"""Bad --model input and bad export requests through the real CLI: exit 2, one
`diloco-node: error:` line, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.mark.parametrize(("config", "message"), [
    (None, "model directory 'model' has no config.json"),
    ({"model_type": "no-such-arch", "hidden_size": 8}, "has model_type 'no-such-arch', which transformers"),
])
def test_join_refuses_a_model_it_cannot_build(tmp_path: Path, config: dict[str, object] | None, message: str) -> None:
    (tmp_path / "model").mkdir()
    if config is not None:
        (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    result = cli("join", "--model", "model", "--checkpoint-dir", "ckpt", "--log-level", "ERROR", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-node: error: invalid value for 'model': ")
    assert message in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no checkpoint dir, no identity


def test_export_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    result = cli("export", "--checkpoint-dir", "ckpt", "--run-id", "demo", "out", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("diloco-node: error: no checkpoint of run 'demo' in 'ckpt' (looked for "
                                     "ckpt/demo/node.json)")
    assert list(tmp_path.iterdir()) == []
