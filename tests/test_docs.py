"""The documentation site builds without a warning (a broken link or anchor included), its API
reference renders the docstrings as written (no Sphinx role shown as text), and README.md's
links into docs/ reach headings that exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What mkdocstrings shows literally when a docstring is written for Sphinx.
ROLE = re.compile(r":(?:class|func|meth|attr|data|exc|mod|obj):`")


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra")
    site = tmp_path_factory.mktemp("docs") / "site"
    done = build(ROOT / "mkdocs.yml", site)
    assert done.returncode == 0, done.stdout + done.stderr
    return site


def test_the_docs_site_builds_strictly(site: Path) -> None:
    assert (site / "reference" / "index.html").exists()
    assert (site / "quickstart" / "index.html").exists()


def test_a_link_to_a_missing_heading_fails_the_strict_build(tmp_path: Path) -> None:
    """mkdocs only notes a link to a missing heading unless told otherwise; this site is."""
    pytest.importorskip("mkdocs", reason="the docs extra")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "performance.md").write_text((ROOT / "docs" / "performance.md").read_text())
    (docs / "index.md").write_text("# Home\n\nSee [telemetry](performance.md#no-such-heading).\n")
    (tmp_path / "mkdocs.yml").write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {docs}\nnav: [index.md, performance.md]\n"
    )
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "#no-such-heading" in done.stdout + done.stderr


def test_the_api_reference_shows_no_sphinx_roles(site: Path) -> None:
    page = (site / "reference" / "index.html").read_text()
    assert "DisconnectMiddleware" in page
    shown = sorted({match.group(0) for match in ROLE.finditer(page)})
    assert not shown, f"the API reference shows {shown} as text"


def test_no_docstring_uses_a_sphinx_role() -> None:
    """The reference renders Markdown: a role would show as text on any page that shows it."""
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "asgi_disconnect").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ROLE.search(line)
    ]
    assert not found, found


def test_readmes_links_into_the_docs_reach_their_headings(site: Path) -> None:
    links = re.findall(r"\]\(docs/([a-z_]+)\.md(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert links, "README.md links to no page of docs/"
    missing = []
    for page, anchor in links:
        built = site / page / "index.html"
        if not built.exists():
            missing.append(f"docs/{page}.md")
        elif anchor and f'id="{anchor}"' not in built.read_text():
            missing.append(f"docs/{page}.md#{anchor}")
    assert not missing, f"README.md links to what the site does not have: {missing}"
