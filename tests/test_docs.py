"""The configuration reference names every setting."""

import dataclasses
from pathlib import Path

from distserve.cluster_config import POOL_FLAGS
from distserve.config import SECTIONS
from distserve.entrypoints.server_config import ServerConfig

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_configuration_doc_lists_every_key_and_flag():
    text = DOC.read_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in text
            assert f"`--{f.name.replace('_', '-')}`" in text


def test_configuration_doc_lists_every_server_key_and_launch_flag():
    text = DOC.read_text()
    for f in dataclasses.fields(ServerConfig):
        assert f"`server.{f.name}`" in text
        assert f"`--{f.name.replace('_', '-')}`" in text
    for dest, role, key in POOL_FLAGS:
        assert f"`--{dest.replace('_', '-')}` | `cluster.{role}.{key}`" in text


def test_placement_doc_lists_every_planner_flag():
    from placement.cli import search_parser, simulate_parser

    text = (DOC.parent / "placement.md").read_text()
    for parser in (search_parser(), simulate_parser()):
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert f"`{flag}`" in text, flag
