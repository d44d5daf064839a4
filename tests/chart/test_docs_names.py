"""The docs name what the code declares: docs/diagnosis.md's catalogue table the catalogue's entries
(moe_proxy.investigate.catalogue), each once, in its order, with its repro flags; docs/operator.md's
spec.reproduction row the failOn signatures the CRD takes (the detectors'). A name added or
renamed in one place only fails here."""

from __future__ import annotations

from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.metrics.detect import SIGNATURES
from moe_proxy.rl.config import ReproConfig

from .conftest import ROOT


def catalogue_rows() -> dict[str, list[str]]:
    """The rows of the table under `## The catalogue`: name -> its cells."""
    section = (ROOT / "docs" / "diagnosis.md").read_text().split("\n## The catalogue", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `") and cells:
            name = cells[0].strip("`")
            assert name not in rows, f"{name} has two rows"
            rows[name] = cells
    return rows


def test_the_docs_name_every_catalogue_entry_and_no_other():
    assert list(catalogue_rows()) == list(CATALOGUE)


def test_each_row_gives_the_entrys_flags_on_the_default_config():
    config = ReproConfig()
    for name, cells in catalogue_rows().items():
        flags = " ".join(CATALOGUE[name].changes(config))
        assert f"`{flags}`" in cells, (name, flags, cells)


def test_the_operator_docs_name_every_failon_signature():
    doc = (ROOT / "docs" / "operator.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `reproduction` |"))
    listed = row.split("`failOn` (", 1)[1].split(" with ", 1)[0]
    assert [name.strip("`") for name in listed.replace(", or ", ", ").split(", ")] == [*SIGNATURES, "threshold"]
