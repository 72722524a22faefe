"""The SGLang plugin entry point (group ``sglang.srt.plugins``): registers FreeToken's hooks.

SGLang calls ``register`` in every process that loads plugins (the launcher, ``Engine``,
each scheduler), then applies the hooks with ``HookRegistry.apply_hooks``. SGLang only logs
a hook that fails to apply, so ``check_hooks_applied`` is called wherever
``--enable-freetoken`` takes effect, and raises instead of serving stock SGLang silently.
"""

from __future__ import annotations

import logging
from typing import List

logger = logging.getLogger(__name__)

_registered: List[str] = []


def register() -> None:
    """Register every hook of ``freetoken_sglang.patches`` with SGLang's HookRegistry."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from freetoken_sglang.patches import all_hooks

    if _registered:
        return
    for hook in all_hooks():
        HookRegistry.register(hook.target, hook.function, HookType(hook.kind))
        _registered.append(hook.target)


def check_hooks_applied() -> None:
    """Raise if any FreeToken hook is not in effect in this process.

    Raises:
        RuntimeError: naming the missing targets and the likely fix.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry

    from freetoken_sglang.patches import SGLANG_VERSION, all_hooks

    if not _registered:
        raise RuntimeError(
            "--enable-freetoken was given but the freetoken-sglang plugin was not loaded in "
            "this process; install freetoken-sglang (pip install -e .) and do not exclude "
            "it with SGLANG_PLUGINS"
        )
    missing = sorted({h.target for h in all_hooks()} - set(HookRegistry._patched))
    if missing:
        import sglang

        raise RuntimeError(
            f"--enable-freetoken: {len(missing)} FreeToken hook(s) did not apply to "
            f"sglang {sglang.__version__} (written for {SGLANG_VERSION}): {missing}"
        )
