"""The two bases of the schema: what a user writes (frozen) and what the system records."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for spec models: unknown fields are refused, so a typo is an error, not a no-op."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Record(BaseModel):
    """Base for records: unknown fields are refused so a renamed field fails loudly."""

    model_config = ConfigDict(extra="forbid")
