"""A value's type and its range in one declaration (``Annotated[int, Field(ge=1, ...)]``): OmegaConf
reads the plain type when a config is composed, pydantic the range when its values are checked, and
the ``allowed`` words are what an error says of a value outside it. The run config's schema
(:mod:`effitrain.config.schema`) and the optimizer families' settings
(:mod:`effitrain.config.optimizers`) both declare their fields with these."""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field


def ranged(kind, allowed: str, **limits):
    """``kind`` with pydantic's ``limits`` (ge, gt, lt, le, allow_inf_nan, strict) and ``allowed``, the
    words an error gives for a value outside them."""
    return Annotated[kind, Field(description=allowed, **limits)]


def at_least(minimum: int, null: bool = False):
    suffix = " (or null)" if null else ""
    return ranged(Optional[int] if null else int, f"must be an integer >= {minimum}{suffix}", ge=minimum)


def finite(condition: str, **limits):
    return ranged(float, condition, allow_inf_nan=False, **limits)
