"""The README and docs/ keep working: links resolve, the command lines they show parse with
sonata's own parser and configuration, the files and make targets they name exist, and the
README's picture, story and notebook figures are the committed notebooks' outputs. Prose is
not tested."""
import base64
import json
import re
import shlex
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
