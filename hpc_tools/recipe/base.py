"""Base class for recipe sections: strict (unknown keys are errors), documented field by field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A recipe section. Field docstrings are the user documentation: ``python -m hpc_tools validate --explain PATH``
    prints them (PATH a field such as ``parallel.tensor_size``, a section such as ``parallel``, or ``recipe``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=False)
