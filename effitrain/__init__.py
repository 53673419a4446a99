"""effitrain: Hydra-configured experiments for memory- and speed-efficient fine-tuning."""

from effitrain.assets import register_resolvers

__version__ = "0.1.0"

register_resolvers()
