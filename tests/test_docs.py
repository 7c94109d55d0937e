"""The documentation site builds without a warning (a broken link or anchor included), its API
reference renders the docstrings as written (no Sphinx role shown as text), README.md's
links into docs/ reach headings that exist, and no page sends its reader back to README.
Every page that says how to install the package says how to do it from a clone (it is not on
the index yet); the SDK examples pass the key that names their caller."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTS = [ROOT / "README.md", *PAGES]
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
        built = site / ("" if page == "index" else page) / "index.html"
        if not built.exists():
            missing.append(f"docs/{page}.md")
        elif anchor and f'id="{anchor}"' not in built.read_text():
            missing.append(f"docs/{page}.md#{anchor}")
    assert not missing, f"README.md links to what the site does not have: {missing}"


def test_no_page_sends_its_reader_to_readme() -> None:
    """The site is the documentation: README's sections are not on it, and they move."""
    found = [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"\bREADME\b", line)
    ]
    assert not found, "docs pages that point at README:\n" + "\n".join(found)


def test_the_docs_say_how_to_build_them() -> None:
    page = (ROOT / "docs" / "development.md").read_text()
    assert "pip install -e '.[docs]'" in page
    assert "mkdocs build --strict" in page
    assert "development.md" in (ROOT / "mkdocs.yml").read_text()


# `pip install asgi-disconnect...` from the index (not `./asgi-disconnect`, a clone's path).
INDEX_INSTALL = re.compile(r"pip install [^`\n]*?(?<![\w./-])['\"]?asgi-disconnect\b")


def test_no_page_installs_from_the_index_as_if_the_package_were_on_it() -> None:
    """The package is not on PyPI yet: its name is installed only from a built wheel
    (``--find-links``) or in a sentence that says it waits for publication."""
    found = []
    for document in DOCUMENTS:
        for paragraph in document.read_text().split("\n\n"):
            for match in INDEX_INSTALL.finditer(paragraph):
                line = paragraph[: match.end()].rsplit("\n", 1)[-1]
                if "--find-links" not in line and "once it is published" not in paragraph.lower():
                    found.append(f"{document.relative_to(ROOT)}: {line.strip()}")
    assert not found, found


@pytest.mark.parametrize("document", ["README.md", "docs/index.md", "docs/quickstart.md"])
def test_the_install_instructions_start_from_a_clone(document: str) -> None:
    text = (ROOT / document).read_text()
    assert "git clone https://github.com/asgi-disconnect/asgi-disconnect" in text
    assert re.search(r"pip install -e \.?/?(asgi-disconnect)?", text), document
    assert "once it is published" in text.lower(), document
    if document != "docs/quickstart.md":  # which links to docs/index.md's
        assert "pip wheel --no-deps -w dist ." in text
        assert "pip install dist/asgi_disconnect-*.whl" in text


# An SDK client made in a code example: OpenAI(...), AsyncAnthropic(...).
SDK_CLIENT = re.compile(r"\b(?:Async)?(?:OpenAI|Anthropic)\((?P<arguments>[^)]*)\)")


def test_the_sdk_examples_pass_the_key_that_names_their_caller() -> None:
    """The SDKs need a key; against the gateway it is also who the caller is (resume and Stop
    take the same one), so every example passes it and says so."""
    calls = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in SDK_CLIENT.finditer(text):
            if "base_url=" not in match["arguments"]:
                continue
            calls.append(document.name)
            assert "api_key=" in match["arguments"], f"{document.name}: {match[0]}"
            nearby = text[max(0, match.start() - 800) : match.end() + 800]
            assert re.search(r"caller|who you are|identity", nearby), document.name
    assert {"README.md", "resume.md"} <= set(calls), calls
