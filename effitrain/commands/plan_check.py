"""``effitrain plan``'s best candidates checked once its search has ranked them: the best replayed in
full and alone (:func:`confirm`), and the top ones run for a few real steps (:func:`probe`,
``--probe-steps``)."""

from __future__ import annotations

from effitrain.config.load import apply_effective_batch_size


def confirm(row: dict, device: str) -> None:
    """Replay ``row``'s candidate in full, alone and uncached (as before traces were shared), and
    mark it ``confirmed_by_full_replay``.

    Raises:
        RuntimeError: the full replay's bytes differ from the plan's: a fault of the shared replay.
    """
    from effitrain.commands.estimate import estimate_memory
    from effitrain.config.compose import compose
    from effitrain.memory.trace_cache import TRACED_ALONE

    if row["trace_source"] == TRACED_ALONE:  # its figures are a full replay of its own already
        row["confirmed_by_full_replay"] = True
        return
    words, gpus = row["command"].split(), row.get("gpus", 1)  # python or torchrun ... train.py OVERRIDES
    cfg = compose(words[words.index("train.py") + 1 :])
    apply_effective_batch_size(cfg, gpus)
    [full] = estimate_memory(
        cfg, {row["optimizer"]: cfg.optimizer}, device=device, cache=False, share=False, world_size=gpus
    ).values()
    found = (full["step_peak_bytes"], full["run_peak_bytes"], full["run_peak"])
    planned = (row["step_peak_bytes_predicted"], row["run_peak_bytes_predicted"], row["run_peak_predicted"])
    if found != planned:
        raise RuntimeError(
            f"the full replay of the plan's best ({row['command']}) gives {found}, the plan {planned}"
        )
    row["confirmed_by_full_replay"] = True


def probe(rows: list[dict], overrides: list[str], steps: int, top: int = 3) -> list[dict]:
    """Run ``steps`` real optimizer steps of the ``top`` fitting candidates, each in a process of its
    own (:func:`effitrain.run.isolated.run_isolated`); rank them by the measured median step time (the
    others keep their order after them). A probe that fails (out of memory included) is recorded in
    its row's ``probe_status`` and the plan goes on."""
    from effitrain.run.isolated import run_isolated

    fitting = [r for r in rows if r["fits"] and r.get("gpus", 1) == 1][:top]  # probes run one process
    for row in fitting:
        summary = run_isolated([*row["command"].split()[2:], f"max_steps={steps}"])
        row["probe_status"] = summary["status"]
        row["step_s_measured"] = summary.get("speed/step_s_median") if summary["status"] == "ok" else None
        row["step_peak_bytes_measured"] = summary.get("mem/step_peak_bytes")
    measured = sorted((r for r in fitting if r.get("step_s_measured")), key=lambda r: r["step_s_measured"])
    return measured + [r for r in rows if r not in measured]
