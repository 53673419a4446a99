"""The config groups, read from conf/ (the one registry of choices): which groups and options
exist, an override naming an option that does not, which options can be built here (an optional
package installed or not, and the extra that installs it), and the signature of what a node's
``_target_`` names (:func:`target_signature`), read without importing a module not yet loaded."""

from __future__ import annotations

import functools
from pathlib import Path

from effitrain.config.errors import ConfigError

# conf/ at the top of the checkout is the package effitrain.conf (pyproject.toml maps it, into the
# wheel too): Hydra reads it through this search path wherever effitrain is installed.
CONF_MODULE = "effitrain.conf"


CONF_SOURCE = f"pkg://{CONF_MODULE}"


def _conf_dir() -> Path:
    """The folder behind ``effitrain.conf``: the checkout's conf/ (editable install) or the wheel's copy."""
    from importlib.resources import files

    return Path(str(files(CONF_MODULE)))


CONF_DIR = _conf_dir()


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The options of a config group: the YAML files of its folder (the registry is conf/)."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def group_names(conf_dir: Path = CONF_DIR) -> list[str]:
    """The config groups: the folders of conf/ (``hydra`` is Hydra's own)."""
    return sorted(p.name for p in conf_dir.iterdir() if p.is_dir() and p.name != "hydra")


def check_group_overrides(overrides: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Reject ``group=option`` overrides naming an option that does not exist.

    Hydra would reject them too, but with a multi-line report; this gives the one-line message
    before Hydra starts. Each value of a sweep (``optimizer=adamw,adafactor``) is checked.

    Raises:
        ConfigError: an option is not a file of its group, or an override breaks Hydra's grammar.
    """
    from effitrain.config.overrides import parse, values

    groups = set(group_names(conf_dir))
    for override in parse(overrides):
        if override.key_or_group not in groups:
            continue
        options = group_options(override.key_or_group, conf_dir)
        for choice in values(override) or []:
            if choice not in options and choice != "null":
                raise ConfigError(
                    f"{override.key_or_group}={choice!r} is not an option: choose one of {', '.join(options)}"
                )


def missing_module(node) -> str | None:
    """The top-level module a node's ``_target_`` needs that is not installed, or None."""
    import importlib.util

    module = str(node.get("_target_", "")).split(".")[0]
    return module if module and importlib.util.find_spec(module) is None else None


def installed_optimizers(names: list[str]) -> list[str]:
    """``names`` (options of conf/optimizer) less those whose package is missing, each said on
    stderr in one line: ``estimate`` and ``plan`` cover every option that can be built here."""
    import sys

    from omegaconf import OmegaConf

    kept = []
    for name in names:
        node = OmegaConf.load(CONF_DIR / "optimizer" / f"{name}.yaml")
        missing = missing_module(node)
        if missing is None:
            kept.append(name)
            continue
        print(f"effitrain: optimizer={name} left out: {missing} is not installed ({install_hint(missing)})",
              file=sys.stderr)  # fmt: skip
    return kept


def install_hint(module: str) -> str:
    extra = optional_extra(module.split(".")[0])
    return f"pip install 'effitrain[{extra}]'" if extra else f"install the package that provides {module}"


def optional_extra(module: str) -> str | None:
    """The extra of effitrain's metadata (``pip install 'effitrain[X]'``) that installs ``module``."""
    import re
    from importlib.metadata import PackageNotFoundError, requires

    try:
        requirements = requires("effitrain") or []
    except PackageNotFoundError:
        return None
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        extra = re.search(r"""extra\s*==\s*['"]([^'"]+)['"]""", marker)
        distribution = re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0]
        if extra and distribution.replace("-", "_").lower() == module.lower():
            return extra.group(1)
    return None


def is_target_node(node) -> bool:
    """``node`` is a mapping whose ``_target_`` names something Hydra instantiates (not ``null``:
    ``logger=none`` builds nothing)."""
    from omegaconf import DictConfig

    target = node.get("_target_") if isinstance(node, DictConfig) else None
    return isinstance(target, str) and bool(target)


def target_signature(target: str):
    """The :class:`inspect.Signature` of what ``target`` (``module.name``) builds: a function's, or a
    class's ``__init__`` without ``self``.

    A module not imported yet is not imported when its source defines ``name`` plainly (a function,
    or a class with its own ``__init__``, neither decorated): its signature is read from the source,
    so that checking a config does not load ``datasets`` or the Trainer. Otherwise the target is
    imported (a re-export, a dataclass, a decorated function).

    Raises:
        ImportError: ``target`` names nothing importable.
    """
    import inspect
    import sys

    module, _, name = target.rpartition(".")
    if module not in sys.modules:
        source = _source_signature(module, name)
        if source is not None:
            return source
    return inspect.signature(_locate(module, name))


def _locate(module: str, name: str):
    """What ``module.name`` names, imported as Hydra's ``_locate`` would (a class's attribute too:
    ``package.Class.method``), without its logging of a failure.

    Raises:
        ImportError: nothing importable by that name.
    """
    import importlib

    if not module:
        raise ImportError(f"{name} is not a dotted path (module.name)")
    parts = module.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name is None or not ".".join(parts[:cut]).startswith(error.name):
                raise  # a module that exists, but fails to import one of its own imports
            continue
        where = ".".join(parts[:cut])
        for attribute in [*parts[cut:], name]:
            if not hasattr(found, attribute):
                raise ImportError(f"{where} has no {attribute}")
            found, where = getattr(found, attribute), f"{where}.{attribute}"
        return found
    raise ImportError(f"no module {parts[0]}")


@functools.cache  # a sweep's jobs name the same targets: each source is parsed once
def _source_signature(module: str, name: str):
    """``name``'s signature read from ``module``'s source file, found without importing it or its
    packages; None when the source does not define ``name`` plainly."""
    import ast
    import importlib.util
    import inspect
    from importlib.machinery import PathFinder

    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for part in parts[1:]:
            locations = spec.submodule_search_locations if spec is not None else None
            spec = PathFinder.find_spec(part, list(locations)) if locations else None
    except (ImportError, ValueError):
        return None
    if spec is None or not str(spec.origin or "").endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
    if len(found) != 1 or found[0].decorator_list:
        return None
    function, is_class = found[0], isinstance(found[0], ast.ClassDef)
    if is_class:
        inits = [n for n in function.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        if len(inits) != 1 or inits[0].decorator_list:
            return None
        function = inits[0]
    arguments, kind = function.args, inspect.Parameter
    # names and kinds only (defaults are not read): all bind_partial needs
    parameters = [kind(a.arg, kind.POSITIONAL_ONLY) for a in arguments.posonlyargs]
    parameters += [kind(a.arg, kind.POSITIONAL_OR_KEYWORD) for a in arguments.args]
    if arguments.vararg:
        parameters.append(kind(arguments.vararg.arg, kind.VAR_POSITIONAL))
    parameters += [kind(a.arg, kind.KEYWORD_ONLY) for a in arguments.kwonlyargs]
    if arguments.kwarg:
        parameters.append(kind(arguments.kwarg.arg, kind.VAR_KEYWORD))
    return inspect.Signature(parameters[1:] if is_class else parameters)
