"""Bad --model input and bad export requests through the real CLI: exit 2, one
`diloco-node: error:` line, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diloco_node.cli import main

pytestmark = pytest.mark.integration


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "diloco_node", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120)


@pytest.mark.parametrize(("config", "message"), [
    (None, "model directory 'model' has no config.json"),
    ({"model_type": "no-such-arch", "hidden_size": 8}, "has model_type 'no-such-arch', which transformers"),
])
def test_join_refuses_a_model_it_cannot_build(tmp_path: Path, config: dict[str, object] | None, message: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """--model is checked while the config is built: through the CLI's own `main` in this process, as
    tests/integration/test_bad_input.py's option cases (a subprocess would cost its torch import);
    a model let through ends the case with exit 3 instead of starting a node."""
    (tmp_path / "model").mkdir()
    if config is not None:
        (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("diloco_node.daemon.runner.run_node", lambda _cfg: 3)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(main, ["join", "--model", "model", "--checkpoint-dir", "ckpt", "--log-level", "ERROR"],
                              env={"HF_HUB_OFFLINE": "1"})
    assert done.exception is None or isinstance(done.exception, SystemExit), repr(done.exception)
    result = subprocess.CompletedProcess(["diloco-node", "join"], done.exit_code, done.stdout, done.stderr)
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
