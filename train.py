"""Train one configuration, or sweep many with ``-m``; results land in the Hydra run folder.

    python train.py                                  # MiniLM on drug reviews, AdamW, accelerate loop
    python train.py optimizer=adam8bit backend=trainer compile=on gradient_accumulation_steps=4
    python train.py -m optimizer=adamw,adafactor,adam8bit backend=trainer,accelerator

The same as ``effitrain train ...`` from an installed package. Bad overrides stop here with one
line and exit code 2, before Hydra writes anything; the job returns ``optimized_metric``
(eval/loss) so a Hydra sweeper can minimize it.
"""

import sys

from effitrain.commands.train_command import train
from effitrain.util.process_exit import run_then_end

if __name__ == "__main__":
    run_then_end(train, sys.argv[1:])
