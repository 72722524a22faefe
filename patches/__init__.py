"""Every hook FreeToken places into SGLang 0.5.17, one module per SGLang subsystem.

Installed as ``freetoken_sglang.patches``. Each module lists its hooks in ``HOOKS`` as
``Hook(target, function, kind)``, where ``target`` is the dotted SGLang symbol it wraps; the
plugin entry point (``freetoken_sglang.plugin``) registers them all with SGLang's
``HookRegistry``. No SGLang file is edited. Every hook is inert unless the process serves
with ``--enable-freetoken``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

SGLANG_VERSION = "0.5.17"


@dataclass(frozen=True)
class Hook:
    target: str  # dotted path of the SGLang symbol wrapped
    function: Callable
    kind: str  # "before" | "after" | "around" | "replace" (sglang HookType values)


def all_hooks() -> List[Hook]:
    """Every hook of every patch module, in registration order."""
    from freetoken_sglang.patches import (
        cuda_graph,
        engine,
        fused_moe,
        gdn_backend,
        http_server,
        metrics,
        model_loader,
        model_runner,
        moe_layer,
        radix_cache,
        schedule_policy,
        scheduler,
        server_args,
    )

    hooks: List[Hook] = []
    for module in (
        server_args,
        moe_layer,
        fused_moe,
        model_loader,
        model_runner,
        cuda_graph,
        scheduler,
        schedule_policy,
        radix_cache,
        gdn_backend,
        http_server,
        engine,
        metrics,
    ):
        hooks.extend(module.HOOKS)
    return hooks
