"""``data:`` — where training tokens come from."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from hpc_tools.recipe.base import Section

SPLIT_RE = re.compile(r"\s*\d+(\.\d+)?\s*(,\s*\d+(\.\d+)?\s*){0,2}")


class BlendEntry(Section):
    path: str
    """Prefix of a prepared indexed dataset: PREFIX.bin and PREFIX.idx (`python -m hpc_tools data prepare`)."""
    weight: float = Field(default=1.0, gt=0)
    """Relative share of this dataset in every split (weights are normalised over the blend)."""


class DataConfig(Section):
    source: Literal["synthetic", "files", "indexed"] = "synthetic"
    """`synthetic`: seeded random tokens (benchmarks, smoke tests); `files`: local text/jsonl/parquet files, tokenized
    at start-up (small corpora); `indexed`: prepared Megatron indexed datasets (`data.blend`), memory-mapped."""
    paths: list[str] = Field(default_factory=list)
    """Local files or folders for source: files (never downloaded)."""
    format: Literal["auto", "text", "jsonl", "parquet"] = "auto"
    """File format; auto = from the file extension."""
    text_field: str = "text"
    """Column holding the text in jsonl/parquet files."""
    tokenizer: str = "byte"
    """`byte` (byte-level, needs no download) or a local folder holding a Hugging Face tokenizer."""
    blend: list[BlendEntry] = Field(default_factory=list)
    """For source: indexed: the prepared datasets and their weights, e.g. `[{path: data/wiki, weight: 0.7}, ...]`."""
    split: str = "98,1,1"
    """For source: indexed: train,valid,test shares of every dataset's documents (Megatron's --split)."""
    cache_dir: str | None = None
    """For source: indexed: where the index caches go (built once by one rank, then memory-mapped by all; must be on
    a filesystem every node sees); default: a `cache` folder next to the first blend prefix."""

    @field_validator("split")
    @classmethod
    def _split(cls, value: str) -> str:
        if not SPLIT_RE.fullmatch(value) or not sum(float(x) for x in value.split(",")) > 0:
            raise ValueError("is not a train,valid,test split -- use up to three non-negative numbers with a positive "
                             "sum, e.g. 98,1,1")
        if float(value.split(",")[0]) <= 0:
            raise ValueError("gives the train split no share -- make its first number positive, e.g. 98,1,1")
        return value

    def split_shares(self) -> list[float]:
        """The normalised train, valid, test shares (missing entries are 0)."""
        parts = [float(x) for x in self.split.split(",")] + [0.0, 0.0]
        total = sum(parts[:3])
        return [p / total for p in parts[:3]]
