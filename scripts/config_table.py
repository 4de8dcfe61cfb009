"""The settings table of docs/configuration.md, written from the plugin's own description.

    .venv/bin/python scripts/config_table.py           # rewrite the table in docs/configuration.md
    .venv/bin/python scripts/config_table.py --check   # exit 1 when the page differs (tests/test_docs.py)

Each row is one entry of ``accel_xla_fsdp.hf_accelerate.plugin.config_help()``: an ``fsdp_config``
key and ``"<ENV> (default <value>): <help>"``. Only the lines between the two markers are written;
the rest of the page is prose written by hand.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Dict

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- settings table: written by scripts/config_table.py, do not edit by hand -->"
END = "<!-- end of settings table -->"
_ENTRY = re.compile(r"^(?P<env>[A-Z0-9_]+) \(default (?P<default>.*?)\): (?P<help>.*)$", re.S)


def table(help_by_key: Dict[str, str]) -> str:
    """The markdown table of ``config_help()``'s entries, in its order."""
    rows = ["| `fsdp_config` key | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for key, text in help_by_key.items():
        entry = _ENTRY.match(text)
        if entry is None:
            raise ValueError(f"config_help()[{key!r}] is not '<ENV> (default <value>): <help>': {text!r}")
        meaning = " ".join(entry["help"].split()).replace("|", "\\|")
        rows.append(f"| `{key}` | `{entry['env']}` | {entry['default']} | {meaning} |")
    return "\n".join(rows)


def with_table(page: str, new_table: str) -> str:
    """``page`` with the lines between the markers replaced by ``new_table``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing or out of order")
    return page[: start + len(BEGIN)] + "\n" + new_table + "\n" + page[end:]


def generated_page() -> str:
    """docs/configuration.md as it should be committed."""
    from accel_xla_fsdp.hf_accelerate.plugin import config_help

    return with_table(PAGE.read_text(), table(config_help()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is not up to date")
    args = p.parse_args()
    page = generated_page()
    if args.check:
        if page != PAGE.read_text():
            print(
                f"{PAGE.name} differs from the plugin's settings: run python scripts/config_table.py", file=sys.stderr
            )
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
