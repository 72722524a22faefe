"""Hooks into SGLang 0.5.17's gated-DeltaNet attention backend
(``sglang.srt.layers.attention.linear.gdn_backend``): anchor states inside a prefill forward.

- ``GDNAttnBackend.forward_extend`` (around): when the forward in flight has anchor states to
  take (``anchors.inside.reserve``, set by ``patches/scheduler.py``), the stock call runs,
  then the state at each anchor is written into the anchor's mamba slot, from the kernel's
  chunk-start states or by replaying the layer's inputs (``anchors.inside.replay``).
  Otherwise the stock call alone.
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook


def forward_extend(original, self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    snaps = getattr(rt, "anchor_snaps", None) if rt is not None else None
    if not snaps or forward_batch.forward_mode.is_target_verify():
        return original(self, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    from freetoken_sglang.anchors import inside

    return inside.replay(self, original, layer, forward_batch, mixed_qkv, a, b, snaps, kwargs)


HOOKS = [
    Hook("sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend.forward_extend",
         forward_extend, "around"),
]
