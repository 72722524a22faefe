"""The ``GET /freetoken/stats`` document of one runtime (read off the hot path)."""

from __future__ import annotations

from typing import Dict


def prefill_stream_counts(rt) -> Dict[str, object]:
    """The ``prefill_stream`` object: layer calls served by the prefill
    executors (full-layer streaming and waves), experts sent over PCIe (``experts_streamed``,
    ``bytes_streamed``) or read from their LRU slots instead (``experts_reused``), the wave
    calls among them, ``wait_s``, the time the compute stream waited for a copy (CUDA
    timing events around each layer's wait, read here; on a CPU device, the copies' own
    time), and, with borrowed buffers, ``lru_evicted`` (LRU entries evicted to lend the
    buffers) and ``lru_seeded`` (streamed experts the buffers gave back to the LRU); with a
    CPU share (``--freetoken-prefill-cpu``), ``experts_cpu`` (non-resident experts the C
    executor ran instead of streaming them) and ``cpu_s`` (its wall time, s)."""
    out = dict(layer_calls=0, experts_streamed=0, experts_reused=0, wave_calls=0, wait_s=0.0,
               lru_evicted=0, lru_seeded=0, experts_cpu=0, cpu_s=0.0)
    for key, value in (getattr(rt, "stream_carry", None) or {}).items():  # before resizes
        if key in out and key != "cpu_s":  # (the CPU share's part outlives resizes)
            out[key] += value
    stream = rt.executors.get("stream")
    if stream is not None:
        s = stream.snapshot()
        for key in ("layer_calls", "experts_streamed", "experts_reused", "wait_s",
                    "lru_evicted", "lru_seeded", "experts_cpu"):
            out[key] += s[key]
    part = getattr(rt, "prefill_cpu_part", None)
    if part is not None:
        part.check()
        out["cpu_s"] += part.cpu_s
    waves = rt.executors.get("waves")
    if waves is not None:
        w = waves.snapshot()
        out["layer_calls"] += w["layer_calls"]
        out["wave_calls"] += w["layer_calls"]
        out["experts_streamed"] += w["experts_streamed"]
        out["experts_reused"] += w["experts_reused"]
    out["bytes_streamed"] = out["experts_streamed"] * rt.pool.expert_bytes
    return out


def stats_document(rt) -> Dict[str, object]:
    """Pool, cache, layout, backend, miss policy, bandwidths, the LRU counters (``decode`` and
    ``prefill`` phases count only layer calls that went through the LRU), ``prefill_stream``,
    the forwards seen per mode, the load report and the semantic ``anchors`` (None when off;
``anchors.states.AnchorStates.snapshot``) of the runtime ``rt``."""
    out: Dict[str, object] = {
        "family": rt.family,
        "num_moe_layers": len(rt.moe_layer_ids),
        "num_experts": rt.num_experts,
        "top_k": rt.top_k,
    }
    if rt.pool is not None:
        out["pool"] = {
            "experts": rt.pool.num_rows,
            "expert_bytes": rt.pool.expert_bytes,
            "bytes": rt.pool.nbytes,
            "pinned": rt.pool.pinned,
        }
    if rt.cache is not None:
        layout = rt.cache.layout
        out["cache"] = {
            "slots": rt.cache.num_slots,
            "lru_slots": layout.lru_slots,
            "prefill_buffer_slots": layout.buffers * rt.num_experts
            if layout.kind == "stream"
            else layout.buffer_rows,
            "prefill_buffers": ("borrowed" if layout.borrowed else "reserved")
            if layout.kind in ("stream", "waves")
            else None,
            "layout": layout.kind,
            "bytes": rt.cache.nbytes,
            "fill_mode": rt.cache.filler.mode if rt.cache.filler else None,
            "all_resident": rt.cache.all_resident,
            "configured_slots": rt.configured_slots,
            "resizes": rt.resizes,
            "last_resize": rt.last_resize,
            "resize_answers": {str(k): v for k, v in rt.resize_answers.items()},
            # the return rule's r (cache/residency.py); None without the rule
            "return_rate": rt.cache.residency.return_rate
            if rt.policy is not None and rt.policy.return_rule else None,
            # fills planned after their calls (the late fill) since the last reset
            "late_fills": int(rt.cache.residency.late.item()),
        }
    out["backend"] = rt.backend
    pol = rt.policy
    out["miss_policy"] = pol.name if pol else None
    out["admission"] = ("off" if pol is None or not pol.admission
                        else "useful" if pol.admit_useful else "reuse")
    out["fill_reused"] = ("off" if pol is None or not pol.fill_reused
                          else "valued" if pol.fill_reused_valued else "on")
    out["return_rule"] = "on" if pol is not None and pol.return_rule else "off"
    out["host_rates"] = pol.host_rates if pol is not None else "alone"
    out["late_fill"] = ("off" if pol is None or not pol.late_fill
                        else "all" if pol.late_all else "on")
    if rt.choice is not None:
        out["prefill_mode"] = {
            "mode": rt.choice.prefill,
            "stream_min_tokens": rt.choice.stream_min_rows,
        }
    ex = getattr(rt, "executor", None)
    out["cpu_executor"] = None if ex is None else {
        "isa": ex.isa, "threads": ex.num_threads,
        "tile_min_tokens": ex.tile_min if ex.tiled else None,
    }
    rule = getattr(rt, "prefill_cpu_rule", None)
    if rule is None:
        out["prefill_cpu"] = "off"
    elif rule.share is not None:
        out["prefill_cpu"] = {"share": rule.share, "rule": rule.describe()}
    else:
        out["prefill_cpu"] = {"share": None, "p_us": rule.p_us, "h0_us": rule.h0_us,
                              "g_us": rule.g_us, "rule": rule.describe()}
    if rt.bandwidth is not None:
        out["bandwidth"] = {
            "B_P": rt.bandwidth.b_p,
            "B_H": rt.bandwidth.b_h,
            "ratio": rt.bandwidth.ratio,
            "source": rt.bandwidth.source,
            "F_P_us": rt.bandwidth.f_p_us,
            "F_H_us": rt.bandwidth.f_h_us,
            "B_P_beside": rt.bandwidth.b_p_beside,
            "B_H_beside": rt.bandwidth.b_h_beside,
            # the q* split's q*/m (B_P/B_H, or B_P'/(B_P' + B_H') with the rates beside)
            "split_ratio": pol.decode_split.fill_ratio
            if pol is not None and pol.name == "qstar" else None,
        }
    if rt.counters is not None:
        out.update(rt.counters.snapshot())
    if rt.executors:
        out["prefill_stream"] = prefill_stream_counts(rt)
    out["forwards"] = dict(rt.forwards)
    replay = getattr(rt, "replay", None)  # benchmarks only: the routing is not the model's
    out["routing_replay"] = replay.snapshot() if replay is not None else None
    out["load"] = dict(rt.load_report)
    anchors = getattr(rt, "anchors", None)
    out["anchors"] = anchors.snapshot() if anchors is not None else None
    return out
