"""``data:`` — where training tokens come from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hpc_tools.recipe.base import Section


class DataConfig(Section):
    source: Literal["synthetic", "files"] = "synthetic"
    """`synthetic`: seeded random tokens (benchmarks, smoke tests); `files`: local text/jsonl/parquet files."""
    paths: list[str] = Field(default_factory=list)
    """Local files or folders for source: files (never downloaded)."""
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    """File format; auto = from the file extension."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet files."""
    tokenizer: str = "byte"
    """`byte` (byte-level, needs no download) or a local folder holding a Hugging Face tokenizer."""
