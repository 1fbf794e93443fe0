"""Docs, docstrings and shipped config refer only to things that exist: files, commands, explained keys."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from omni_accum.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [
    *(ROOT / "omni_accum").rglob("*.py"),
    *(ROOT / "strategies").rglob("*.py"),
    *(ROOT / "docs").rglob("*.md"),
    *(ROOT / "config").rglob("*.yaml"),
    ROOT / "README.md",
]


def test_no_reference_to_a_missing_design_document():
    if (ROOT / "DESIGN.md").exists():
        return
    cited = [str(p.relative_to(ROOT)) for p in SOURCES if "DESIGN.md" in p.read_text(encoding="utf-8")]
    assert not cited, f"these cite DESIGN.md, which is not in the repository: {cited}"


def test_commands_named_in_the_shipped_config_exist():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for path in (ROOT / "config").rglob("*.yaml"):
        for cmd in re.findall(r"`omni-accum ([a-z][a-z-]*)", path.read_text(encoding="utf-8")):
            assert cmd in sub.choices, f"{path.name} names `omni-accum {cmd}`, which does not exist"


def test_every_connector_key_of_the_deploy_example_is_explained_in_the_docs():
    """README.md or a page of docs/ (the reference moved there from the README) explains every key."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    readme = "\n".join(p.read_text(encoding="utf-8") for p in pages)
    for path in (ROOT / "config" / "deploy").glob("*.yaml"):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for connector in (doc.get("connectors") or {}).values():
            for key in connector.get("extra") or {}:
                if key.startswith("omni_accum_"):
                    assert f"`{key}" in readme, f"{path.name}: connector key {key} is explained in no doc page"
