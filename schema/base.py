"""The two bases of the schema: what a user writes (frozen) and what the system records."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MAX_SECONDS = 3_155_760_000.0
"""Longest duration a spec or request may give (100 years, in seconds; "forever" in practice).
Inside what every consumer holds: a Python timedelta (2.7 million years), a Temporal duration
(10,000 years) and a timer's deadline (year 9999), and a thread's wait (threading.TIMEOUT_MAX,
292 years), so no timeout, wait or sleep built from one can overflow."""

MAX_ATTEMPTS = 2**31 - 1
"""Most attempts a retry policy may give: Temporal carries maximum_attempts as a 32-bit integer."""


class Strict(BaseModel):
    """Base for spec models: unknown fields are refused, so a typo is an error, not a no-op; a
    number must be finite (`.inf` or `.nan` in YAML would pass `gt=0`, and then overflow a timeout)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Record(BaseModel):
    """Base for records: unknown fields are refused so a renamed field fails loudly."""

    model_config = ConfigDict(extra="forbid")
