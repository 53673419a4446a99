"""Command-line overrides, parsed once with Hydra's own parser (the grammar users type).

Everything in effitrain that looks at an override (the pre-flight checks, job folder names, W&B
tags, compare's columns) goes through :func:`parse`, so ``optimizer="adamw"`` or
``-m 'optimizer=adamw, adafactor'`` mean the same here as they do to Hydra.
"""

from __future__ import annotations

import hashlib
from urllib.parse import quote

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.errors import OverrideParseException

from effitrain.config.errors import ConfigError

_PARSER = None
# A job folder name is one path component; longer names are cut and made unique with a hash.
_MAX_DIRNAME = 200


def _parser() -> OverridesParser:
    global _PARSER
    if _PARSER is None:
        _PARSER = OverridesParser.create()
    return _PARSER


def parse(overrides) -> list[Override]:
    """Hydra's parse of each override.

    Raises:
        ConfigError: an override breaks Hydra's grammar (one line naming it).
    """
    parsed = []
    for text in overrides:
        try:
            parsed += _parser().parse_overrides([str(text)])
        except OverrideParseException as error:
            reason = str(error).splitlines()[0]
            raise ConfigError(
                f"{text!r} is not a valid override ({reason}): write key=value, "
                "see https://hydra.cc/docs/advanced/override_grammar/basic"
            ) from None
    return parsed


def values(override: Override) -> list[str] | None:
    """The value(s) as strings: each choice of a sweep, the one value otherwise; None for a glob sweep
    (its options are known only to Hydra) and for a deletion."""
    if override.is_delete() or override.value_type == ValueType.GLOB_CHOICE_SWEEP:
        return None
    if override.is_sweep_override():
        return list(override.sweep_string_iterator())
    value = override.value()
    return [value if isinstance(value, str) else override.get_value_element_as_str()]


def typed_value(override: Override) -> str:
    """The value as the user typed it (``1e-3``, not Hydra's ``0.001``)."""
    return override.input_line.partition("=")[2]  # a key never holds "=": the first one ends it


def with_value(override: Override, value: str) -> str:
    """The override with another value, its prefix (``+``, ``++``, ``~``) and package kept."""
    return f"{override.input_line.partition('=')[0]}={value}"


def names(override: Override, *keys: str) -> bool:
    """The override sets one of ``keys`` or a key under one of them (``optimizer.lr`` under ``optimizer``)."""
    key = override.key_or_group
    return any(key == k or key.startswith(f"{k}.") for k in keys)


def is_invariant(key: str, invariant_keys) -> bool:
    """``key`` or one of its dotted parents is run-invariant (``logger.mode`` under ``logger``)."""
    parts = key.split(".")
    return any(".".join(parts[:n]) in invariant_keys for n in range(1, len(parts) + 1))


def job_overrides(overrides, invariant_keys) -> list[str]:
    """The overrides that change results or memory, in Hydra's sorted order, as typed."""
    return sorted(o.input_line for o in parse(overrides) if not is_invariant(o.key_or_group, invariant_keys))


def job_dirname(overrides, invariant_keys) -> str:
    """One job's folder name inside its sweep: its result-changing overrides, ``,``-joined.

    Always a single path component: ``/`` (and other characters a path gives meaning to) are
    percent-encoded, so a value like ``../data.csv`` cannot name a folder outside the sweep, and
    a name too long for a file system is cut and completed with a hash of the whole.
    """
    name = ",".join(job_overrides(overrides, invariant_keys)) or "defaults"
    name = quote(name, safe="=,+~:.-_[]{}@*'\"")
    if name in (".", ".."):
        name = quote(name, safe="")  # not a parent folder: never produced by a valid override anyway
    if len(name) > _MAX_DIRNAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:12]
        name = f"{name[: _MAX_DIRNAME - 13]}-{digest}"
    return name


_SHORT_KEYS = {"gradient_accumulation_steps": "ga", "micro_batch_size": "mb", "effective_batch_size": "eb"}
_FLAGS = {"gradient_checkpointing": "recompute"}  # a switch: its name when on, "no <name>" when off


def short_name(overrides, invariant_keys, groups) -> str:
    """A dashboard-sized name of a job: ``adam8bit | trainer | ga4`` (see :func:`short_part`)."""
    parts = []
    for override in parse(overrides):
        key = override.key_or_group
        if is_invariant(key, invariant_keys):
            continue
        # a deletion (~optimizer.eps) has no value: the key's short name, marked as deleted
        parts.append(
            f"~{key.rpartition('.')[2]}"
            if override.is_delete()
            else short_part(key, values(override)[0], groups)
        )
    return " | ".join(parts) or "defaults"


def short_part(key: str, value, groups) -> str:
    """One choice, short: a group's option (``adam8bit``), a well-known key with a prefix (``ga4``),
    a switch by its name (``recompute``, ``no recompute``), any other key as ``key=value`` with
    its last dotted part (``lr=0.0003``)."""
    value = str(value)
    if key in groups:
        return value
    if key in _SHORT_KEYS:
        return f"{_SHORT_KEYS[key]}{value}"
    if key in _FLAGS and value.lower() in ("true", "false"):
        return _FLAGS[key] if value.lower() == "true" else f"no {_FLAGS[key]}"
    return f"{key.rpartition('.')[2]}={value}"


def register_resolvers() -> None:
    """``${effitrain.job_dirname:${hydra.overrides.task},${run_invariant_keys}}`` names job folders."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("effitrain.job_dirname"):
        OmegaConf.register_new_resolver(
            "effitrain.job_dirname", lambda overrides, keys: job_dirname(list(overrides), set(keys))
        )
