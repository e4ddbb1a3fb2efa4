"""The docs stay true: a figure the README states as measured is one that docs/benchmarks.md records (dated, with
its command), and no docstring in hsx/ carries a measurement: docstrings say what, why and how to run, and point to
docs/benchmarks.md for the numbers, so a number is measured once and kept in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
# Units of what a run measures: ratios, shares (MFU, efficiency, padding), rates, sizes written, times.
UNIT = r"×|%|tok/s|TFLOP/s|GB/s|MB/s|MB|GB|min|ms|µs|s"
FIGURE = re.compile(rf"(?<![\w.,/=-])({NUM}(?:\s?[–-]\s?{NUM})*)\s?({UNIT})(?![\w/])")

# Figures in the README that are not measurements: settings and bounds the code defines.
NOT_MEASURED = {
    ("300", "s"), ("900", "s"),  # the tests' deadlines (HSX_TEST_TIMEOUT's defaults)
    ("5", "s"),  # a template render's CPU bound (hsx.render)
    ("1.25", "×"),  # the bar notebooks/train-drafter.ipynb asserts, not a result
}


def prose(text: str) -> str:
    """Markdown without code blocks and inline code: commands and flags are not statements of a result."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def recorded(number: str, unit: str, record: str) -> bool:
    """`number` stated with `unit` in the record (alone or as an end of a range: "13-35 min" holds 13 min), or, for
    a number precise enough not to turn up by chance (a thousands separator or a decimal point), stated there at
    all."""
    if any(number in re.findall(NUM, m.group(1)) for m in FIGURE.finditer(record) if m.group(2) == unit):
        return True
    return bool(re.search(r"[,.]", number)) and bool(
        re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", record))


def readme_figures(readme: str) -> list[tuple[str, str, str]]:
    """(number, unit, the line) for every measured-looking figure of the README's prose, and every figure of its
    Benchmarks table but the shape column (tok/s cells carry no unit: there a number with a separator counts)."""
    found = []
    for line in prose(readme).splitlines():
        for m in FIGURE.finditer(line):
            for number in re.findall(NUM, m.group(1)):
                found.append((number, m.group(2), line))
    table = readme.split("## Benchmarks", 1)[1].split("\n## ", 1)[0]
    for line in table.splitlines():
        cells = line.split("|")[2:]  # [0] is before the first bar, [1] the shape
        if line.startswith("| ") and not line.startswith("| shape"):
            for cell in cells:
                for m in re.finditer(rf"(?<![\w.,-]){NUM}", cell):
                    unit = re.match(rf"\s?({UNIT})(?![\w/])", cell[m.end():])
                    if unit or re.search(r"[,.]", m.group(0)):  # a bare small integer counts things ("of 3")
                        found.append((m.group(0), unit.group(1) if unit else "", line))
    return found


def test_every_figure_the_readme_states_as_measured_is_in_docs_benchmarks():
    readme = (ROOT / "README.md").read_text()
    record = (ROOT / "docs" / "benchmarks.md").read_text()
    figures = readme_figures(readme)
    assert any(unit == "tok/s" for _, unit, _ in figures) or len(figures) > 40  # the scan reads the README
    missing = sorted({f"{number} {unit}: {line.strip()[:120]}" for number, unit, line in figures
                      if (number, unit) not in NOT_MEASURED and not recorded(number, unit, record)})
    assert not missing, "README figures docs/benchmarks.md does not record:\n" + "\n".join(missing)


# A measurement in a docstring: a rate, a time or size measured, a GPU or VM named beside a figure, or a date beside
# one. Not a measurement: layer indices, block shapes (128×128), config defaults ("60 s by default"), bounds.
GPU = r"\b(?:H200|H100|A100|B200|L40S|RTX \w+|GB200|MI300X?|VM|[0-9]+-core (?:VM|box|host))s?\b"
MEASUREMENT = [
    re.compile(rf"(?<![\w.]){NUM}\s?(?:tok/s|TFLOP/s|GB/s|MB/s|µs|ms)(?![\w/])"),
    re.compile(rf"{GPU}[^.;]{{0,80}}?(?<![\w.]){NUM}\s?(?:×|%|s|GiB|GB|MB|min)(?![\w/])"),
    re.compile(rf"(?<![\w.]){NUM}\s?(?:×|%|s|GiB|GB|MB|min)(?![\w/])[^.;]{{0,80}}?{GPU}"),
    re.compile(rf"\bmeasured\b[^.;]{{0,60}}?(?<![\w.]){NUM}\s?(?:×|%)(?![\w/])"),
    re.compile(rf"\b20\d\d-\d\d-\d\d\b[^.;]{{0,80}}?(?<![\w.]){NUM}\s?(?:×|%|s|ms|µs)(?![\w/])"),
]


def docstrings(path: Path) -> list[tuple[str, str]]:
    """(where, text) of the module's docstring and of every class's and function's in it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                found.append((f"{path.relative_to(ROOT)}:{getattr(node, 'name', 'module')}", text))
    return found


def measurements(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [m.group(0) for pattern in MEASUREMENT for m in pattern.finditer(flat)]


def test_no_docstring_in_hsx_carries_a_measurement():
    modules = sorted((ROOT / "hsx").rglob("*.py"))
    assert len(modules) > 30
    found = [f"{where}: {hit}" for path in modules for where, text in docstrings(path) for hit in measurements(text)]
    assert not found, "measurements in docstrings (move them to docs/benchmarks.md, point there):\n" + "\n".join(found)


def test_the_measurement_patterns_tell_measurements_from_settings():
    """The scan flags what a run measured and leaves what the code defines; a README figure counts only where the
    record has it."""
    assert measurements("1,367 µs a Qwen3-30B-A3B layer at 16k tokens, against 1,652")
    assert measurements("measured on an H200, the 27B shape ran at 35.5% MFU")
    assert measurements("a 124 MB file in 0.63 s on a loaded 2-core VM")
    assert measurements("2026-12-02: the 8B FP8 run reached 1.53× bf16")
    for setting in ("one scale per 128×128 block, 1×128 activation blocks", "layers 1, 9, 17, 25, 33",
                    "at most one commit per 60 s by default", "relative error within 1e-2 (bf16), 1e-5 (float32)",
                    "compute capability 9.0 (H100, H200)", "docs/benchmarks.md, 2026-11-30 to 2026-12-01"):
        assert not measurements(setting), setting
    record = "| qwen3-8b | 44,880 | 76.9% | 20.1 s |\nruns 1.36-1.84× better; 4.1× against the first; 13-35 min"
    assert recorded("44,880", "", record) and recorded("76.9", "%", record) and recorded("1.84", "×", record)
    assert recorded("4.1", "×", record) and recorded("13", "min", record) and recorded("35", "min", record)
    assert not recorded("43,277", "", record) and not recorded("20", "s", record) and not recorded("13", "s", record)
    figures = {(n, u) for n, u, _ in readme_figures("at 71–78% of the rate, 8–10× faster, `--unit-tokens 800`\n"
                                                    "## Benchmarks\n| shape | tok/s |\n|---|---|\n| s | 43,277 |\n")}
    assert figures == {("71", "%"), ("78", "%"), ("8", "×"), ("10", "×"), ("43,277", "")}


# Figures in docs pages and recipe comments that are not measurements: settings, bounds and the planner's assumed
# rates that the code defines, arithmetic on them, and a test's own parameters. (file, the phrase that holds it)
NOT_MEASURED_IN_DOCS = {
    ("docs/follow.md", "a watcher that lists the dir every 2 ms"),  # tests/test_follow.py's polling interval
    # the plan's assumed share of the H200's datasheet peak (hsx.cost) and what `hsx plan` derives from it
    ("recipes/dflash-qwen3-8b.yaml", "70% of an H200's 790 TFLOP/s"),
    ("recipes/dflash-qwen3-8b.yaml", "It would write ~13 GB/s (1.7 GB/s per GPU)"),
    ("recipes/dflash-qwen3.6-27b.yaml", "72% of an H200's 790 TFLOP/s"),
    ("recipes/dflash-qwen3.6-27b-fp8.yaml", "55% of an H200's 1419 FP8 TFLOP/s"),
    ("recipes/eagle3-llama3.1-8b-instruct.yaml", "70% of an H200's 790 TFLOP/s"),
    ("recipes/eagle3-qwen3-8b.yaml", "70% of an H200's 790 TFLOP/s"),
    ("recipes/eagle3-qwen3-235b-a22b.yaml", "40% of an H200's 790 TFLOP/s"),
    ("recipes/medusa-llama3.1-8b-instruct.yaml", "70% of an H200's 790 TFLOP/s"),
}


def statements() -> dict[str, str]:
    """The prose of every docs page but the record (docs/benchmarks.md), and every recipe's comments but its first
    line (the command that runs it), each flattened to one line, the allowed phrases taken out."""
    found = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "benchmarks.md":
            found[str(page.relative_to(ROOT))] = prose(page.read_text())
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        comments = [line.split("#", 1)[1] for line in recipe.read_text().splitlines()[1:] if "#" in line]
        found[str(recipe.relative_to(ROOT))] = "\n".join(comments)
    for where in found:
        flat = " ".join(found[where].split())
        for file, phrase in NOT_MEASURED_IN_DOCS:
            if file == where:
                assert phrase in flat, f"{where}: the allowed phrase {phrase!r} is gone: drop it from the list"
                flat = flat.replace(phrase, "")
        found[where] = flat
    return found


# In prose, a result also reads as a verb of running or measuring before a time, ratio or share ("took 5.7 s",
# "ran at 67%", "cover 99.46%", "49 s after the kill"); "5 × 3" is a product, not a ratio.
RESULT = re.compile(rf"\b(?:took|takes|ran|runs|reached|reaches|covers?|came|measured|after the kill)\b[^.;]{{0,60}}?"
                    rf"(?<![\w.]){NUM}\s?(?:×|%|s|ms|min)(?![\w/]|\s?\d)")


def doc_measurements(text: str) -> list[str]:
    return measurements(text) + [m.group(0) for m in RESULT.finditer(text)]


def test_no_docs_page_or_recipe_comment_carries_a_measurement():
    pages = statements()
    assert len(pages) > 12 and {"docs/storage.md", "recipes/demo.yaml"} <= set(pages)
    found = [f"{where}: {hit}" for where, text in pages.items() for hit in doc_measurements(text)]
    assert not found, ("measurements outside docs/benchmarks.md (move them there with their date and commit, "
                       "link to it):\n" + "\n".join(found))


def test_the_prose_patterns_tell_results_from_settings():
    for result in ("the write calls took 5.7 s", "a copy over 2 H200s ran at 67% of one GPU",
                   "256 of 512 tokens cover 99.46% of its tokens", "measured 1.5 s after the kill"):
        assert doc_measurements(result), result
    for setting in ("it takes a node for dead after 5 × 3 seconds", "a render is bounded (5 s of CPU)",
                    "the agent gives the ranks 30 s to end", "reading the ledgers every 0.2 s"):
        assert not doc_measurements(setting), setting


def anchors(markdown: str) -> set[str]:
    """The `#fragment`s a page offers: its headings as GitHub makes them (lower case, punctuation dropped, spaces
    to hyphens, a repeated one numbered) and its explicit `id="..."`s."""
    found, seen = set(re.findall(r'<a id="([^"]+)"', markdown)), {}
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", markdown, flags=re.S), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_and_anchor_in_the_readme_and_docs_resolves():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken, checked = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            checked += 1
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such anchor)")
    assert checked > 15
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_the_anchor_reader_makes_githubs_slugs():
    page = "# A title\n## 2026-12-01: the writer's rate (tmpfs)\n## Notes\n## Notes\n<a id=\"kept\"></a>\n"
    assert anchors(page) == {"a-title", "2026-12-01-the-writers-rate-tmpfs", "notes", "notes-1", "kept"}


def test_the_design_map_names_every_module_once_in_its_import_layer():
    """docs/design.md's "The code, in data-flow order": one row per layer of tests/test_imports.py (the authority),
    each naming exactly that layer's modules, so a module added to hsx/ without its line in the map fails here."""
    from test_imports import LAYERS

    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("## The code, in data-flow order", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    modules = {".".join(("hsx", *p.relative_to(ROOT / "hsx").with_suffix("").parts)).removesuffix(".__init__")
               for p in (ROOT / "hsx").rglob("*.py")}
    assert len(modules) > 40 and {"hsx", "hsx.sink", "hsx.demo.train"} <= modules
    named = [{n for n in (("hsx" if t == "hsx" else f"hsx.{t}") for t in re.findall(r"`([\w.]+)`", row))
              if n in modules} for row in rows]
    assert len(rows) == len(LAYERS), f"the map has {len(rows)} rows, tests/test_imports.py {len(LAYERS)} layers"
    for row, names, layer in zip(rows, named, LAYERS):
        assert names == layer, (f"{row.split('|')[1].strip()}: missing {sorted(layer - names)}, "
                                f"not of this layer {sorted(names - layer)}")
    assert set().union(*named) == modules
