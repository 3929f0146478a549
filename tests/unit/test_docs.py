"""The project cites its own design documents (docs/), never a file outside the repository: no tracked file
outside docs/ names the external design file, and every docs/<name>.md cited in code, tests, benchmarks or
the README exists, with the section its link anchors to."""

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTERNAL = "DESIGN" + ".md"  # spelled in two pieces so that this file does not cite it
CITED = re.compile(r"docs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?")
LINK = re.compile(r"\]\(([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?\)")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".json", ".yaml", ".yml", ".sh", ".html", ""}


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in out.decode().split("\0") if name]


def _texts(under_docs: bool) -> dict[str, str]:
    """Text of the tracked text files outside docs/ (or only those inside, with under_docs)."""
    out = {}
    for path in _tracked():
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith("docs/") != under_docs or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        try:
            out[rel] = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
    return out


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    anchors = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_no_file_outside_docs_cites_the_external_design_file():
    offenders = [
        f"{rel}:{n}" for rel, text in _texts(False).items() for n, line in enumerate(text.splitlines(), 1)
        if EXTERNAL in line
    ]  # fmt: skip
    assert not offenders, f"cite docs/architecture.md or docs/semantics.md instead of {EXTERNAL}: {offenders}"


def test_every_cited_doc_exists_with_its_anchor():
    missing = []
    for rel, text in _texts(False).items():
        for m in CITED.finditer(text):
            doc = REPO / "docs" / m.group(1)
            if not doc.is_file():
                missing.append(f"{rel} cites docs/{m.group(1)}, which does not exist")
            elif m.group(2) and m.group(2) not in _anchors(doc):
                missing.append(f"{rel} links docs/{m.group(1)}#{m.group(2)}, a section it does not have")
    assert not missing, "\n".join(missing)


def test_links_between_docs_resolve():
    missing = []
    for rel, text in _texts(True).items():
        for m in LINK.finditer(text):
            doc = REPO / "docs" / m.group(1)
            if not doc.is_file():
                missing.append(f"{rel} links {m.group(1)}, which is not in docs/")
            elif m.group(2) and m.group(2) not in _anchors(doc):
                missing.append(f"{rel} links {m.group(1)}#{m.group(2)}, a section it does not have")
    assert not missing, "\n".join(missing)


def test_the_design_docs_are_there():
    for name in ("architecture.md", "semantics.md", "fidelity.md"):
        assert (REPO / "docs" / name).is_file(), name
