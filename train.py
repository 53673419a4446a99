"""Train one configuration, or sweep many with ``-m``; results land in the Hydra run folder.

    python train.py                                  # MiniLM on drug reviews, AdamW, accelerate loop
    python train.py optimizer=adam8bit backend=trainer compile=on gradient_accumulation_steps=4
    python train.py -m optimizer=adamw,adafactor,adam8bit backend=trainer,accelerator

Returns ``eval/loss`` so a Hydra sweeper can minimize it.
"""

import sys

import hydra
from omegaconf import DictConfig

from effitrain.cli import check_overrides_or_exit, share_run_dir_across_ranks, train_job


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return train_job(cfg)


if __name__ == "__main__":
    check_overrides_or_exit(sys.argv[1:])
    sys.argv[1:] = share_run_dir_across_ranks(sys.argv[1:])
    main()
