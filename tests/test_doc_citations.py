"""Every document a source file, test, benchmark or page cites exists: a ``docs/NAME.md`` named in the package,
the tests, the benchmarks, the README or the docs themselves is a file of the checkout (a reader who follows a
docstring's pointer finds the page)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"(?<![\w/.-])docs/([A-Za-z0-9_-]+\.md)")


def cited_documents(files, root: Path = ROOT) -> dict[str, list[str]]:
    """docs/NAME.md -> the files (and lines, relative to ``root``) that cite it."""
    out: dict[str, list[str]] = {}
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for name in CITED.findall(line):
                out.setdefault(f"docs/{name}", []).append(f"{path.relative_to(root)}:{number}")
    return out


def test_every_cited_document_exists():
    files = [*sorted((ROOT / "flatfl").rglob("*.py")),
             *sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name),
             *sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    cited = cited_documents(files)
    assert len(cited) >= 5  # the pattern finds the pages the code does cite
    missing = {doc: where for doc, where in cited.items() if not (ROOT / doc).is_file()}
    assert not missing, "cited documents that do not exist: " + "; ".join(
        f"{doc} (cited in {', '.join(where[:3])})" for doc, where in sorted(missing.items()))


def test_the_check_finds_a_missing_document(tmp_path):
    page = tmp_path / "page.py"
    page.write_text('"""See docs/analysis.md,\nand docs/no-such-page.md; not mydocs/x.md nor ../docs/y.md."""\n')
    assert cited_documents([page], tmp_path) == {"docs/analysis.md": ["page.py:1"], "docs/no-such-page.md": ["page.py:2"]}
