"""freetoken-sglang: serve Mixture-of-Experts models larger than GPU memory with SGLang.

Routed experts live in a host expert pool; a GPU expert cache shared by all MoE layers holds
the working set (the FreeToken paper, §3–4). Enabled with ``--enable-freetoken`` on
``python -m sglang.launch_server`` or ``sglang.Engine(enable_freetoken=True)``.
"""

__version__ = "0.1.0"
