"""effitrain's Hydra configs. Installed, this folder is the package ``effitrain.conf`` (a
package-dir mapping in pyproject.toml), which Hydra finds through the search path
``pkg://effitrain.conf`` in a checkout's editable install and in a wheel alike."""
