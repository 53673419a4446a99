"""The front door of ``train.py`` (and ``effitrain train``) and the Hydra task behind it: overrides
checked and every job of a sweep validated before Hydra writes anything, then one job per Hydra
call (:func:`train_job`)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from effitrain.config.errors import ConfigError, fail, raise_problems
from effitrain.config.registry import check_group_overrides
from effitrain.config.validate import check_output_folder, check_output_overrides

# Hydra's command-line flags that are not overrides: -m, and the config's folder and name (the
# preflight composes what Hydra will); any other flag (--cfg, --info, --help...) is left to Hydra
# with the overrides unchecked.
MULTIRUN_FLAGS = ("-m", "--multirun")
CONFIG_FLAGS = {"--config-dir": "dir", "-cd": "dir", "--config-name": "name", "-cn": "name"}
MAX_JOBS_CHECKED = 64  # a sweep's first jobs validated before any starts; the rest when they start


def check_overrides_or_exit(argv: list[str]) -> tuple[contextlib.ExitStack, list[str], DictConfig | None]:
    """Reject bad overrides and a folder that may not be used before Hydra starts, so a mistake
    leaves the run folder as it was (Hydra rewrites ``.hydra/`` there before the task runs): a
    single run is composed and validated here, and so is every job of a sweep (up to
    ``MAX_JOBS_CHECKED``).

    A single run's folder is locked and decided on in one step (:func:`effitrain.run.folder_policy.claimed`)
    and stays locked for the returned stack's life, Hydra's run included: a second run started at
    the same moment is refused here, before it could rewrite the winner's ``.hydra/``. Returns the
    stack, the command line to hand Hydra (with the folder the lock was taken on) and the single
    run's validated config (None: a sweep, or flags left to Hydra)."""

    from effitrain.run import folder_policy

    held = contextlib.ExitStack()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = preflight(argv, world)
        if cfg is None:
            return held, argv, None
        folder = str(cfg.hydra.run.dir)
        # several ranks agree on their folder after this (share_run_dir_across_ranks): the run locks it
        if world > 1:
            owner = folder_policy.folder_in_use(Path(folder))
            decision = (
                folder_policy.Decision("busy", owner=owner)
                if owner
                else folder_policy.decide(Path(folder), cfg)
            )
        else:
            decision = held.enter_context(folder_policy.claimed(Path(folder), cfg))
            held.enter_context(folder_policy.held_here(Path(folder)))
            # a folder named by the clock: given to Hydra, so that its run goes where the lock is
            if not _given(argv, "hydra.run.dir") and "'" not in folder and "\\" not in folder:
                argv = [*argv, f"hydra.run.dir='{folder}'"]
        if decision.action == "busy":
            raise ConfigError(
                f"hydra.run.dir={folder!r} is invalid: in use by another run (pid {decision.owner})"
            )
        if decision.action == "refuse":
            raise ConfigError(decision.reason)
        if decision.action == "keep":
            print(decision.reason)
            held.close()
            sys.exit(0)
    except ConfigError as error:
        held.close()
        fail(str(error))
    return held, argv, cfg


def _given(argv: list[str], key: str) -> bool:
    from effitrain.config.overrides import parse

    return any(o.key_or_group == key for o in parse(_split_flags(argv)[2]))


def _split_flags(argv: list[str]) -> tuple[list[str], dict, list[str]] | None:
    """``(flags, {"dir": ..., "name": ...}, overrides)``, or None for a flag left to Hydra."""
    flags, config, overrides, args = [], {}, [], iter(argv)
    for arg in args:
        name, _, value = arg.partition("=")
        if name in CONFIG_FLAGS:
            config[CONFIG_FLAGS[name]] = value or next(args, "")
        elif arg in MULTIRUN_FLAGS:
            flags.append(arg)
        elif arg.startswith("-"):
            return None
        else:
            overrides.append(arg)
    return flags, config, overrides


def _compose_with(config: dict, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """What Hydra composes with ``--config-dir``/``--config-name``: the named primary config, from
    effitrain's conf/ or else the given folder, which is searched after conf/ (as Hydra's flags
    do; a group option in both folders is taken from the given one here); errors in one line."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException

    from effitrain.config.compose import plain_open_overrides
    from effitrain.config.registry import CONF_DIR, CONF_MODULE

    name = config.get("name", "config")
    folder = Path(config.get("dir", CONF_DIR)).absolute()
    if (CONF_DIR / f"{name}.yaml").exists() or not (folder / f"{name}.yaml").exists():
        search = [f"hydra.searchpath=[file://{folder}]"] if "dir" in config else []
        start = initialize_config_module(CONF_MODULE, version_base="1.3", job_name="effitrain")
    else:  # Hydra's search path can only be extended once the primary config is found
        search = [f"hydra.searchpath=[pkg://{CONF_MODULE}]"]
        start = initialize_config_dir(str(folder), version_base="1.3", job_name="effitrain")
    try:
        with start:
            cfg = compose(name, plain_open_overrides(overrides) + search, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
    except HydraException as error:
        raise ConfigError(" ".join(str(error).split())[:500]) from None
    return cfg, []


def preflight(argv: list[str], world_size: int = 1, jobs_checked: list | None = None) -> DictConfig | None:
    """Everything a run or sweep would reject, checked from the command line alone; returns a
    single run's composed config (None for a sweep, or flags left to Hydra). For a sweep, the
    number of jobs checked is appended to ``jobs_checked``.

    Raises:
        ConfigError: the first grammar problem, or every problem of the first bad job.
    """
    from omegaconf.errors import OmegaConfBaseException

    from effitrain.config.compose import compose_checked
    from effitrain.config.load import checked, load
    from effitrain.config.overrides import parse
    from effitrain.run import folder_policy

    split = _split_flags(argv)
    if split is None:
        return None
    flags, config, overrides = split
    parsed = parse(overrides)
    check_group_overrides(overrides)
    check_output_overrides(overrides)
    # the model's check, torch with it: imported after the folder checks (a full disk refuses torch's import)
    from effitrain.train.adapters.build import check_builds

    sweeps = [o for o in parsed if o.is_sweep_override()]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    try:
        cfg, problems = _compose_with(config, fixed) if config else compose_checked(fixed)
    except ConfigError:
        # a +key under a group a sweep varies (adapter=lora,qlora +adapter.bias=all) exists in its
        # jobs only: the sweep's own config is composed without the added keys, each job with them
        base = [o.input_line for o in parse(fixed) if not (o.is_add() or o.is_force_add())]
        if base == fixed:
            raise
        cfg, problems = _compose_with(config, base) if config else compose_checked(base)
        if not (flags or str(cfg.hydra.mode) == "RunMode.MULTIRUN"):
            raise
    multirun = bool(flags) or str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    if sweeps and not multirun:
        raise ConfigError(
            f"{sweeps[0].input_line} is a sweep (several values): add -m to run one job per value, "
            "or give one value"
        )
    if not multirun:
        cfg = checked(cfg, problems, world_size, builds=check_builds)
        check_output_folder("hydra.run.dir", str(cfg.hydra.run.dir))
        return cfg
    check_output_folder("hydra.sweep.dir", str(cfg.hydra.sweep.dir))
    raise_problems([p for p in problems if p.startswith("hydra.launcher.")])  # the sweep's, not a job's
    if str(cfg.hydra.launcher.get("_target_", "")).endswith(".EffitrainLauncher"):
        from effitrain.config.schema import launcher_settings

        launcher_settings(cfg.hydra.launcher)
    jobs = sweep_jobs(fixed, sweeps, cfg)[:MAX_JOBS_CHECKED]
    for job in jobs:
        try:
            if config:
                job_cfg = checked(_compose_with(config, fixed + job)[0], [], world_size, builds=check_builds)
            else:
                job_cfg = load(fixed + job, world_size, builds=check_builds)
            try:
                folder = Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)
            except OmegaConfBaseException:  # named by what Hydra decides at launch (${hydra.job.num})
                continue  # not known yet: the job decides when it starts
            decision = folder_policy.decide(folder, job_cfg, job_of_sweep=True)  # and again when it starts
            if decision.action == "refuse":
                raise ConfigError(decision.reason)
        except ConfigError as error:
            label = " ".join(job) or "the defaults"
            raise ConfigError(f"the sweep's job {label}:\n{error}") from None
    if jobs_checked is not None:
        jobs_checked.append(len(jobs))
    return None


def sweep_jobs(fixed: list[str], sweeps, cfg) -> list[list[str]]:
    """The override lists of a sweep's jobs: the command line's sweeps with the study's
    ``hydra.sweeper.params`` (the command line wins for a key both name), as Hydra's sweeper expands them."""
    import itertools

    from effitrain.config.overrides import parse, values, with_value

    params = {
        o.key_or_group: o
        for o in parse(f"{k}={v}" for k, v in (cfg.hydra.sweeper.get("params") or {}).items())
    }
    fixed_keys = {o.key_or_group for o in parse(fixed)}
    params = {k: o for k, o in params.items() if k not in fixed_keys}
    params.update({o.key_or_group: o for o in sweeps})
    axes = []
    for override in params.values():
        choices = values(override)
        if choices is None:  # a glob: Hydra expands it, each job validates itself when it starts
            continue
        axes.append([with_value(override, choice) for choice in choices])
    return [list(job) for job in itertools.product(*axes)]


def share_run_dir_across_ranks(argv: list[str]) -> list[str]:
    """Under ``torchrun``/``accelerate launch``, give every rank rank 0's Hydra run folder.

    Hydra names the folder from the clock, and ranks start a moment apart: without this, two
    processes of one job could write to two folders. Returns the overrides to pass on.
    """
    import os

    from effitrain.config.overrides import parse

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "-m" in argv or "--multirun" in argv:
        return argv
    if any(o.key_or_group == "hydra.run.dir" for o in parse(a for a in argv if not a.startswith("-"))):
        return argv
    import time

    import torch.distributed as dist

    from effitrain.train.distributed import process_state

    process_state()  # joins the process group the launcher set up
    folder = [time.strftime("outputs/%Y-%m-%d/%H-%M-%S")]
    dist.broadcast_object_list(folder, src=0)
    return [*argv, f"hydra.run.dir={folder[0]}"]


def train(argv: list[str]) -> None:
    """``python train.py ARGS`` and ``effitrain train ARGS``: check, then hand over to Hydra."""
    import hydra

    from effitrain.config.registry import CONF_SOURCE

    held, argv, validated = check_overrides_or_exit(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from effitrain.config.compose import plain_open_overrides

    argv = share_run_dir_across_ranks(plain_open_overrides(argv))
    from effitrain.sweep.launcher import expose_launcher_plugin

    expose_launcher_plugin()
    # Hydra reads the command line from sys.argv; the config comes from the package effitrain.conf,
    # the checkout's conf/ or the copy inside an installed wheel
    sys.argv = [sys.argv[0], *argv]
    # what the front door validated is handed to the task: the run Hydra starts with that very
    # config does not validate it again (a sweep's jobs validate when they start, maybe hours later)
    from effitrain.config.load import identity

    handed = identity(validated, world_size) if validated is not None else None

    def task(cfg: DictConfig) -> float | None:
        return train_job(cfg, handed)

    with held:  # the run folder's lock, taken by the preflight, until Hydra's run is over
        hydra.main(version_base="1.3", config_path=CONF_SOURCE, config_name="config")(task)()


def resume_hint(cfg: DictConfig, folder: Path) -> str:
    """What an interrupted run's last line says of resuming: the command's own words with the folder
    (a rerun without ``hydra.run.dir`` starts anew in a folder of its own), or that there is nothing to
    resume from (``checkpoint_every`` is off by default)."""
    from effitrain.train.resume_point import list_checkpoints

    saved = list_checkpoints(folder)
    if saved:
        return (
            f"its newest checkpoint is step {saved[-1][0]}: resume with resume=auto hydra.run.dir='{folder}'"
        )
    why = "checkpoint_every is off" if not cfg.get("checkpoint_every") else "it stopped before its first one"
    return f"no checkpoint to resume from ({why}): a rerun starts over; checkpoint_every=N saves one every N steps"


def train_job(cfg: DictConfig, validated: str | None = None) -> float | None:
    """The Hydra task: run one job into Hydra's output folder; exit non-zero if it failed.
    ``validated``: the :func:`~effitrain.config.load.identity` of the config the front door validated.

    In a multirun a failed job returns instead, so the other jobs still run, and a job whose
    folder already holds an ok summary.json is skipped (``skip_ok_jobs``), so rerunning a sweep
    into its folder resumes it.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from effitrain.config.compose import with_hydra_node
    from effitrain.config.load import identity

    hydra_cfg = HydraConfig.get()  # the task is the one place that reads it: the run reads cfg.hydra
    cfg = with_hydra_node(cfg, hydra_cfg)  # the run derives and validates it (effitrain.run.recipe)
    if hydra_cfg.mode == RunMode.MULTIRUN:
        from effitrain.sweep.worker import start_job

        done = start_job(cfg, hydra_cfg)
        if done is not None:
            return done.get(cfg.get("optimized_metric", "eval/loss"))

    from effitrain.run.recipe import run

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    summary = run(cfg, hydra_cfg.runtime.output_dir, validated=validated == identity(cfg, world_size))
    if summary["status"] == "ok" and summary.get("env/rank", 0) == 0:
        from effitrain.config.model_spec import task_class
        from effitrain.config.summary_schema import learned_nothing

        task_keys = [metric.key for metric in task_class(cfg).metrics]  # what the task declares it writes
        task_metrics = "".join(f"{k} {summary[k]:.4f}  " for k in task_keys if k in summary)
        print(
            f"effitrain: ok: train/loss {summary['train/loss']:.4f}  eval/loss {summary['eval/loss']:.4f}  "
            f"{task_metrics}{summary['speed/samples_per_s']:.1f} samples/s  {summary['speed/wall_s']:.1f} s  "
            f"-> {hydra_cfg.runtime.output_dir}"
        )
        nothing = learned_nothing(summary)
        if nothing is not None:  # what compare's verdict would say, said by the run itself
            print(
                f"effitrain: note: learned nothing measurable: eval/loss {nothing[0]:.4f} is not below "
                f"{nothing[1]:.4f}, the loss of a prediction that ignores the input, beyond noise "
                "(eval/input_blind_loss, eval/loss_sem)"
            )
    if summary["status"] == "ok":
        return summary.get(cfg.get("optimized_metric", "eval/loss"))
    message = f"{summary['status']}: {summary['error']}"
    if summary["status"] == "interrupted":  # the shell's convention: 128 + the signal's number
        print(
            f"effitrain: error: {message}; {resume_hint(cfg, Path(hydra_cfg.runtime.output_dir))}",
            file=sys.stderr,
        )
        sys.exit(128 + summary["signal"])
    if hydra_cfg.mode == RunMode.MULTIRUN:
        print(f"effitrain: job {hydra_cfg.job.num} {message}", file=sys.stderr)
        from effitrain.run.results import read_summary

        kept = read_summary(Path(hydra_cfg.runtime.output_dir))
        if kept is not None and kept.get("status") == "ok":
            # the folder's ok summary.json stays (never overwritten by a failure): a launcher reading
            # the folder would take this job for ok, so the failure is raised to it instead
            raise ConfigError(summary["error"])
        return None
    fail(message, 2 if summary.get("error_type") == "config" else 1)
