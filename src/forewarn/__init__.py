"""forewarn: see GPU and training failures coming, and checkpoint before they hit.

Parts (deployed separately): :mod:`forewarn.hook` inside training ranks,
:mod:`forewarn.agent` on every GPU node, :mod:`forewarn.collector` once per cluster,
:mod:`forewarn.models` for detectors and predictors. Records crossing process
boundaries live in :mod:`forewarn.wire`.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("forewarn")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
