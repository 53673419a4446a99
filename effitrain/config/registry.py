"""The config groups, read from conf/ (the one registry of choices): which groups and options
exist, an override naming an option that does not, which options can be built here (an optional
package installed or not, and the extra that installs it), and the signature of what a node's
``_target_`` names (:func:`target_definition`), read without importing a module not yet loaded, and
the allow-list of where each group's targets come from (:data:`GROUP_TARGETS`; the optimizer's: the
targets of its families' rows, :mod:`effitrain.config.optimizers`)."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path

from effitrain.config.errors import ConfigError
from effitrain.config.optimizers import OPTIMIZER_FAMILIES, optional_extra

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
    extra = optional_extra(module)
    return f"pip install 'effitrain[{extra}]'" if extra else f"install the package that provides {module}"


def uses_trainer(cfg) -> bool:
    """Whether ``cfg`` trains with transformers' Trainer (``backend=trainer``: its ``fit`` is
    ``effitrain.backends.trainer``'s), what a check or a prediction asks before any backend loads."""
    return str((cfg.get("backend") or {}).get("_target_", "")).startswith("effitrain.backends.trainer")


def is_target_node(node) -> bool:
    """``node`` is a mapping whose ``_target_`` names something Hydra instantiates (not ``null``:
    ``logger=none`` builds nothing)."""
    from omegaconf import DictConfig

    target = node.get("_target_") if isinstance(node, DictConfig) else None
    return isinstance(target, str) and bool(target)


@dataclass(frozen=True)
class Allowed:
    """Where a group's ``_target_`` may come from, and what it must be.

    ``names``: dotted prefixes a target must start with (a module and what lies under it, or one
    name); ``kind``: what the target must be, in words, and ``is_class`` / ``base`` that say it (a
    class or a function; a class derived from ``base``, a dotted name imported only once the target
    itself is allowed). What the target names must also be defined under one of ``names``' modules,
    so that a name a module merely imports (``effitrain.train.data.shutil.rmtree``) is refused.
    """

    names: tuple[str, ...]
    kind: str
    is_class: bool | None = None  # None: a class or a function
    base: str | None = None


# The allow-list: each group's targets, checked before anything is imported (``check_allowed``).
GROUP_TARGETS = {
    "optimizer": Allowed(
        tuple(family.target for family in OPTIMIZER_FAMILIES),  # one row per family of optimizers
        "a torch.optim.Optimizer class",
        is_class=True,
        base="torch.optim.Optimizer",
    ),
    "lr_scheduler": Allowed(
        ("transformers.get_scheduler", "transformers.optimization", "torch.optim.lr_scheduler"),
        "a learning-rate scheduler class or function",
    ),
    "data": Allowed(("effitrain.train.data",), "a loader function", is_class=False),
    "backend": Allowed(("effitrain.backends",), "a backend's fit function", is_class=False),
    "logger": Allowed(("effitrain.train.loggers",), "a logger class", is_class=True),
    "task": Allowed(("effitrain.train.tasks",), "a task class", is_class=True),
    # peft's adapter config, and (adapter.quantization) transformers' 4-bit quantization config
    "adapter": Allowed(
        ("peft", "transformers.BitsAndBytesConfig", "transformers.utils.quantization_config"),
        "a peft adapter config or a transformers quantization config",
        is_class=True,
    ),
    # hydra.callbacks.<name>: Hydra builds them, after the run's own checks, unless these come first
    "hydra": Allowed(
        ("hydra.experimental.callbacks", "effitrain.sweep.report"),
        "a Hydra callback class",
        is_class=True,
        base="hydra.experimental.callback.Callback",
    ),
}


def check_allowed(path: str, target: str, allowed: dict[str, Allowed] = GROUP_TARGETS) -> None:
    """``target``, the ``_target_`` of the node at ``path``, is one its group allows, read from the
    name alone: nothing is imported for a name outside the list. A node outside every group has no
    target to build.

    Raises:
        ConfigError: one line naming the key, the target and what the group allows.
    """
    from effitrain.config.errors import invalid

    group = path.split(".")[0]
    rule = allowed.get(group)
    if rule is None:
        raise invalid(f"{path}._target_", target, f"nothing builds a _target_ under {group}: leave it out")
    parts = target.split(".")
    inside = any(target == name or target.startswith(f"{name}.") for name in rule.names)
    inside = inside or project_module(parts[0])
    if not inside or any(not part or part.startswith("_") for part in parts):
        raise invalid(f"{path}._target_", target, f"{group} takes {rule.kind} from {', '.join(rule.names)}")


def check_kind(path: str, target: str, found, allowed: dict[str, Allowed] = GROUP_TARGETS) -> None:
    """What an allowed ``target`` names (``found``: the object, or ``"class"``/``"function"`` when
    read from its module's source) is of its group's kind and defined where the group allows.

    Raises:
        ConfigError: one line naming the key, the target and the kind its group builds.
    """
    import inspect

    from effitrain.config.errors import invalid

    rule = allowed[path.split(".")[0]]
    if isinstance(found, str) and rule.base is not None:  # its base is known once imported (it is allowed)
        found = _locate(*target.rsplit(".", 1))
    if isinstance(found, str):  # a plain definition in the allowed module's own source
        is_class, fits = found == "class", rule.base is None
    else:
        is_class = inspect.isclass(found)
        home = str(getattr(found, "__module__", ""))
        fits = any(home == m or home.startswith(f"{m}.") for m in rule.names) or project_module(
            home.split(".")[0]
        )
        fits = fits and (is_class or inspect.isfunction(found))
        if fits and rule.base is not None:
            module, _, name = rule.base.rpartition(".")
            fits = is_class and issubclass(found, getattr(importlib.import_module(module), name))
    if not fits or rule.is_class not in (None, is_class):
        raise invalid(
            f"{path}._target_", target, f"{path.split('.')[0]} takes {rule.kind}, and this is not one"
        )


@functools.cache
def project_module(top: str) -> bool:
    """``top`` is a module of the user's own project, so its group's targets may come from it (a task
    class beside the configs: docs/extending.md): found, not imported, in a file under the working
    directory and outside the interpreter's installed packages and standard library. effitrain's own
    modules are held to the list."""
    import importlib.util
    import sysconfig

    if top == "effitrain":
        return False
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    where = spec.origin if spec.has_location else next(iter(spec.submodule_search_locations or []), None)
    if where is None:
        return False
    path = Path(where).resolve()
    installed = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib", "stdlib")}
    return path.is_relative_to(Path.cwd().resolve()) and not any(path.is_relative_to(i) for i in installed)


def target_definition(target: str):
    """(the :class:`inspect.Signature` of what ``target`` (``module.name``) builds, what it is): a
    function's signature, or a class's ``__init__`` without ``self`` (None for a builtin, which has
    none to read); the object, or ``"class"`` / ``"function"`` when read from source.

    A module not imported yet is not imported when its source defines ``name`` plainly (a function,
    or a class with its own ``__init__``, neither decorated): its signature is read from the source.
    ``inspect.signature`` needs the module imported, and effitrain's loaders and backends import
    ``datasets`` (seconds), ``accelerate`` and the Trainer (seconds more) at their top, which
    checking a config must not pay. Otherwise the target is imported (a re-export, a dataclass, a
    decorated function): only a target its group allows gets here (:func:`check_allowed`).

    Raises:
        ImportError: ``target`` names nothing importable.
    """
    import inspect
    import sys

    module, _, name = target.rpartition(".")
    # a lazy package (transformers) gets its re-exports' attributes only when one is first read
    if module not in sys.modules or name not in vars(sys.modules[module]):
        source = _source_signature(module, name)
        if source is not None:
            return source
    found = _locate(module, name)
    try:
        return inspect.signature(found), found
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return None, found


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
    """(``name``'s signature, ``"class"`` or ``"function"``) read from ``module``'s source file, found
    without importing it or its packages; None when the source does not define ``name`` plainly."""
    import ast
    import importlib.util
    import inspect
    from importlib.machinery import PathFinder

    parts = module.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
        for part in parts[1:]:
            locations = spec.submodule_search_locations if spec is not None else None
            # as strings: a lazy package imported (transformers) holds its location as a Path
            spec = PathFinder.find_spec(part, [str(p) for p in locations]) if locations else None
    except (ImportError, ValueError):
        return None
    if spec is None or not str(spec.origin or "").endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
    if not found:
        origin = _reexported_from(tree, module, Path(spec.origin).name == "__init__.py", name)
        return _source_signature(origin, name) if origin not in (None, module) else None
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
    return inspect.Signature(parameters[1:] if is_class else parameters), "class" if is_class else "function"


def _reexported_from(tree, module: str, package: bool, name: str) -> str | None:
    """The module ``module``'s source imports ``name`` from under its own name, at its top or in its
    ``if TYPE_CHECKING:`` block (where a lazy package such as transformers lists what it re-exports:
    ``from .optimization import get_scheduler``); None unless exactly one import does."""
    import ast

    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            body += node.body
    origins = [
        node for node in body
        if isinstance(node, ast.ImportFrom) and any(a.name == name and a.asname in (None, name) for a in node.names)
    ]  # fmt: skip
    if len(origins) != 1:
        return None
    origin = origins[0]
    if not origin.level:
        return origin.module
    base = module.split(".")[: len(module.split(".")) - origin.level + package]
    return ".".join(base + ([origin.module] if origin.module else []))
