"""A slower machine, emulated for benchmarks (issue "every volunteer counts", must-hold 1): every inner
step of a node takes a fixed wall time, `HARNESS_STEP_SECONDS`, the step itself plus an idle wait for
the rest. A node at 1/k of the fastest node's speed gets k times its step time.

Why a fixed pace: a share of the cores is not a speed. Pausing a process for part of each period
(the CPU-time throttle this replaces) still left each node's speed to how the kernel shared two cores
among four nodes — two "1x" nodes trained 727,040 and 192,512 tokens in one run. A paced step does
not depend on that as long as every step fits its pace, which is checked: the node reports at exit how
many steps overran (`harness pace: steps=N overran=M ...` on stderr) and the benchmark measures each
node's steps per second from its round records.

The node knows nothing of this: no flag or variable of the product slows it down. `paced_environment`
puts `pace_boot/` on the node's PYTHONPATH, whose `sitecustomize` (run by Python at start-up) wraps
`InnerTrainer.train_step` when the variable is set — in the node's process and in its local ranks'.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_node.commands.launch import clean_environment

VARIABLE = "HARNESS_STEP_SECONDS"
BOOT = Path(__file__).resolve().parent / "pace_boot"
ROOT = Path(__file__).resolve().parent.parent  # so that the boot's `import harness` finds this package
REPORT_RE = re.compile(r"harness pace: steps=(\d+) overran=(\d+) step_seconds=([0-9.]+) busy_seconds=([0-9.]+)")


@dataclass
class Pace:
    """Pads each call of a step to `seconds` of wall time; counts the calls that took longer."""

    seconds: float
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    steps: int = 0
    overran: int = 0
    busy: float = field(default=0.0)  # seconds spent in the steps themselves

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"{VARIABLE} must be a positive number of seconds, not {self.seconds}")

    def wrap(self, step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(step)
        def paced(*args: Any, **kwargs: Any) -> Any:
            started = self.clock()
            try:
                return step(*args, **kwargs)
            finally:
                took = self.clock() - started
                self.steps += 1
                self.busy += took
                if took > self.seconds:
                    self.overran += 1
                else:
                    self.sleep(self.seconds - took)
        return paced

    def report(self) -> str:
        return (f"harness pace: steps={self.steps} overran={self.overran} step_seconds={self.seconds:g} "
                f"busy_seconds={self.busy:.3f}")


def install_from_environment(environ: Mapping[str, str] = os.environ) -> Pace | None:
    """Wrap the inner step when `VARIABLE` is set (pace_boot/sitecustomize.py calls this); the report
    goes to stderr at exit."""
    value = environ.get(VARIABLE)
    if not value:
        return None
    from diloco_node.train.inner import InnerTrainer

    pace = Pace(float(value))
    InnerTrainer.train_step = pace.wrap(InnerTrainer.train_step)  # type: ignore[method-assign]
    atexit.register(lambda: print(pace.report(), file=sys.stderr, flush=True))
    return pace


def paced_environment(step_seconds: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A node's environment whose inner steps take `step_seconds` each: `base` (default: NodeProcess's
    own, launch.clean_environment) with the boot directory and the pace."""
    env = dict(base) if base is not None else clean_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(BOOT), str(ROOT), env.get("PYTHONPATH"))))
    env[VARIABLE] = f"{step_seconds:.6f}"
    return env


def reports(lines: Iterable[str]) -> list[dict[str, float]]:
    """The pace reports in a node's stderr lines (one per process that trained: the node, its ranks)."""
    found = []
    for line in lines:
        match = REPORT_RE.search(line)
        if match:
            steps, overran, seconds, busy = match.groups()
            found.append({"steps": int(steps), "overran": int(overran), "step_seconds": float(seconds),
                          "busy_seconds": float(busy)})
    return found


def steps_per_second(rounds: Iterable[Mapping[str, Any]]) -> float | None:
    """A node's measured speed: inner steps over compute seconds (a round's seconds times its
    utilization) in the rounds after its first (which includes start-up); None without such rounds."""
    steady = list(rounds)[1:]
    compute = sum(r["seconds"] * r["utilization"] for r in steady if r.get("utilization") is not None)
    steps = sum(r["inner_steps"] or 0 for r in steady)
    return steps / compute if compute > 0 and steps else None
