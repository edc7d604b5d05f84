"""The README's figures say what they are: a GPU speedup that was projected is labelled so in its table."""
from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def gpu_end_to_end_rows() -> list[str]:
    section = README[README.index("## GPU and offloading"):]
    section = section[section.index("**Optimizer and end to end**"):]
    table = section[section.index("| configuration"):]
    return [line for line in table.splitlines()[2:] if line.startswith("|")][:12]


def test_gpu_sequoia_figures_are_labelled_as_projections_in_the_table():
    rows = [row for row in gpu_end_to_end_rows() if "Sequoia" in row]
    assert len(rows) >= 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1].endswith("projected"), row
        assert cells[-1].endswith("projected"), row
        assert "**" not in row, f"a projection is shown in bold like a measured result: {row}"


def test_every_gpu_rate_says_whether_it_was_measured_or_projected():
    for row in gpu_end_to_end_rows():
        rate = row.strip("|").split("|")[1].strip().strip("*")
        assert re.fullmatch(r"[\d.,]+ (measured|projected)", rate), row
