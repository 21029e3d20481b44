"""The README and docs/ keep working: links resolve, the command lines they show parse with
sonata's own parser and configuration, the files and make targets they name exist, and the
README's picture, story and notebook figures are the committed notebooks' outputs. Prose is
not tested."""
import base64
import json
import re
import shlex
from html.parser import HTMLParser
from pathlib import Path

import pytest

from sonata.__main__ import _parser
from sonata.core.config import make_config

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))


def _text(page: Path) -> str:
    return page.read_text()


def _code_lines(page: Path) -> list[str]:
    """Shell lines of the page's fenced code blocks, continuations joined, comments dropped."""
    out, block, lang = [], False, ""
    pending = ""
    for ln in _text(page).splitlines():
        if ln.startswith("```"):
            block, lang = (not block), ln[3:].strip()
            continue
        if not block or lang not in ("", "bash", "sh"):
            continue
        ln = pending + ln.strip()
        if ln.endswith("\\"):
            pending = ln[:-1] + " "
            continue
        pending = ""
        ln = re.sub(r"(^|\s)#.*$", "", ln).strip()
        if ln:
            out.append(ln)
    return out


def test_the_readme_is_short_and_links_every_docs_page():
    readme = _text(REPO / "README.md")
    assert len(readme.splitlines()) <= 220
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(page)):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_command_lines_parse_and_their_overrides_are_valid_settings(page):
    seen = 0
    for ln in _code_lines(page):
        if not re.search(r"-m sonata\b", ln):
            continue
        words = shlex.split(ln)
        argv = [w for w in words[words.index("sonata") + 1:]]
        args, extra = _parser().parse_known_args(argv)
        args.overrides = getattr(args, "overrides", []) + [e for e in extra if "=" in e and not e.startswith("-")]
        assert not [e for e in extra if "=" not in e or e.startswith("-")], ln
        if args.command in ("train", "prepare", "autotune", "bench"):
            make_config(args.overrides)                     # an unknown key or a bad value raises
        seen += 1
    if page.name in ("README.md", "cli.md", "selection.md", "interop.md"):
        assert seen or page.name == "README.md", f"{page.name}: no command line found (the parser moved?)"


def test_named_files_and_make_targets_exist():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for page in PAGES:
        text = _text(page)
        for path in set(re.findall(r"\b((?:benchmarks|notebooks|tests|sonata|\.ci)/[\w./-]+\.(?:py|ipynb|sh)|\.ci/\w+)\b",
                                   text)):
            assert (REPO / path).exists(), f"{page.name} names {path}, which does not exist"
        for ln in _code_lines(page):
            m = re.match(r"make (\w[\w-]*)", ln)
            if m:
                assert m.group(1) in targets, f"{page.name}: `make {m.group(1)}` is not a Makefile target"


def _outputs(nb: str) -> tuple[str, list[bytes]]:
    cells = json.loads((REPO / "notebooks" / nb).read_text())["cells"]
    text, images = [], []
    for c in cells:
        for o in c.get("outputs", []):
            text.append("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")))
            if "image/png" in o.get("data", {}):
                images.append(base64.b64decode(o["data"]["image/png"]))
    return "\n".join(text), images


def test_the_readme_picture_and_story_are_notebook_01s_committed_outputs():
    text, images = _outputs("01_train_tinystories.ipynb")
    readme = _text(REPO / "README.md")
    assert (REPO / "docs/img/notebook01_loss.png").read_bytes() in images
    story = re.search(r"\n((?:> .*\n)+)", readme).group(1)
    story = " ".join(" ".join(ln[2:] for ln in story.splitlines()).split())
    assert len(story) > 200 and story in " ".join(text.split())


def test_the_readme_results_from_notebooks_are_in_their_committed_outputs():
    readme = _text(REPO / "README.md")
    rows = [ln for ln in readme.splitlines() if ln.startswith("| ") and "`notebooks/" in ln]
    assert len(rows) >= 3
    for row in rows:
        nb = re.search(r"`notebooks/([\w.]+\.ipynb)`", row).group(1)
        text, _ = _outputs(nb)
        figure = row.split("|")[2]
        numbers = re.findall(r"\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+", figure)
        assert numbers, row
        for n in numbers:
            assert n in text or n.replace(",", "") in text, f"{nb}: {n} (README) is not in its committed outputs"


class _Tables(HTMLParser):
    """The <table>s of an HTML output: each a list of rows, the header row first."""

    def __init__(self):
        super().__init__()
        self.tables, self._cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None


def _notebook_tables(nb: str) -> list[list[dict]]:
    """Every table a notebook's committed outputs print (its HTML form): rows as {header: cell}."""
    parser = _Tables()
    for c in json.loads((REPO / "notebooks" / nb).read_text())["cells"]:
        for o in c.get("outputs", []):
            parser.feed("".join(o.get("data", {}).get("text/html", "")))
    return [[dict(zip(t[0], r)) for r in t[1:]] for t in parser.tables if t]


def _markdown_tables(page: Path) -> list[tuple[int, list[dict]]]:
    """The page's pipe tables: (line of the header, rows as {header: cell})."""
    out, lines = [], _text(page).splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"\|[\s|:-]+\|$", lines[i + 1]):
            cells = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]  # noqa: E731
            header, rows, j = cells(lines[i]), [], i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(dict(zip(header, cells(lines[j]))))
                j += 1
            out.append((i + 1, rows))
            i = j
        else:
            i += 1
    return out


def _cell(v: str) -> str:
    """A cell as written: no markup, no thousands separators ('16,300' is the notebook's 16300)."""
    v = v.replace("`", "").replace("**", "").strip()
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", v)


def _differences(doc_rows: list[dict], nb_rows: list[dict]) -> tuple[int, list[str]]:
    """How many of the doc rows' labels the notebook table has, and what keeps each doc row
    from being one of its rows (the same cell in every doc column)."""
    label_h = next(iter(doc_rows[0]))
    columns = set(nb_rows[0]) if nb_rows else set()
    out = [f"column {h!r}: not in the notebook's table" for h in doc_rows[0] if h not in columns]
    found = 0
    for row in doc_rows:
        same = [nb for nb in nb_rows if _cell(nb.get(label_h, "")) == _cell(row[label_h])]
        found += bool(same)
        shared = [h for h in row if h in columns]
        if any(all(_cell(row[h]) == _cell(nb[h]) for h in shared) for nb in same):
            continue
        if not same:
            out.append(f"row {row[label_h]!r}: no such row in the notebook's table")
            continue
        best = min(same, key=lambda nb: sum(_cell(row[h]) != _cell(nb[h]) for h in shared))
        out += [f"row {row[label_h]!r}, column {h!r}: docs {row[h]!r}, notebook {best[h]!r}"
                for h in shared if _cell(row[h]) != _cell(best[h])]
    return found, out


def test_the_selection_tables_are_notebook_08s_committed_outputs():
    """Every table of docs/selection.md is part of a table notebook 08's committed outputs print:
    its rows among the notebook's rows and every cell as printed."""
    nb_tables = _notebook_tables("08_selection.ipynb")
    doc_tables = _markdown_tables(REPO / "docs" / "selection.md")
    assert len(nb_tables) >= 8 and len(doc_tables) >= 3
    problems = []
    for line, rows in doc_tables:
        # the notebook table this one is cut from: the one with most of its rows, then the fewest differences
        _, diffs = max((_differences(rows, t) for t in nb_tables), key=lambda r: (r[0], -len(r[1])))
        problems += [f"docs/selection.md table at line {line}: {d}" for d in diffs]
    assert not problems, "\n".join(problems)


_DATE = r"\d{4}-\d{2}-\d{2}"


def _figures(text: str) -> list[str]:
    """The figures of a cell: decimals and numbers with thousands separators."""
    return re.findall(r"\d[\d,]*\.\d+|\d{1,3}(?:,\d{3})+", text)


def test_every_readme_result_names_its_notebook_or_says_measured_once_with_date_and_host():
    readme = _text(REPO / "README.md")
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| what |")]
    assert len(rows) >= 8
    for row in rows:
        source = row.rstrip(" |").split(" | ")[-1]
        assert "`notebooks/" in source or (
            "measured once" in source and "`" in source and re.search(_DATE, source)
            and ("AMD EPYC" in source or "host" in source)), f"README row without its source: {row}"


def test_every_results_table_says_what_printed_it_and_the_notebooks_print_its_figures():
    """docs/results.md: each table has a 'printed by' or 'how measured' column, date and host
    columns, or a sentence before it saying what printed it; each figure a table credits to a
    committed notebook is in that notebook's committed outputs."""
    page = REPO / "docs" / "results.md"
    lines = _text(page).splitlines()
    for line, rows in _markdown_tables(page):
        header = list(rows[0])
        i = line - 2                                        # the paragraph just above the table
        while i >= 0 and not lines[i].strip():
            i -= 1
        para = []
        while i >= 0 and lines[i].strip() and not lines[i].startswith("|"):
            para.insert(0, lines[i])
            i -= 1
        before = " ".join(para).lower()
        assert ("printed by" in header or "how measured" in header or {"date", "host"} <= set(header)
                or header[0] == "host" or "measured once" in before or "printed by" in before), (
            f"docs/results.md table at line {line} does not say what printed it")
        for row in rows:
            src = row.get("printed by", "")
            if not src and "printed by `notebooks/" in before:
                src = before.split("printed by", 1)[1]
            m = re.search(r"`notebooks/([\w.]+\.ipynb)`", src)
            if not m or "committed in" in src:
                continue
            text, _ = _outputs(m.group(1))
            plain = text.replace(",", "")
            for h, v in row.items():
                if h in ("printed by", "date", "host"):
                    continue
                for n in _figures(v):
                    assert n in text or n.replace(",", "") in plain, (
                        f"docs/results.md line {line}: {n} ({h}) is not in {m.group(1)}'s committed outputs")
