"""harness/pace.py: a node's inner steps paced to a fixed wall time, from outside the product."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from harness.pace import VARIABLE, Pace, paced_environment, reports


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_step_is_padded_to_its_pace_and_a_longer_one_counted() -> None:
    clock = Clock()
    pace = Pace(0.3, clock=clock, sleep=clock.sleep)

    def step(took: float) -> str:
        clock.now += took
        return "loss"

    paced = pace.wrap(step)
    assert paced(0.1) == "loss"
    assert clock.now == pytest.approx(0.3)  # 0.1 of work, 0.2 idle
    paced(0.5)
    assert clock.now == pytest.approx(0.8)  # no wait after an overrun
    assert (pace.steps, pace.overran, pace.busy) == (2, 1, pytest.approx(0.6))
    assert reports([pace.report()]) == [{"steps": 2, "overran": 1, "step_seconds": 0.3, "busy_seconds": 0.6}]


def test_a_step_that_raises_is_still_counted_and_paced() -> None:
    clock = Clock()
    pace = Pace(0.2, clock=clock, sleep=clock.sleep)

    def fails() -> None:
        raise RuntimeError("oom")

    with pytest.raises(RuntimeError):
        pace.wrap(fails)()
    assert pace.steps == 1 and clock.now == pytest.approx(0.2)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_pace_must_be_positive(value: float) -> None:
    with pytest.raises(ValueError, match=VARIABLE):
        Pace(value)


TRAIN = """
import torch
from diloco_node.train.inner import InnerConfig, InnerTrainer
model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
trainer = InnerTrainer(model, InnerConfig())
x = torch.randint(0, 16, (2, 4))
for _ in range(3):
    trainer.train_step(x, x)
"""


def test_a_process_started_with_the_paced_environment_paces_the_real_inner_step() -> None:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", TRAIN], env=paced_environment(0.4), capture_output=True,
                          text=True, timeout=120)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    [report] = reports(done.stderr.splitlines())
    assert report["steps"] == 3 and report["step_seconds"] == 0.4
    assert took >= 3 * 0.4
    # and without the pace, nothing of it
    plain = subprocess.run([sys.executable, "-c", TRAIN], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and reports(plain.stderr.splitlines()) == []
