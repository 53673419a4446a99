"""effitrain: Hydra-configured experiments for memory- and speed-efficient fine-tuning."""

from omegaconf import OmegaConf

from effitrain.assets import register_resolvers
from effitrain.config import micro_batch_for

__version__ = "0.1.0"

register_resolvers()

if not OmegaConf.has_resolver("effitrain.micro_batch"):
    OmegaConf.register_new_resolver("effitrain.micro_batch", micro_batch_for)
