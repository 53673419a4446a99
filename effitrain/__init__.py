"""effitrain: Hydra-configured experiments for memory- and speed-efficient fine-tuning."""

from importlib import metadata

from effitrain.config import overrides, schema
from effitrain.util import assets, logs

try:
    __version__ = metadata.version("effitrain")
except metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0.0.0+unknown"

assets.register_resolvers()
overrides.register_resolvers()
schema.register()  # conf/config.yaml's defaults start with it

logs.quiet_library_noise()  # bitsandbytes' kernels warning, transformers' coloured load report
