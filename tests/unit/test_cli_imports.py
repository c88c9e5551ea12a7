"""The CLI parses, helps and refuses without importing torch, hivemind, transformers or datasets.

Each `python -m diloco_node` pays for what its import loads, and the tests start hundreds of them:
torch alone cost ~1.5-2.5 s per start on the CI machine's 2 cores. The options' defaults and help
come from torch-free modules (codec/codecs.py, train/presets.py, through registry.py); only a
command that builds something (join once its input is valid, export, demo, ...) imports the rest.
Checked in a fresh interpreter, since this one has long since imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "hivemind", "transformers", "datasets")
TIMEOUT = 60

# Runs each command line through the real click entry point, in order, in one interpreter, and
# prints (args, exit code, the heavy packages loaded so far) per command: whichever command first
# loads one is named.
_PROBE = """
import json, sys
import diloco_node.cli as cli
heavy = {heavy!r}
def loaded():
    return sorted(name for name in heavy if name in sys.modules)
print(json.dumps([["import diloco_node.cli"], 0, loaded()]))
for args in {commands!r}:
    try:
        cli.main(args, prog_name="diloco-node")
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(json.dumps([args, code, loaded()]))
"""


def _probe(commands: list[list[str]]) -> list[tuple[list[str], int, list[str]]]:
    code = _PROBE.format(heavy=HEAVY, commands=commands)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    # a probe's line is a list of lists; `config` prints [section] lines too
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("[[")]
    return [(args, code, loaded) for args, code, loaded in lines]


def test_parsing_helping_and_refusing_load_no_heavy_package() -> None:
    refusals = [
        ["--help"],
        ["join", "--help"],
        ["config", "--help"],
        ["join", "--upload-limit", "-1"],  # a bad value: refused while parsing
        ["join", "--inner-steps", "zero"],
        ["join", "--compression", "zip"],  # a bad registry value: the codec names are torch-free
        ["join", "--model", "tiny", "--batch-size", "-2"],  # a built-in preset is checked without torch
        ["status", "ftp://nowhere"],
    ]
    # last, so that it cannot hide the others: a valid config builds its codec, which loads torch,
    # and the probe must see that (a probe blind to imports would pass everything above)
    builds = ["config", "--compression", "int8"]
    results = _probe([*refusals, builds])
    assert [args for args, _, _ in results] == [["import diloco_node.cli"], *refusals, builds]  # every one ran
    assert [code for _, code, _ in results] == [0, 0, 0, 0, 2, 2, 2, 2, 2, 0]  # help, refusals, the config
    assert all(loaded == [] for _, _, loaded in results[:-1]), results
    assert "torch" in results[-1][2]
