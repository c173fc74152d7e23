"""Base class for recipe sections: strict (unknown keys are errors), documented field by field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A recipe section. Field docstrings are the user documentation (``python -m hpc_tools validate --explain``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=False)
