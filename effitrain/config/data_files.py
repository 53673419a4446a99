"""The data files a config names (``data.load_args.data_files``), checked from their heads before
anything loads: they exist, their CSV headers agree and hold the configured columns, the splits used
are not empty."""

from __future__ import annotations

import os

from omegaconf import DictConfig

from effitrain.config.errors import invalid
from effitrain.config.model_spec import task_class


def check_data_files(cfg: DictConfig) -> None:
    """Local files named by ``data.load_args.data_files``: they exist, CSV headers agree and hold the
    configured columns, and the splits used are not empty. Read from the files' heads, cheaply."""
    import csv
    import glob

    from omegaconf import OmegaConf

    load_args = cfg.data.get("load_args")
    if not load_args or "data_files" not in load_args:
        return
    files = OmegaConf.to_container(load_args.data_files, resolve=True)
    if isinstance(files, (str, list)):
        files = {"train": files}
    headers = {}
    for split, paths in files.items():
        for pattern in [paths] if isinstance(paths, str) else paths:
            if "://" in str(pattern):
                continue
            matches = glob.glob(os.path.expanduser(str(pattern)))
            if not matches:
                raise invalid(f"data.load_args.data_files.{split}", pattern, "no such file")
            for path in matches:
                if os.path.isdir(path):
                    where = f"data.load_args.data_files.{split}"
                    raise invalid(
                        where, pattern, f"{path} is a folder: give a file, or a glob such as {path}/*.csv"
                    )
                if load_args.get("path") == "csv" and path.endswith(".csv"):
                    with open(path, newline="") as handle:
                        rows = csv.reader(handle)
                        header = next(rows, [])
                        empty = next(rows, None) is None
                    headers[path] = header
                    used = (cfg.data.get("train_split"), cfg.data.get("eval_split"))
                    if empty and split in used:
                        raise invalid(f"data.load_args.data_files.{split}", path, "the file holds no rows")
    distinct = {tuple(h) for h in headers.values()}
    if len(distinct) > 1:
        listing = "; ".join(f"{p}: {','.join(h)}" for p, h in headers.items())
        raise invalid("data.load_args.data_files", "...", f"the CSV files' columns differ ({listing})")
    read = ("text_column", "label_column") if task_class(cfg).uses_labels else ("text_column",)
    for header in distinct:
        for key in read:
            column = cfg.data.get(key)
            if column and column not in header:
                raise invalid(f"data.{key}", column, f"no such column: choose one of {', '.join(header)}")
