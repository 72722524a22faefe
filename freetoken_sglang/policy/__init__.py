"""The decode miss policy: how a layer call's misses split between cache fills and the CPU, and the measured host rates it weighs (paper §3.2)."""
