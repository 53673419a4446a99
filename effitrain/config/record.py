"""A run's config record: what a checkpoint and ``summary.json`` keep of the config to compare a later
run against (the keys that change the training trajectory, flattened), with a secret never in it.

Torch-free: the folder policy (:mod:`effitrain.run.folder_policy`) compares records before anything heavy
loads; a checkpoint (:mod:`effitrain.train.checkpoint`) writes the same record. Nothing here imports
beyond omegaconf and the override parser: W&B's logger and compare read it too.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from effitrain.config.overrides import is_invariant


def first_difference(now: dict, then: dict) -> tuple[str, object, object] | None:
    """The first key (sorted) whose value differs between two flat config records (as
    :func:`trajectory_config` makes them), as ``(key, now, then)``; None when they agree."""
    for key in sorted(set(now) | set(then)):
        if now.get(key) != then.get(key):
            return key, now.get(key), then.get(key)
    return None


def trajectory_config(cfg: DictConfig) -> dict:
    """The resolved config, flattened to ``a.b`` keys, without the keys a resumed run may change
    (``run_invariant_keys``, and Hydra's own node)."""
    may_change = {"hydra", *(cfg.get("run_invariant_keys") or [])}
    flat = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            flat[prefix[:-1]] = node

    for key in cfg:
        if key not in may_change:
            node = cfg[key]
            walk(OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node, f"{key}.")
    return {key: value for key, value in flat.items() if not is_invariant(key, may_change)}


def without_secret(value, secret: str | None):
    """``value`` with every string equal to or containing ``secret`` replaced, so the key is never
    written or logged (nested dicts and lists included)."""
    if not secret:
        return value
    if isinstance(value, dict):
        return {k: without_secret(v, secret) for k, v in value.items()}
    if isinstance(value, list):
        return [without_secret(v, secret) for v in value]
    if isinstance(value, str) and secret in value:
        return "<redacted>"
    return value
