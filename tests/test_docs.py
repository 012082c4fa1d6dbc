"""The docs describe the tree that is there: the package map in docs/architecture.md names every module of
nanotron/ and nothing that does not exist, every relative link and image in README.md and docs/*.md resolves (the
file, and a `#anchor` to a heading of it by GitHub's rules), docs/configuration.md names every config key, and the
README fits a few screens. Each check is first shown to catch a planted violation."""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nanotron"
ARCHITECTURE = REPO / "docs" / "architecture.md"
CONFIGURATION = REPO / "docs" / "configuration.md"
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def without_code(text: str) -> str:
    """The prose of a markdown file: fenced blocks and inline code spans removed (a `[x](y)` there is no link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


# ---- the package map -----------------------------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The lines under `## heading`, up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}[ \t]*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def map_paths(text: str, root: str) -> set[str]:
    """Every path under `root/` that the `## Package map` section names in backticks."""
    return set(re.findall(rf"`({re.escape(root)}/[\w/.]*)`", section(text, "Package map")))


def tree_paths(package: Path) -> set[str]:
    """What the map must name: each package below the root as `dir/`, each module as its file (the root package's
    `__init__.py` too; a subpackage's stands in its `dir/` row)."""
    found = set()
    for path in package.rglob("*.py"):
        relative = path.relative_to(package.parent).as_posix()
        if path.name == "__init__.py" and path.parent != package:
            found.add(relative.removesuffix("__init__.py"))
        else:
            found.add(relative)
    return found


def map_differences(named: set[str], package: Path) -> tuple[list[str], list[str]]:
    """(modules of the tree the map leaves out, paths the map names that do not exist)."""
    tree = tree_paths(package)
    return sorted(tree - named), sorted(p for p in named - tree if not (package.parent / p).exists())


def test_map_check_finds_a_module_left_out_and_a_path_that_does_not_exist(tmp_path):
    for file in ("pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py", "pkg/sub/c.py"):
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_text("")
    doc = "## Package map\n\n| `pkg/__init__.py` | `pkg/a.py` | `pkg/sub/` | `pkg/sub/b.py` | `pkg/gone.py` |\n"
    doc += "## Layers\n\n`pkg/sub/c.py` is named outside the map, which does not count.\n"
    assert map_differences(map_paths(doc, "pkg"), tmp_path / "pkg") == (["pkg/sub/c.py"], ["pkg/gone.py"])


def test_the_package_map_is_the_tree():
    missing, absent = map_differences(map_paths(ARCHITECTURE.read_text(), "nanotron"), PACKAGE)
    assert not missing, f"docs/architecture.md's package map leaves out: {missing}"
    assert not absent, f"docs/architecture.md's package map names what does not exist: {absent}"


# ---- links and images ----------------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, every character but letters, digits, `_`, `-` and spaces
    dropped, spaces turned into hyphens (so `Weights & Biases` is `weights--biases`)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = github_slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    """Each relative link or image of `doc` whose file does not exist, or whose `#anchor` no heading of its
    markdown target makes."""
    broken = []
    for target in LINK.findall(without_code(doc.read_text())):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / unquote(path)).resolve() if path else doc
        if not file.exists():
            broken.append(f"{doc.name}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and unquote(anchor) not in anchors(file.read_text()):
            broken.append(f"{doc.name}: {target} (no such heading in {file.name})")
    return broken


def test_slugs_follow_githubs_rules():
    assert github_slug("Plan a cluster run: `nanotron plan`") == "plan-a-cluster-run-nanotron-plan"
    assert github_slug("Weights & Biases") == "weights--biases"
    assert github_slug("µP: hyperparameters that transfer") == "µp-hyperparameters-that-transfer"
    assert github_slug("With the launcher: `python -m nanotron.launch`") == "with-the-launcher-python--m-nanotronlaunch"
    assert anchors("# Top\n## Flags\n```\n# a shell comment\n```\n### Flags\n") == {"top", "flags", "flags-1"}


def test_link_check_finds_a_missing_file_a_missing_heading_and_a_missing_image(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    (tmp_path / "a.md").write_text(
        "# Top heading\n"
        "[fine](b.md#real-heading), [self](#top-heading), [web](https://example.com/x.md), `[code](gone.md)`\n"
        "```\n[in a block](gone.md)\n```\n"
        "[gone](missing.md), [wrong anchor](b.md#no-such-heading), ![figure](results/none.png)\n"
    )
    assert broken_links(tmp_path / "a.md") == [
        "a.md: missing.md (no such file)",
        "a.md: b.md#no-such-heading (no such heading in b.md)",
        "a.md: results/none.png (no such file)",
    ]


def test_every_relative_link_and_image_in_the_docs_resolves():
    broken = [line for doc in DOCS for line in broken_links(doc)]
    assert not broken, "\n".join(broken)


# ---- the config key table ------------------------------------------------------------------------------------------


def config_keys() -> dict[str, set[str]]:
    """Section (or table, `model.moe`) -> its keys, from the schema `--help` reads."""
    from nanotron.config import Config

    keys: dict[str, set[str]] = {}
    for name, values in asdict(Config()).items():
        keys[name] = {key for key, value in values.items() if not isinstance(value, dict)}
        keys |= {f"{name}.{key}": set(value) for key, value in values.items() if isinstance(value, dict)}
    return keys


def undocumented_keys(text: str, keys: dict[str, set[str]]) -> list[str]:
    """Keys no row of the `| section | keys |` table names in backticks, and rows for sections that do not exist."""
    rows = {s: set(re.findall(r"`([^`]+)`", rest)) for s, rest in re.findall(r"^\| `([\w.]+)` \|(.*)\|$", text, re.M)}
    missing = [f"{s}.{k}" for s in keys for k in sorted(keys[s]) if k not in rows.get(s, set())]
    return missing + [f"[{s}] (no such section)" for s in rows if s not in keys]


def test_key_table_check_finds_a_key_left_out_and_a_section_that_does_not_exist():
    keys = {"job": {"name", "seed"}, "model.moe": {"top_k"}}
    table = "| section | keys |\n| `job` | `name` (a folder name) |\n| `model.moe` | `top_k` |\n| `jobs` | `x` |\n"
    assert undocumented_keys(table, keys) == ["job.seed", "[jobs] (no such section)"]


def test_the_configuration_page_names_every_key():
    assert not undocumented_keys(CONFIGURATION.read_text(), config_keys())


# ---- the README's length -------------------------------------------------------------------------------------------


def too_long(path: Path, limit: int) -> bool:
    return len(path.read_text().splitlines()) > limit


def test_length_check_finds_a_long_file(tmp_path):
    (tmp_path / "long.md").write_text("line\n" * (README_MAX_LINES + 1))
    (tmp_path / "short.md").write_text("line\n" * README_MAX_LINES)
    assert too_long(tmp_path / "long.md", README_MAX_LINES) and not too_long(tmp_path / "short.md", README_MAX_LINES)


def test_the_readme_fits_a_few_screens():
    """What it is, the two quick-start commands, five next steps and a table of links; the rest lives in docs/."""
    assert not too_long(README, README_MAX_LINES), f"README.md is over {README_MAX_LINES} lines: move a part to docs/"
