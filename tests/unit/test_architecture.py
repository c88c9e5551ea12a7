"""The import rules of docs/architecture.md §8, and the doc's cites, checked on the source itself.

Every .py under diloco_node/ is parsed with `ast` (no import runs): `import x`, `from x import y`
and relative imports, at any depth (inside functions, under `if TYPE_CHECKING:`), each mapped to
the top-level area it reaches (diloco_node.outer.aggregate → outer, diloco_node.config → config).
A rule names the areas it applies to (or, for the rooms' rule, the areas it spares: every other
area, one added later included) and the areas they must not reach (and the third-party packages,
when it names any: trust/ reaches neither hivemind nor torch); a failure names the file,
the line and the import. The checker is a plain function, tested on a small tree of its own, so a
rule that passes here passes because the code keeps it, not because the checker sees nothing.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "diloco_node"
DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Import:
    file: Path  # relative to the tree's root
    line: int
    source: str  # the importing module, dotted
    target: str  # the module imported, dotted (resolved when relative)
    text: str  # the statement as written

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


@dataclass(frozen=True)
class Rule:
    name: str
    sources: frozenset[str]  # the areas the rule applies to
    forbidden: frozenset[str] = frozenset()  # areas they must not reach
    allowed: frozenset[str] | None = None  # when set: the only areas they may reach (besides their own)
    external: frozenset[str] = frozenset()  # third-party packages they must not import
    others: bool = False  # when set: the rule applies to every area but `sources`

    def applies_to(self, source: str | None) -> bool:
        return source is not None and (source in self.sources) != self.others

    def breaks(self, edge: Import) -> bool:
        source, target = area(edge.source), area(edge.target)
        if not self.applies_to(source):
            return False
        if target is None:
            return edge.target.split(".")[0] in self.external
        if target == source or (not self.others and target in self.sources):
            return False
        if self.allowed is not None:
            return target not in self.allowed
        return target in self.forbidden


def rule(name: str, sources: Iterable[str], forbidden: Iterable[str] = (),
         allowed: Iterable[str] | None = None, external: Iterable[str] = (), others: bool = False) -> Rule:
    return Rule(name, frozenset(sources), frozenset(forbidden), None if allowed is None else frozenset(allowed),
                frozenset(external), others)


# docs/architecture.md §8. config (and registry.py, which packages fill and config reads) is a leaf:
# it may reach only the other leaves, which import nothing of the package but errors.py. trust/
# (whom to believe) reads the round's types, the config, the leaves and lru.py, and no transport,
# math or wire: neither swarm/, outer/ nor codec/, neither hivemind nor torch. daemon/ (the node's
# process) composes every room and commands/ (the command line's commands) may use it; no room
# below them imports either, and the node's process imports no command. The root's shared modules
# (lru.py, procs.py, forks.py) stay below every room that imports them. The run manifest
# (train/manifest.py: what a run trains, which the CLI, the composition root and swarm/manifests.py
# share) is train/'s, and reads the config, the leaves and trust/ (the owner's signature).
LEAVES = ("errors", "fingerprint", "rates", "registry")
TRUST_READS = ("round", "config", "lru", *LEAVES)
ENTRY = ("cli", "__main__")  # the entry points: they may import every room
RULES = (
    rule("outer ↛ swarm", ["outer"], ["swarm"]),
    rule("swarm ↛ codec, outer", ["swarm"], ["codec", "outer"]),
    rule("telemetry ↛ swarm, outer", ["telemetry"], ["swarm", "outer"]),
    rule("train ↛ swarm", ["train"], ["swarm"]),
    rule("codec ↛ swarm", ["codec"], ["swarm"]),
    rule("config ↛ domain", ["config", "registry"], allowed=LEAVES),
    rule("leaves ↛ domain", ["errors", "fingerprint", "rates"], allowed=["errors"]),
    rule("round ↛ domain", ["round"], allowed=["errors"]),
    rule("trust ↛ swarm, outer, codec, hivemind, torch", ["trust"], allowed=TRUST_READS,
         external=["hivemind", "torch"]),
    rule("rooms ↛ daemon, commands", [*ENTRY, "daemon", "commands"], ["daemon", "commands"], others=True),
    rule("daemon ↛ commands", ["daemon"], ["commands"]),
    rule("shared leaves ↛ domain", ["lru", "procs", "forks"], allowed=["errors"]),
)


def area(module: str) -> str | None:
    """The top-level area of a module of the package (None outside it): its first name below the package."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 else PACKAGE


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from … import` names (relative ones resolved against `module`)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join([*base, node.module] if node.module else base)


def imports_of(path: Path, root: Path) -> Iterator[Import]:
    """Every import in the file at `path`, at any depth, relative ones resolved."""
    source_text = path.read_text()
    module = module_name(path, root)
    is_package = path.name == "__init__.py"
    relative = path.relative_to(root)
    for node in ast.walk(ast.parse(source_text, str(path))):
        text = ast.get_source_segment(source_text, node) if isinstance(node, ast.Import | ast.ImportFrom) else None
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(relative, node.lineno, module, alias.name, text or "")
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            for alias in node.names:
                # `from pkg import sub` reaches pkg.sub: the area is decided by the longer name
                # whenever the base is the package itself (`from diloco_node import manifest`)
                target = f"{base}.{alias.name}" if base == PACKAGE and alias.name != "*" else base
                yield Import(relative, node.lineno, module, target, text or "")


def all_imports(root: Path, package: str = PACKAGE) -> list[Import]:
    """Every import under `root`/`package`, once per (file, line, module reached)."""
    edges = [edge for path in sorted((root / package).rglob("*.py")) for edge in imports_of(path, root)]
    return list({(edge.file, edge.line, edge.target): edge for edge in edges}.values())


def violations(root: Path, checked: Rule) -> list[Import]:
    edges = package_imports() if root == ROOT else all_imports(root)
    return [edge for edge in edges if checked.breaks(edge)]


@functools.cache
def package_imports() -> list[Import]:
    """The package's own imports, parsed once for all the rules: a parse of every file took ~0.6 s
    on a quiet machine and ~5 s on a loaded CI one, once per rule."""
    return all_imports(ROOT)


# --- the rules, on the package ----------------------------------------------------------------

@pytest.mark.parametrize("checked", RULES, ids=[r.name for r in RULES])
def test_import_rule(checked: Rule) -> None:
    broken = violations(ROOT, checked)
    assert not broken, f"{checked.name} (docs/architecture.md §8) is broken by:\n" + \
        "\n".join(f"  {edge}" for edge in broken)


def test_the_checker_sees_the_package() -> None:
    """A checker that parsed nothing would pass every rule: the package's known edges are seen."""
    edges = package_imports()
    assert len({edge.file for edge in edges}) > 40
    assert any(area(e.source) not in ("outer", None) and area(e.target) == "outer" for e in edges)
    assert any(area(e.source) == "swarm" and e.target.split(".")[0] == "hivemind" for e in edges)
    assert any(area(e.source) == "outer" and e.target == "torch" for e in edges)
    assert any(area(e.source) == "cli" and area(e.target) == "daemon" for e in edges)
    assert any(area(e.source) == "commands" and area(e.target) == "daemon" for e in edges)


# --- the checker itself, on a tree made for it ----------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {f"{PACKAGE}/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


# rule → (file, text, the line of its bad import)
BAD_IMPORTS = {
    "outer ↛ swarm": ("outer/update.py", "from diloco_node.swarm.member import SwarmMember\n", 1),
    "swarm ↛ codec, outer": ("swarm/member.py", "import torch\nfrom ..codec import max_payload_bytes\n", 2),
    "telemetry ↛ swarm, outer": ("telemetry/rounds.py", "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                 "    from diloco_node.outer.update import RoundReport\n", 4),
    "train ↛ swarm": ("train/shares.py", "def f():\n    import diloco_node.swarm.records as r\n    return r\n", 2),
    "codec ↛ swarm": ("codec/wire.py", "from ..swarm import streams\n", 1),
    "config ↛ domain": ("config.py", "from diloco_node.errors import NodeError\n"
                                     "from diloco_node.train import manifest\n", 2),
    "leaves ↛ domain": ("fingerprint.py", "import json\nfrom .codec import CODECS\n", 2),
    "round ↛ domain": ("round.py", "import torch\nfrom diloco_node.swarm.dht import SwarmSettings\n", 2),
    "trust ↛ swarm, outer, codec, hivemind, torch": ("trust/proofs.py", "from diloco_node.round import Outcome\n"
                                                    "from ..swarm.records import fetch\n", 2),
    "rooms ↛ daemon, commands": ("telemetry/server.py", "from diloco_node.forks import close_in_helpers\n"
                                 "from diloco_node.daemon.lifecycle import StopSignals\n", 2),
    "daemon ↛ commands": ("daemon/node.py", "from diloco_node.daemon.checkpoint import export_info\n"
                          "from diloco_node.commands.export import export\n", 2),
    "shared leaves ↛ domain": ("forks.py", "import os\nfrom diloco_node.telemetry.server import StatusServer\n", 2),
}


@pytest.mark.parametrize("checked", RULES, ids=[r.name for r in RULES])
def test_each_rule_fails_on_a_bad_import(tmp_path: Path, checked: Rule) -> None:
    """The rule's own check, on a tree holding one import it forbids: that import is named."""
    name, text, line = BAD_IMPORTS[checked.name]
    files = {f"{PACKAGE}/{name}": text}
    if Path(name).parent != Path("."):
        files[f"{PACKAGE}/{Path(name).parent}/__init__.py"] = ""
    broken = violations(_tree(tmp_path, files), checked)
    assert [(str(edge.file), edge.line) for edge in broken] == [(f"{PACKAGE}/{name}", line)]
    with pytest.raises(AssertionError, match=re.escape(f"{PACKAGE}/{name}:{line}:")):
        assert not broken, "\n".join(map(str, broken))


def test_checker_resolves_relative_nested_and_package_imports(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        f"{PACKAGE}/outer/__init__.py": "from . import aggregate\n",
        f"{PACKAGE}/outer/aggregate.py": "import torch\n",
        f"{PACKAGE}/outer/deep/__init__.py": "",
        f"{PACKAGE}/outer/deep/x.py": "class A:\n    def f(self):\n        from ...swarm.presence import P\n",
        f"{PACKAGE}/swarm/presence.py": "from diloco_node import errors, codec\n",
    })
    edges = {(str(e.file), e.line, e.target) for e in all_imports(root)}
    assert (f"{PACKAGE}/outer/__init__.py", 1, "diloco_node.outer") in edges
    assert (f"{PACKAGE}/outer/deep/x.py", 3, "diloco_node.swarm.presence") in edges
    assert (f"{PACKAGE}/swarm/presence.py", 1, "diloco_node.codec") in edges
    assert [str(e) for e in violations(root, RULES[0])] == [
        f"{PACKAGE}/outer/deep/x.py:3: from ...swarm.presence import P"]
    assert [str(e) for e in violations(root, RULES[1])] == [
        f"{PACKAGE}/swarm/presence.py:1: from diloco_node import errors, codec"]


@pytest.mark.parametrize("package", ["hivemind", "torch"])
def test_the_trust_rule_names_a_third_party_package(tmp_path: Path, package: str) -> None:
    """trust/ reaches no transport or math library, however it is imported."""
    root = _tree(tmp_path, {
        f"{PACKAGE}/trust/__init__.py": "",
        f"{PACKAGE}/trust/seals.py": f"import cryptography\nfrom {package}.utils import x\n\ndef f():\n"
                                     f"    import {package}\n",
    })
    trust_rule = next(r for r in RULES if r.sources == {"trust"})
    assert [edge.line for edge in violations(root, trust_rule)] == [2, 5]


def test_checker_allows_what_rules_allow(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        f"{PACKAGE}/config.py": "from diloco_node.errors import NodeError\nfrom . import registry, fingerprint\n",
        f"{PACKAGE}/outer/blocking.py": "from diloco_node.round import Gathered\nfrom .update import X\n",
        f"{PACKAGE}/swarm/facade.py": "from diloco_node.round import Transport\nimport hivemind\n",
        f"{PACKAGE}/trust/proofs.py": "import cryptography\nfrom diloco_node.round import Outcome\n"
                                      "from diloco_node import config, lru\n",
        f"{PACKAGE}/cli.py": "from diloco_node.daemon.runner import run_node\nfrom diloco_node.commands import demo\n",
        f"{PACKAGE}/commands/export.py": "from diloco_node.daemon.checkpoint import read_checkpoint\n",
        f"{PACKAGE}/daemon/compose.py": "from diloco_node.train import manifest\nfrom diloco_node.swarm import Swarm\n"
                                        "from .lifecycle import StopSignals\n",
        f"{PACKAGE}/swarm/manifests.py": "from diloco_node.train.manifest import Manifest\n",
        f"{PACKAGE}/telemetry/server.py": "from diloco_node.forks import close_in_helpers\n",
        f"{PACKAGE}/train/manifest.py": "from diloco_node.config import NodeConfig\n"
                                        "from diloco_node.train import tokenizer\n"
                                        "from diloco_node.trust import admission\n",
    })
    assert all(not violations(root, checked) for checked in RULES)


def test_the_rooms_rule_covers_an_area_added_later(tmp_path: Path) -> None:
    """The rule names the areas it spares, not those it binds: a new area is bound from the start."""
    root = _tree(tmp_path, {f"{PACKAGE}/newroom/__init__.py": "from diloco_node.commands.launch import NodeProcess\n"})
    rooms_rule = next(r for r in RULES if r.others)
    assert [str(edge) for edge in violations(root, rooms_rule)] == [
        f"{PACKAGE}/newroom/__init__.py:1: from diloco_node.commands.launch import NodeProcess"]


# --- the doc and its cites --------------------------------------------------------------------

CITED_TREES = ("diloco_node", "tests", "benchmarks", "harness", "docs")
CITED_FILES = ("README.md", "pyproject.toml", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".js", ".html", ".css", ".yml", ".yaml", ".sh", ".cfg", ".ini", ".txt"}
# spelled in pieces so that this file does not match them itself
OUTSIDE = re.compile("|".join(["DESIGN" + " §", "DESIGN" + r"\.md", r"\.\./" + r"shared\b", "/work/" + r"shared\b"]))
NUMBER_CITE = re.compile(r"docs/architecture\.md,?\s+(§\s?\d+(?:\s*(?:,|and|or)\s*§\s?\d+)*)")
# by name, in parentheses: (docs/architecture.md, "Errors and exit codes") or (docs/architecture.md, import rules)
NAME_CITE = re.compile(r"\(docs/architecture\.md,\s+\"?([A-Za-z][^\"()§\n]*?)\"?\)")


def text_files() -> Iterator[Path]:
    for tree in CITED_TREES:
        for path in sorted((ROOT / tree).rglob("*")) if (ROOT / tree).is_dir() else []:
            if path.is_file() and path.suffix in TEXT_SUFFIXES and "__pycache__" not in path.parts \
                    and "results" not in path.relative_to(ROOT).parts:
                yield path
    for name in CITED_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name


def headings() -> tuple[set[int], set[str]]:
    """The doc's numbered sections (`## 3. Title`) and every heading's title."""
    numbers, titles = set(), set()
    for line in DOC.read_text().splitlines():
        if match := re.match(r"^#{2,4}\s+(?:(\d+)\.\s+)?(.+?)\s*$", line):
            if match[1] and line.startswith("## "):
                numbers.add(int(match[1]))
            titles.add(match[2])
    return numbers, titles


def test_no_cite_of_a_file_outside_the_repository() -> None:
    """Code cites docs/architecture.md, never the founders' design outside the repository."""
    found = []
    for path in text_files():
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if OUTSIDE.search(line):
                found.append(f"  {path.relative_to(ROOT)}:{number}: {line.strip()[:110]}")
    assert not found, "cites of a document outside the repository (rename to docs/architecture.md §N):\n" + \
        "\n".join(found)


def test_every_cite_names_a_section_of_the_doc() -> None:
    numbers, titles = headings()
    assert set(range(1, 11)) <= numbers, "the doc's numbered sections 1..10"
    wrong = []
    for path in text_files():
        text = path.read_text(errors="replace")
        for match in NUMBER_CITE.finditer(text):
            for cited in map(int, re.findall(r"§\s?(\d+)", match[1])):
                if cited not in numbers:
                    line = text.count("\n", 0, match.start()) + 1
                    wrong.append(f"  {path.relative_to(ROOT)}:{line}: §{cited}")
        for match in NAME_CITE.finditer(text):  # a heading, or a rule of §8's table (kept there below)
            if match[1].lower() not in {name.lower() for name in titles | {r.name for r in RULES}}:
                line = text.count("\n", 0, match.start()) + 1
                wrong.append(f"  {path.relative_to(ROOT)}:{line}: \"{match[1]}\"")
    assert not wrong, "cites of docs/architecture.md sections that do not exist:\n" + "\n".join(wrong)


def test_the_doc_lists_the_rules_this_file_checks() -> None:
    """§8's table and RULES say the same: a rule added to one is added to the other."""
    section = DOC.read_text().split("## 8.", 1)[1].split("\n## ", 1)[0]
    for checked in RULES:
        assert checked.name in section, f"docs/architecture.md §8 lacks the rule '{checked.name}'"
