"""The node's process tree, read from /proc: who is below a process, whether one still runs, what
it runs. The launcher checks that a stopped node left no process behind; the swarm's watchdog
watches hivemind's helpers and their p2pd daemons."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (hivemind's helpers, p2pd), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def children(pid: int) -> list[int]:
    """The live processes `pid` started itself."""
    return [child for child in descendants(pid) if parent(child) == pid]


def parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def program(pid: int) -> str:
    """The file name of the program `pid` runs ('' when it is gone)."""
    try:
        return Path(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name
    except OSError:
        return ""
