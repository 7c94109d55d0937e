"""What a user installs says what it is: the wheel's metadata names the license and where the
documentation, the source and the changelog are, the wheel and the sdist carry the LICENSE,
and the changelog speaks of the version being built."""

from __future__ import annotations

import email
import email.message
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from asgi_disconnect import __version__

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist, built by the project's build backend (the wheel's hook that
    compiles the SSE decoder left out: it changes no metadata)."""
    pytest.importorskip("hatchling", reason="the test extra")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "--no-hooks", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def wheel_metadata(dist: Path) -> tuple[email.message.Message, list[str]]:
    (wheel,) = dist.glob("asgi_disconnect-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = (name for name in names if name.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(metadata)), names


def test_the_wheels_metadata_names_the_license(dist: Path) -> None:
    metadata, _ = wheel_metadata(dist)
    assert metadata["Version"] == __version__
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert metadata.get_all("License-File") == ["LICENSE"]


def test_the_wheels_metadata_says_where_the_docs_source_and_changelog_are(dist: Path) -> None:
    metadata, _ = wheel_metadata(dist)
    urls = dict(entry.split(", ", 1) for entry in metadata.get_all("Project-URL") or [])
    assert set(urls) == {"Documentation", "Source", "Changelog"}, urls
    # The docs site's own settings are the same addresses.
    site = (ROOT / "mkdocs.yml").read_text()
    assert f"site_url: {urls['Documentation']}\n" in site
    assert f"repo_url: {urls['Source']}\n" in site
    assert urls["Changelog"].startswith(urls["Source"] + "/")
    assert urls["Changelog"].endswith("/CHANGELOG.md")


def test_the_license_file_is_in_the_wheel_and_the_sdist(dist: Path) -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert "BSD 3-Clause License" in license_text
    _, names = wheel_metadata(dist)
    (in_wheel,) = (name for name in names if name.endswith(".dist-info/licenses/LICENSE"))
    (wheel,) = dist.glob("asgi_disconnect-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(in_wheel).decode() == license_text
    (sdist,) = dist.glob("asgi_disconnect-*.tar.gz")
    with tarfile.open(sdist) as archive:
        top = f"asgi_disconnect-{__version__}"
        assert {f"{top}/LICENSE", f"{top}/CHANGELOG.md"} <= set(archive.getnames())


def test_the_version_is_said_once() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == __version__


def test_the_changelog_speaks_of_the_current_version() -> None:
    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert __version__ in headings, headings
    # What is not released yet comes first; then the versions, newest first.
    versions = [heading for heading in headings if heading != "Unreleased"]
    assert headings[: len(headings) - len(versions)] in ([], ["Unreleased"]), headings
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", version) for version in versions), versions
    numbers = [tuple(map(int, version.split("."))) for version in versions]
    assert numbers == sorted(numbers, reverse=True), versions


@pytest.mark.parametrize("document", ["README.md", "docs/index.md"])
def test_the_wheel_the_install_instructions_name_is_the_one_built(
    dist: Path, document: str
) -> None:
    """The package is not on the index: the docs install the wheel built in a clone, by a
    pattern that must match the file the build makes."""
    patterns = re.findall(r"pip install dist/(\S+\.whl)", (ROOT / document).read_text())
    assert patterns, f"{document} does not say how to install a built wheel"
    for pattern in patterns:
        assert len(list(dist.glob(pattern))) == 1, (pattern, sorted(dist.iterdir()))
