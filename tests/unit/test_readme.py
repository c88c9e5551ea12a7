"""The documentation stays true to the code and to itself: every codec in docs/configuration.md's
table (every config key is in the generated reference: test_config_reference.py), every
/api/status field in its paragraph (docs/operations.md), every docs/ page is linked from README.md,
and no relative link points at a missing file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()
OPERATIONS = (DOCS / "operations.md").read_text()
# a markdown link's target: `](target)` or `](target "title")`
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_codec_has_its_row_in_the_compression_table() -> None:
    """docs/configuration.md describes each codec with its spec's line (codec/codecs.py), at its defaults."""
    from diloco_node.codec import SPECS

    for spec in SPECS.values():
        row = f"| `{spec.name}` | {spec.description.replace('|', chr(92) + '|')} |"
        assert row in CONFIGURATION, f"docs/configuration.md's compression table lacks {row}"


def test_status_fields_are_the_documented_ones() -> None:
    from diloco_node.telemetry.meter import STATUS_FIELDS

    start = OPERATIONS.index("`GET /api/status` → JSON with")
    documented = OPERATIONS[start:OPERATIONS.index("\n\n", start)]
    for field in STATUS_FIELDS:
        assert f"`{field}`" in documented, f"docs/operations.md's /api/status paragraph lacks {field}"


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def relative_links(path: Path) -> list[str]:
    """The links of a markdown file that point into the repository: not a URL, not an anchor alone."""
    return [target for target in LINK.findall(path.read_text())
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")]


def test_readme_links_every_docs_page() -> None:
    assert len(pages()) > 5, "the docs/ pages are found"
    linked = {(ROOT / target.split("#", 1)[0]).resolve() for target in relative_links(ROOT / "README.md")}
    missing = [page.relative_to(ROOT) for page in pages() if page.resolve() not in linked]
    assert not missing, f"README.md links none of: {missing}"


def test_every_relative_link_points_to_a_file() -> None:
    broken = []
    for path in [ROOT / "README.md", *pages()]:
        links = relative_links(path)
        if path.name == "README.md":
            assert any(target.startswith("docs/") for target in links), "README.md's links are found"
        for target in links:
            if not (path.parent / target.split("#", 1)[0]).exists():
                broken.append(f"  {path.relative_to(ROOT)}: {target}")
    assert not broken, "relative links to missing files:\n" + "\n".join(broken)
