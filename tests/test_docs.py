"""The references name every setting, and the reliability page names tests that exist."""

import ast
import dataclasses
import re
from pathlib import Path

from distserve.cluster.config import LIMITS_FLAGS, POOL_FLAGS
from distserve.core.config import SECTIONS
from distserve.entrypoints.server_config import ServerConfig

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_configuration_doc_lists_every_key_and_flag():
    text = DOC.read_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in text
            if not f.metadata.get("internal"):  # set by the cluster per instance, not a flag
                assert f"`--{f.name.replace('_', '-')}`" in text


def test_configuration_doc_lists_every_server_key_and_launch_flag():
    text = DOC.read_text()
    for f in dataclasses.fields(ServerConfig):
        assert f"`server.{f.name}`" in text
        for flag in (f"--{f.name.replace('_', '-')}", *f.metadata["aliases"]):
            assert f"`{flag}`" in text
    for dest, role, key in POOL_FLAGS:
        assert f"`--{dest.replace('_', '-')}` | `cluster.{role}.{key}`" in text


def test_configuration_and_reliability_docs_list_every_request_limit():
    text, reliability = DOC.read_text(), (DOC.parent / "reliability.md").read_text()
    for dest, key in LIMITS_FLAGS:
        assert f"| `{key}` | `--{dest.replace('_', '-')}` |" in text
        assert f"`cluster.limits.{key}`" in reliability


def test_placement_doc_lists_every_planner_flag():
    from placement.cli import compare_parser, search_parser, simulate_parser

    text = (DOC.parent / "placement.md").read_text()
    for parser in (search_parser(), simulate_parser(), compare_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}`" in text, flag


def test_reliability_doc_names_tests_that_exist_and_every_fault_test():
    docs, tests = DOC.parent, Path(__file__).parent
    named = set(re.findall(r"`tests/(test_\w+)\.py::(test_\w+)`", (docs / "reliability.md").read_text()))
    defined = {
        (path.stem, node.name)
        for path in tests.glob("test_*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    assert named and named <= defined, sorted(named - defined)
    assert {t for t in defined if t[0] in ("test_faults", "test_fuzz")} <= named


def test_architecture_doc_maps_every_module():
    """The module map names each module of distserve/ and placement/ once, and only modules that exist."""
    root = Path(__file__).parent.parent
    text = (DOC.parent / "architecture.md").read_text()
    mapped = re.findall(r"^\| `([\w/.]+)` \|", text, flags=re.MULTILINE)
    assert len(mapped) == len(set(mapped)), "a module is mapped twice"
    modules = {str(path.relative_to(root / "distserve")) for path in (root / "distserve").rglob("*.py")} | {
        str(path.relative_to(root)) for path in (root / "placement").glob("*.py")
    }
    modules = {m for m in modules if not m.endswith("__init__.py") and not m.startswith("v1/")}
    modules -= {"placement/__main__.py"}
    assert modules <= set(mapped), sorted(modules - set(mapped))
    assert set(mapped) - {"v1/"} <= modules, sorted(set(mapped) - {"v1/"} - modules)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings (outside code blocks)."""
    anchors, counts, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in counts else f"{slug}-{counts[slug]}")
        counts[slug] = counts.get(slug, 0) + 1
    return anchors


def test_relative_links_in_docs_resolve():
    """Every relative link in README.md and docs/ names a file that exists, and a heading in it if it names one."""
    root = Path(__file__).parent.parent
    broken = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    assert not broken, broken
