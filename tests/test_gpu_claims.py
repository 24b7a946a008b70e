"""A GPU claim is a GPU measurement: every cell of the support tables' GPU columns (the README's "On a GPU" column,
docs/models.md's last column) names recipes of the matrix and says either "not run on a GPU yet" or what a recipe
table recorded in docs/benchmarks.md says of them ("pass (CARD, DATE)"), under a heading with that card and date; and
every recipe of the matrix is in the README's column."""

from __future__ import annotations

import re
from pathlib import Path

from tests.recipes.matrix import MATRIX, RECIPES


ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = "not run on a GPU yet"
ITEM = re.compile(r"^(?P<names>(?:`\w+`(?: \([^)]*\))?(?:, )?)+): (?P<status>.+)$")
RECORDED = re.compile(r"^(?P<status>pass|fail) \((?P<card>[^,]+), (?P<date>\d{4}-\d{2}-\d{2})\)$")


def _column(path: Path, header: str) -> list[tuple[str, str]]:
    """(first cell, cell of the column whose header starts with `header`) for each row of that table."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and f"| {header}" in line)
    cells = [c.strip() for c in lines[start].strip("|").split("|")]
    index = next(i for i, c in enumerate(cells) if c.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((row[0], row[index]))
    return rows


def _recorded() -> dict[tuple[str, str, str], str]:
    """(recipe, card, date) -> status, from the recipe tables in docs/benchmarks.md under headings naming the card
    and the date (`### Recipe matrix: H100, 2026-12-01`)."""
    found: dict[tuple[str, str, str], str] = {}
    card = date = None
    for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines():
        heading = re.match(r"^#+ Recipe matrix: (?P<card>[^,]+), (?P<date>\d{4}-\d{2}-\d{2})", line)
        if heading:
            card, date = heading.group("card"), heading.group("date")
        elif line.startswith("#"):
            card = date = None
        elif card and line.startswith("| ") and line.count("|") >= 4:
            recipe, _group, status = (c.strip() for c in line.strip("|").split("|")[:3])
            found[(recipe, card, date or "")] = status
    return found


def _claims(path: Path, header: str) -> list[tuple[str, list[str], str]]:
    """(row, recipe names, status) of each item of the column; an item is `` `a`, `b`: status ``."""
    claims = []
    for row, cell in _column(path, header):
        if cell.startswith("(nothing on the device)"):
            continue
        for item in cell.split("; "):
            match = ITEM.match(item)
            assert match, f"{path.name}, row {row!r}: cannot read the GPU claim {item!r}"
            claims.append((row, re.findall(r"`(\w+)`", match.group("names")), match.group("status")))
    return claims


def test_every_gpu_claim_is_a_recorded_recipe_run() -> None:
    recorded = _recorded()
    tables = [(ROOT / "README.md", "On a GPU"), (ROOT / "docs" / "models.md", "GPU: 2 steps in the recipe matrix")]
    for path, header in tables:
        claims = _claims(path, header)
        assert claims, f"no GPU column {header!r} in {path.name}"
        for row, names, status in claims:
            unknown = [n for n in names if n not in RECIPES]
            assert not unknown, f"{path.name}, row {row!r}: {unknown} are not recipes of tests/recipes"
            if status == NOT_RUN:
                continue
            match = RECORDED.match(status)
            assert match, f"{path.name}, row {row!r}: {status!r} is neither {NOT_RUN!r} nor 'pass (CARD, DATE)'"
            for name in names:
                got = recorded.get((name, match.group("card"), match.group("date")))
                assert got == match.group("status"), (
                    f"{path.name}, row {row!r}: {name} {status} is not in docs/benchmarks.md's recipe table of "
                    f"{match.group('card')}, {match.group('date')} (recorded: {got})"
                )


def test_the_readme_column_names_every_recipe_of_the_matrix() -> None:
    named = {n for _, names, _ in _claims(ROOT / "README.md", "On a GPU") for n in names}
    assert {r.name for r in MATRIX} - named == set()
