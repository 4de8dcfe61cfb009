"""The documentation: the generated settings table is what the plugin says, links resolve, and no
page records facts of one machine (its paths) or of uncommitted code (``-dirty`` commits)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _config_table_script():
    spec = importlib.util.spec_from_file_location("config_table", REPO / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_holds_the_table_the_plugin_describes():
    script = _config_table_script()
    committed = script.PAGE.read_text()
    assert committed == script.generated_page(), (
        "docs/configuration.md's settings table differs from config_help(): run python scripts/config_table.py"
    )


def test_the_table_follows_the_plugin():
    """What the check above compares: a changed help text changes the page."""
    script = _config_table_script()
    page = f"before\n{script.BEGIN}\nold\n{script.END}\nafter\n"
    new = script.with_table(page, script.table({"fsdp_x": "FSDP_X (default True): Does x | y."}))
    assert (
        new == f"before\n{script.BEGIN}\n| `fsdp_config` key | environment | default | meaning |\n"
        f"| --- | --- | --- | --- |\n| `fsdp_x` | `FSDP_X` | True | Does x \\| y. |\n{script.END}\nafter\n"
    )


def test_no_machine_paths_or_uncommitted_commits():
    found = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if re.search(r"/work/|/root/|-dirty\b", line)
    ]
    assert not found, "\n".join(found)


def _anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, "\n".join(broken)


def test_every_page_is_in_the_readme_table():
    """A page no one can find from the README is a page no one reads."""
    table = (REPO / "README.md").read_text().split("## Documentation", 1)[1].split("\n## ", 1)[0]
    missing = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"](docs/{p.name})" not in table]
    assert not missing, f"docs pages not linked from the README's documentation table: {missing}"


def _defined_names(path: Path) -> set:
    """The functions and classes a module defines at top level, and its classes' methods as
    ``Class.method``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {
                f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            }
    return names


def test_architecture_page_names_functions_that_exist():
    """docs/architecture.md walks through the code naming each stop `module.py:function`: each
    one must still be defined there (a rename or a move shows up here, not in a reader's search)."""
    stops = set(re.findall(r"`([\w/]+\.py):([\w.]+)`", (REPO / "docs" / "architecture.md").read_text()))
    assert len(stops) > 30, "the page names its stops as `module.py:function`"
    package = REPO / "accel_xla_fsdp"
    missing = [
        f"{path}:{name}"
        for path, name in sorted(stops)
        if not (package / path).is_file() or name not in _defined_names(package / path)
    ]
    assert not missing, f"docs/architecture.md names what the package does not define: {missing}"
