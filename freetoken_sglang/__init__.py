"""freetoken-sglang: serve Mixture-of-Experts models larger than GPU memory with SGLang.

Routed experts live in a host expert pool; a GPU expert cache shared by all MoE layers holds
the working set (the FreeToken paper, §3–4). Enabled with ``--enable-freetoken`` on
``python -m sglang.launch_server`` or ``sglang.Engine(enable_freetoken=True)``.
"""

import os as _os

__version__ = "0.1.0"

from freetoken_sglang.control import resize_cache  # noqa: E402,F401 - sglang.Engine resizes

# The repository keeps ``kernels/`` and ``patches/`` at its top level; installs map them to
# ``freetoken_sglang.kernels`` / ``freetoken_sglang.patches`` (pyproject's package-dir). When
# this package is imported straight from a checkout, resolve them there too.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "patches")) and all(
    _os.path.isfile(_os.path.join(_root, sub, "__init__.py")) for sub in ("kernels", "patches")
):
    __path__.append(_root)  # noqa: F821 - the package's own search path
