"""The configuration reference names every setting."""

import dataclasses
from pathlib import Path

from distserve.config import SECTIONS

DOC = Path(__file__).parent.parent / "docs" / "configuration.md"


def test_configuration_doc_lists_every_key_and_flag():
    text = DOC.read_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"`{section}.{f.name}`" in text
            assert f"`--{f.name.replace('_', '-')}`" in text
