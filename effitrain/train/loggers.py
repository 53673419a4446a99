"""Weights & Biases logging: one W&B run per job, the same keys as ``metrics.jsonl`` and ``summary.json``.

    python train.py                                   # logger=wandb: online with credentials, else offline
    python train.py logger.mode=disabled              # or logger=none: nothing goes to W&B
    python train.py -m optimizer=adamw,adafactor      # one W&B run per job, one group per sweep
    wandb sync multirun/<study>/<time>/wandb/offline-run-*  # upload an offline sweep later (printed at its end)
    wandb leet multirun/<study>/<time>/wandb          # browse it in the terminal, no account needed

:class:`WandbLogger` has the interface of :class:`MetricsFile` (metrics.jsonl) (``log_dict``,
``close``) plus ``finish(summary)``, so the shared step meter writes the same per-step records to
both. W&B is a side channel: when it cannot start or log, a warning is printed once and training
goes on; the run's result files never depend on it.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from effitrain.config.errors import invalid
from effitrain.config.record import without_secret
from effitrain.util.atomic import write_atomic
from effitrain.util.links import open_no_follow

log = logging.getLogger(__name__)

MODES = ("online", "offline", "disabled")
OFFLINE_MARKER = ".effitrain-wandb-offline"  # in a sweep's W&B folder once a job fell back to offline
_TAG_CHARS = 64  # W&B rejects longer tags


def plain(value):
    """JSON has no NaN: non-finite floats are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line half-written when a process was killed is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsFile:
    """The on-disk metric logger: one JSON line per ``log_dict`` call, flushed at once.

    The file is opened at the first line, not before, so a run that fails before training leaves
    an earlier run's file as it was. Lines of an earlier run are kept up to ``keep_through_step``
    (the step a resumed run continues from; 0 for a fresh start), so each step appears once.
    """

    def __init__(self, path: Path, keep_through_step: int = 0):
        self.path = path
        self.keep_through_step = keep_through_step
        self._handle = None

    def log_dict(self, payload: dict, step: int) -> None:
        if self._handle is None:
            kept = [r for r in read_metrics(self.path) if (r.get("step") or 0) <= self.keep_through_step]
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
            self._handle = open_no_follow(self.path, "a")  # a link planted since the start: refused
        self._handle.write(json.dumps({k: plain(v) for k, v in payload.items()}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def has_credentials() -> bool:
    """An API key in the environment, or a netrc entry for the W&B host (what ``wandb login`` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_mode(mode: str | None) -> str:
    """``logger.mode`` if set, else ``WANDB_MODE``, else online with credentials and offline without.

    Raises:
        ConfigError: ``logger.mode`` is not one of online, offline, disabled or null.
    """
    if mode is not None and mode not in MODES:
        raise invalid("logger.mode", mode, f"choose one of {', '.join(MODES)} or null (auto)")
    if mode is not None:
        return mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode in MODES:
        return env_mode
    if env_mode == "dryrun":  # wandb's old name for offline
        return "offline"
    return "online" if has_credentials() else "offline"


def group_name(sweep_dir: str | None) -> str | None:
    """A sweep's W&B group: its study and start time, the sweep folder's last two parts
    (``optimizers/2026-11-23_12-44-04``, ``2026-11-23/12-44-04`` for a plain ``-m``): short on a
    dashboard and the same on every machine. The full folder is in the run config
    (``job/sweep_dir``)."""
    if not sweep_dir:
        return None
    path = Path(sweep_dir)
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def offline_sync_hint(sweep_dir: str | Path) -> str | None:
    """The one line a sweep prints at its end when its jobs saved W&B runs offline: how to upload
    them all (None when there are none)."""
    folder = Path(sweep_dir) / "wandb"
    if not any(folder.glob("offline-run-*")):
        return None
    return f"effitrain: W&B runs saved offline; upload them with: wandb sync {folder}/offline-run-*"


def job_identity(output_dir: Path, cfg_keys: dict) -> dict:
    """Group, name, job type, tags and W&B folder of this job, from the summary's own ``cfg/*`` and
    ``job/*`` keys (see :func:`effitrain.run.summary_keys.summary_config_keys`): what
    :func:`wandb_destination` takes where the logger's config sets none.

    In a multirun the group is the sweep's study and start time (:func:`group_name`) and every
    job's W&B run lives in ``<sweep folder>/wandb``: one folder that ``wandb leet`` and ``wandb
    sync`` take whole (the sweep prints the sync command once at its end). A single
    run keeps its W&B run in its own output folder. The name is the short one
    (``adam8bit | trainer | ga4``); the full overrides are in the run's config.
    """
    from effitrain.config.overrides import parse
    from effitrain.config.registry import group_names

    sweep_dir = cfg_keys.get("job/sweep_dir")
    groups = set(group_names())
    # a swapped choice is a group override; the logger's own group says nothing about the run
    tags = [
        o.input_line.lstrip("+~")[:_TAG_CHARS]
        for o in parse(cfg_keys.get("job/overrides", []))
        if o.key_or_group in groups and o.key_or_group != "logger"
    ]
    return {
        "group": group_name(sweep_dir),
        "name": cfg_keys.get("job/name") or "defaults",
        "job_type": cfg_keys.get("cfg/backend") or "train",
        "tags": tags,
        "dir": sweep_dir or str(output_dir),
        "multirun": sweep_dir is not None,
    }


def wandb_destination(
    identity: dict,
    project: str | None = "effitrain",
    entity: str | None = None,
    group: str | None = None,
    name: str | None = None,
    job_type: str | None = None,
    tags=(),
) -> dict:
    """Where a job's W&B run goes (project, entity, group, name, job type, tags, folder), decided
    here only: the logger config's own value where it sets one, else the job's (``identity``:
    :func:`job_identity`). The run itself (:class:`WandbLogger`) and the summary's ``wandb/*`` keys
    (:func:`effitrain.run.summary_keys.wandb_keys`, what compare logs its table beside) both take
    it from here, so they cannot disagree."""
    return {
        "project": project,
        "entity": entity,
        "group": group or identity["group"],
        "name": name or identity["name"],
        "job_type": job_type or identity["job_type"],
        "tags": [str(t)[:_TAG_CHARS] for t in [*identity["tags"], *(tags or [])]],
        "dir": identity["dir"],
        "multirun": identity["multirun"],
    }


def run_config(cfg: DictConfig, cfg_keys: dict) -> dict:
    """The resolved run config as plain dicts and lists, plus the flat ``cfg/*`` keys of summary.json.

    Hydra's own node is left out: it holds the command line and Hydra's internals, not the run.
    """
    cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # a broken interpolation fails the run itself; the dashboard still gets the config
        config = OmegaConf.to_container(cfg, resolve=False)
    config.update(cfg_keys)
    return config


class WandbLogger:
    """One W&B run for one job; ``log_dict`` per optimizer step, ``finish(summary)`` at the end.

    Any failure of W&B (not installed, ``wandb.init`` raising, a log call raising) prints one
    warning and turns this logger into a no-op; it never raises into training.
    """

    def __init__(
        self,
        config: dict,
        identity: dict,
        mode: str | None = None,
        project: str = "effitrain",
        entity: str | None = None,
        group: str | None = None,
        tags=(),
        notes: str | None = None,
        name: str | None = None,
        job_type: str | None = None,
        init_timeout_s: float = 60.0,
    ):
        self.mode = resolve_mode(mode)
        self.run = None
        where = self._where = wandb_destination(identity, project, entity, group, name, job_type, tags)
        self._warned = False
        self._sync_hint = None  # an offline single run: how to upload it, said at its start and end
        if self.mode == "disabled":
            return
        try:
            import wandb
        except ImportError as error:
            self._warn(f"wandb cannot be imported ({error}); this run is not logged to W&B")
            return
        wandb_dir = Path(where["dir"])
        secret = os.environ.get("WANDB_API_KEY")
        init = {
            **{key: where[key] for key in ("project", "entity", "group", "name", "job_type", "tags")},
            "notes": notes,
            "config": config,
            "dir": str(wandb_dir),
            # one run per job: a run left open by an earlier job in this process is finished first
            "reinit": "finish_previous",
        }
        # the name too: Hydra resolves an override like +x=${oc.env:WANDB_API_KEY} in override_dirname
        init = {key: value if key == "dir" else without_secret(value, secret) for key, value in init.items()}
        # silent: the one line below replaces wandb's banner, which a sweep would print per job
        settings = {"silent": True, "init_timeout": init_timeout_s}
        modes = [self.mode] + (["offline"] if self.mode == "online" else [])
        # a sweep pays an unreachable server once: later jobs find the first one's note and start offline
        marker = wandb_dir / OFFLINE_MARKER
        if self.mode == "online" and where["multirun"] and marker.exists():
            print(f"effitrain: W&B: {marker.read_text().strip()}; this job starts offline", flush=True)
            modes = ["offline"]
        for attempt in modes:
            try:
                wandb_dir.mkdir(parents=True, exist_ok=True)
                self.run = wandb.init(mode=attempt, settings=wandb.Settings(**settings), **init)
                self.mode = attempt
                break
            except Exception as error:  # W&B unreachable or broken: the run goes on without it
                self._warn(f"wandb.init in {attempt} mode failed ({type(error).__name__}: {error})")
        if self.run is None:
            self._warn("this run is not logged to W&B")
            return
        if modes[0] == "online" and self.mode == "offline" and where["multirun"]:
            try:
                marker.write_text("an earlier job of this sweep could not reach the W&B server\n")
            except OSError:
                pass
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # the optimizer step is every chart's x-axis
        # the dashboard's run summaries: the best evaluation and the highest memory, not the last
        self.run.define_metric("eval/loss", step_metric="step", summary="min")
        self.run.define_metric("mem/current_bytes", step_metric="step", summary="max")
        if self.mode == "offline" and not where["multirun"]:
            # a sweep says it once for all its jobs, at its end (offline_sync_hint); a run at its
            # start and again as it finishes, where it does not scroll away
            target = self.run.settings.sync_dir
            self._sync_hint = f"effitrain: W&B run saved offline; upload it later with: wandb sync {target}"
            print(self._sync_hint, flush=True)

    def identity_keys(self) -> dict:
        """Where this job's W&B run went, for summary.json: compare logs its table there too."""
        run = self.run
        return {
            "wandb/project": self._where["project"],
            "wandb/entity": (run.entity if run is not None else None) or self._where["entity"],
            "wandb/group": self._where["group"],
            "wandb/mode": self.mode if run is not None else "disabled",
            "wandb/run_id": run.id if run is not None else None,
        }

    def _warn(self, message: str) -> None:
        if not self._warned:
            print(f"effitrain: warning: W&B: {message}", file=sys.stderr, flush=True)
            self._warned = True

    def log_dict(self, payload: dict, step: int) -> None:
        # ``step`` is also in the payload, and define_metric made it the x-axis; W&B's own _step
        # only counts calls, so it never rejects a record (e.g. after a resume)
        if self.run is None:
            return
        try:
            self.run.log(dict(payload))
        except Exception as error:
            self._warn(f"logging failed ({type(error).__name__}: {error}); no more W&B logging for this run")
            self.run = None

    def finish(self, summary: dict | None) -> None:
        """Copy ``summary`` into the run's summary and finish it: exit code 0 for ok, 1 otherwise.

        The non-zero code is what makes the dashboard show a failed job as crashed. Without a
        summary the job never got to one, which is a failure too.
        """
        run, self.run = self.run, None
        if run is None:
            return
        ok = bool(summary) and summary.get("status") == "ok"
        try:
            if summary:
                secret = os.environ.get("WANDB_API_KEY")
                run.summary.update(without_secret({k: plain(v) for k, v in summary.items()}, secret))
            run.finish(exit_code=0 if ok else 1)
        except Exception as error:
            self._warn(f"finishing the run failed ({type(error).__name__}: {error})")
        if self._sync_hint and summary is not None:
            print(self._sync_hint, flush=True)

    def close(self) -> None:
        self.finish(None)


def build_tracker(cfg: DictConfig, output_dir: Path, cfg_keys: dict):
    """The experiment logger the ``logger`` group chose, or None (``logger=none``).

    Raises:
        ConfigError: an invalid ``logger.mode``.
    """
    node = cfg.get("logger")
    if node is None or not node.get("_target_"):
        return None
    from hydra.utils import instantiate

    # partial: the run's config and identity are passed as plain Python objects, never merged
    # into (and re-interpolated by) OmegaConf
    start = instantiate(node, _partial_=True, _convert_="all")
    return start(run_config(cfg, cfg_keys), job_identity(output_dir, cfg_keys))
