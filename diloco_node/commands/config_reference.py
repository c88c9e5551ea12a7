"""The configuration reference, docs/config-reference.md, generated from NodeConfig's fields.

The Field descriptions (config/sections.py) are the one source of what an option means: `--help` shows
them (cli.py) and this page is printed from them, never edited by hand. A row per key: its flag
and environment variable, its default (config.unset_default where the Field's own would not say
what a node runs with), whose value it is in a run (train/manifest.py's lists: what `take` holds a
joiner to) and its description as `--help` gives it (config.describe). After changing a Field:

    python -m diloco_node.commands.config_reference > docs/config-reference.md

tests/unit/test_config_reference.py fails while the committed page differs from what this prints.
"""

from __future__ import annotations

import json
import re

from diloco_node.config import FIELDS, SECTIONS, describe, unset_default
from diloco_node.train.manifest import RUN_LEVEL, SCHEDULE

REGENERATE = "python -m diloco_node.commands.config_reference > docs/config-reference.md"
PAGE = "docs/config-reference.md"

HEAD = f"""# Configuration reference

<!-- Generated from NodeConfig's fields (diloco_node/config/sections.py): edit their descriptions, not this
page, then regenerate it: {REGENERATE} -->

Every option of `diloco-node join`, as a key of a TOML file given with `--config`, a flag and an
environment variable; `diloco-node join --help` shows the same descriptions. A flag beats the
environment, which beats the file, which beats the default. **In a run** says whose value it is
when a node joins with `--peer` ([Running](running.md#joining-with-one-address)): *the run's* (the
fingerprint covers it: a joiner takes the run's, and one given otherwise ends it with one line,
exit 2), *the run's unless given* (the run's schedule: taken from the run, but yours wins) or
*the node's* (never taken from the run). How the settings work together:
[Configuration](configuration.md).

The keys come in sections by concern; a file may give a key at its top or in its section's table
(`[outer]` holding `outer_lr = 0.7`), and `diloco-node config` prints the effective configuration
that way.
"""

TABLE = """| key | flag, env | default | in a run | meaning |
|---|---|---|---|---|
"""

FLAG = re.compile(r"(?<![\w`-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
DOC = re.compile(r"\bdocs/([a-z-]+\.md)")


def _markdown(text: str) -> str:
    """A description as a table cell: the characters markdown would eat escaped (`<run_id>` is an
    HTML tag to it, `*` emphasis, `|` a new cell), flags as code, docs pages as links (this page
    lies beside them)."""
    text = text.replace("|", r"\|").replace("*", r"\*").replace("<", "&lt;").replace(">", "&gt;")
    text = FLAG.sub(r"`\1`", text)
    return DOC.sub(r"[docs/\1](\1)", text)


def default_cell(name: str) -> str:
    """The default as a TOML file would write it, or in words where it follows other settings."""
    words = unset_default(name)
    if words is not None:
        return _markdown(words)
    value = FIELDS[name].get_default(call_default_factory=True)
    return "unset" if value is None else f"`{json.dumps(value, ensure_ascii=False)}`"


def whose(name: str) -> str:
    if name in RUN_LEVEL:
        return "the run's"
    return "the run's unless given" if name in SCHEDULE else "the node's"


def row(name: str) -> str:
    flag = "--" + name.replace("_", "-")
    return (f"| `{name}` | `{flag}`<br>`DILOCO_{name.upper()}` | {default_cell(name)} | {whose(name)} "
            f"| {_markdown(describe(name))} |")


def section(name: str) -> str:
    """A section's heading (its docstring's first sentence) and its table, in --help's order."""
    model = SECTIONS[name]
    summary = re.split(r"[.:](?:\s|$)", (model.__doc__ or "").strip())[0]
    return f"\n## `[{name}]` {summary}\n\n" + TABLE + "\n".join(row(key) for key in model.model_fields) + "\n"


def page() -> str:
    """The whole page: a section after another, in SECTIONS' order (the order of `--help`)."""
    return HEAD + "".join(section(name) for name in SECTIONS)


if __name__ == "__main__":
    print(page(), end="")
