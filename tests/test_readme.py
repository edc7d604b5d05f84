"""The README is short and current, its links and commands work, and benchmark output stays out of
assets/: the details live in docs/, and a GPU speedup that was projected is labelled so."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = {path: path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {ROOT / "README.md": README, **DOCS}
SECTIONS = ["Two commands", "Using the app", "The OpenAI API", "Your own models", "Command lines", "Speed", "How it works",
            "Exactness", "Security", "Layout"]


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_is_short_and_in_order():
    assert len(README.splitlines()) <= 400
    titles = re.findall(r"^## (.+)$", README, re.M)
    assert titles == SECTIONS
    assert "![" in README[:README.index("\n## Two commands")], "a screenshot before the commands"
    assert "make run" in section(README, "Two commands") and "make test" in section(README, "Two commands")


def test_the_readme_is_not_a_diary():
    """How a figure changed over time is in git history: no dated sections, no old-run tables."""
    assert not re.search(r"^#+ .*\b20\d\d-\d\d-\d\d", README, re.M)
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", README)) <= 2


def test_one_speed_table_from_one_run_with_its_command_date_and_cpu():
    speed = section(README, "Speed")
    tables = re.findall(r"(?:^\|.*\|\n)+", speed, re.M)
    assert len(tables) == 1
    rows = tables[0].strip().splitlines()[2:]
    names = " ".join(row.split("|")[1] for row in rows)
    assert "on screen" in names and "headless" in names and "llama.cpp" in names
    assert re.search(r"`python -m bench\.ui[^`]*`", speed)
    assert re.search(r"\b20\d\d-\d\d-\d\d \d\d:\d\d\b", speed), "the run's date and time"
    assert "avx2" in speed.lower() and "/proc/cpuinfo" in speed


def test_the_speed_tables_ratios_follow_from_its_rates():
    rows = [[c.strip().strip("*") for c in row.strip("|").split("|")]
            for row in re.findall(r"^\|.*\|$", section(README, "Speed"), re.M)[2:]]
    reference = next(float(r[1]) for r in rows if r[0].startswith("llama.cpp"))
    for name, rate, ratio in rows:
        assert ratio == f"{float(rate) / reference:.2f}×", name


@pytest.mark.parametrize("path", list(PAGES), ids=lambda p: p.name)
def test_every_local_link_resolves(path):
    text = PAGES[path]
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        assert file.exists(), f"{path.name}: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", file.read_text(encoding="utf-8"), re.M)
            assert anchor in {slug(h) for h in headings}, f"{path.name}: {link}"


def test_every_python_m_command_names_a_module_that_exists():
    """One documented way to run each command: the names in the README, docs/ and the Makefile are
    modules that exist (``engine.generate`` and the other old names are gone)."""
    texts = [*PAGES.values(), (ROOT / "Makefile").read_text()]
    modules = {m for text in texts for m in re.findall(r"python -m (\w+(?:\.\w+)*)", text)} - {"pytest", "pip", "venv"}
    assert {"engine.cli.generate", "bench.decode", "bench.ui"} <= modules
    for module in sorted(modules):
        assert importlib.util.find_spec(module) is not None, module
    assert not [m for m in modules if m.startswith("engine.") and m.count(".") == 1 and m != "engine.cli"]


def test_assets_hold_what_the_app_loads_not_benchmark_output():
    assert not (ROOT / "assets" / "benchmarks").exists()
    for path in (ROOT / "assets").rglob("*"):
        if path.is_file():
            assert path.suffix not in (".log", ".html"), path
            if path.suffix == ".png":
                assert any(f"assets/{path.name}" in text for text in PAGES.values()), f"{path} is shown nowhere"


def gpu_end_to_end_rows() -> list[str]:
    text = DOCS[ROOT / "docs" / "benchmarks.md"]
    part = text[text.index("### NVIDIA H100"):]
    table = part[part.index("| configuration"):]
    rows = []
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break  # the table ends at its first other line
        rows.append(line)
    return rows


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
