"""A real Docker engine for the docker suite (tests/docker) and benchmarks/islands.py, and
docker/compose.yaml's islands brought up on it.

`ensure_engine` starts dockerd when it is installed but not running (CI installs it: .ci/run).
`ensure_base_image` makes debian:bookworm-slim with debootstrap when it cannot be pulled (no
Docker Hub here). `Islands` runs compose under a project name of its own and always takes it down
with its volumes.

Build inputs that only this machine needs go into git-ignored folders of docker/: the local CPU
wheel of torch (docker/wheels/; the image would otherwise fetch it from the PyTorch index) and the
CA certificates of a TLS-inspecting proxy (docker/certs/).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import wire

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
BASE_IMAGE = "debian:bookworm-slim"
WHEEL_DIRS = ("/opt/wheels",)  # where this machine keeps the local torch wheel
CA_DIR = "/usr/local/share/ca-certificates"
NODES = {"eu-1": "10.77.1.10", "eu-2": "10.77.1.11", "us-1": "10.77.2.10", "ap-1": "10.77.3.10"}
GATEWAYS = {"eu": "eu-gw", "us": "us-gw", "ap": "ap-gw"}
WAN_ADDRESS = {"eu-gw": "10.77.0.11", "us-gw": "10.77.0.12", "ap-gw": "10.77.0.13"}
RATES_MBIT = {"eu": 50.0, "us": 20.0, "ap": 10.0}  # compose.yaml's defaults
ROUND_LINE = re.compile(r"round=(\d+) .*group_size=(\d+) .* seconds=([\d.]+) .*utilization=([\d.]+)")


@dataclass(frozen=True)
class RoundLine:
    group_size: int
    seconds: float
    utilization: float


class EngineMissing(RuntimeError):
    pass


def run(*args: str, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}:\n"
                           f"{result.stdout[-2000:]}{result.stderr[-3000:]}")
    return result.stdout


def _engine_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def ensure_engine() -> None:
    if not shutil.which("docker"):
        raise EngineMissing("no docker client (apt-get install docker.io)")
    if _engine_answers():
        return
    if not shutil.which("dockerd"):
        raise EngineMissing("no Docker engine (apt-get install docker.io)")
    with open(tempfile.gettempdir() + "/dockerd.log", "ab") as log:  # dockerd keeps its own copy
        subprocess.Popen(["dockerd"], stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _engine_answers():
            return
        time.sleep(1)
    raise EngineMissing("dockerd did not start within 60 s (see /tmp/dockerd.log)")


def compose_command() -> list[str]:
    """`docker compose` (v2) where installed, else Debian's docker-compose 1.29: the file is for both."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise EngineMissing("neither `docker compose` nor docker-compose is installed")


def ensure_base_image() -> None:
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode == 0:
        return
    if subprocess.run(["docker", "pull", BASE_IMAGE], capture_output=True, timeout=300).returncode == 0:
        return
    if not shutil.which("debootstrap"):
        raise EngineMissing(f"cannot pull {BASE_IMAGE} and debootstrap is missing (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory() as rootfs:
        run("debootstrap", "--variant=minbase", "bookworm", rootfs, timeout=900)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, check=True, capture_output=True,
                       timeout=600)
        tar.wait()


def stage_build_inputs() -> None:
    for directory in WHEEL_DIRS:
        for wheel in glob.glob(f"{directory}/torch-*.whl"):
            target = ROOT / "docker" / "wheels" / Path(wheel).name
            if not target.exists():
                shutil.copy(wheel, target)
    for cert in glob.glob(f"{CA_DIR}/*.crt"):
        shutil.copy(cert, ROOT / "docker" / "certs" / Path(cert).name)


def host_veth(container: str, address: str) -> str:
    """The host's end of the veth that carries `address` inside `container`: its counters are the
    container interface's, mirrored (host rx = container tx)."""
    iface = run("docker", "exec", container, "sh", "-c",
                f"ip -o -4 addr show | awk '$4 ~ \"^{address}/\" {{print $2}}'").strip()
    peer_index = run("docker", "exec", container, "cat", f"/sys/class/net/{iface}/iflink").strip()
    for path in Path("/sys/class/net").iterdir():
        if (path / "ifindex").read_text().strip() == peer_index:
            return path.name
    raise RuntimeError(f"no host veth for {container}:{iface}")


def counters(veth: str) -> tuple[int, int]:
    """(bytes the container sent, bytes it received) on that veth (harness/wire.py, mirrored)."""
    host = wire.counters(veth)
    return host.rx, host.tx


@dataclass
class Islands:
    """docker/compose.yaml under project `project`; `env` overrides its settings (SYNC, INNER_STEPS...)."""

    project: str
    env: dict[str, str] = field(default_factory=dict)
    build_seconds: float | None = None

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> str:
        env = {**os.environ, **self.env}
        return run(*compose_command(), "-f", str(COMPOSE_FILE), "-p", self.project, *args, timeout=timeout,
                   check=check, env=env)

    def build(self) -> None:
        started = time.monotonic()
        self.compose("build")
        self.build_seconds = time.monotonic() - started

    def up(self) -> None:
        self.compose("up", "-d")

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout=300, check=False)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).split()
        if not ids:
            raise RuntimeError(f"no container for {service}")
        return ids[0]

    def node_log(self, service: str) -> str:
        result = subprocess.run(["docker", "logs", self.container(service)], capture_output=True, text=True,
                                timeout=60)
        return result.stdout + result.stderr

    def rounds(self, service: str) -> dict[int, RoundLine]:
        """The node's round log lines by round (all of its runs, restarts included)."""
        return {int(m[1]): RoundLine(int(m[2]), float(m[3]), float(m[4]))
                for m in ROUND_LINE.finditer(self.node_log(service))}

    def leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={self.project}"
        return {kind: run("docker", *command, "--filter", label, "-q").split()
                for kind, command in {"containers": ("ps", "-a"), "networks": ("network", "ls"),
                                      "volumes": ("volume", "ls")}.items()}
