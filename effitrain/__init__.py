"""effitrain: Hydra-configured experiments for memory- and speed-efficient fine-tuning."""

import logging
from importlib import metadata

from effitrain import assets, overrides, schema

try:
    __version__ = metadata.version("effitrain")
except metadata.PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0.0.0+unknown"

assets.register_resolvers()
overrides.register_resolvers()
schema.register()  # conf/config.yaml's defaults start with it

# bitsandbytes warns on every import that its optional 4-bit CPU kernels are missing; effitrain
# never uses 4-bit layers, so the line is noise in every job's log.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "gemm_4bit_forward" not in record.getMessage()
)
