"""Field docstrings reach ``FieldInfo.description`` exactly as pydantic's own ``use_attribute_docstrings`` would put
them there (hpc_tools/recipe/docstrings.py reads each module once instead: a fifth of the schema's import time)."""

from __future__ import annotations

from pydantic._internal._docs_extraction import extract_docstrings_from_cls

import hpc_tools.recipe.schema  # noqa: F401  (defines every section)
from hpc_tools.recipe.base import Section
from hpc_tools.recipe.docstrings import documented
from hpc_tools.recipe.fields import field_doc


def _sections(cls=Section):
    for sub in cls.__subclasses__():
        yield sub
        yield from _sections(sub)


def test_every_section_field_has_pydantics_docstring():
    sections = {c for c in _sections() if c.__module__.startswith("hpc_tools.recipe.")}
    assert len(sections) >= 10
    checked = 0
    for cls in sections:
        reference = extract_docstrings_from_cls(cls, use_inspect=True)
        documented(cls)
        for name in cls.__dict__.get("__annotations__", {}):
            if name in cls.model_fields:
                assert cls.model_fields[name].description == reference.get(name), (cls.__name__, name)
                checked += reference.get(name) is not None
    assert checked >= 100


def test_a_section_defined_in_a_function_gets_its_docs():
    def make():
        class Local(Section):
            speed: int = 1
            """How fast."""
            plain: int = 2

        return Local

    fields = documented(make()).model_fields
    assert fields["speed"].description == "How fast." and fields["plain"].description is None


def test_docs_are_read_when_first_asked_for():
    """Validating never parses a module for docs; asking a field's doc through the schema walk attaches them."""
    from hpc_tools.recipe.cluster import ClusterConfig

    assert field_doc(["cluster", "nodes"]) == " ".join(ClusterConfig.model_fields["nodes"].description.split())
    assert field_doc(["cluster", "nodes"]).startswith("Nodes")
