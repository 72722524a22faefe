"""How one MoE layer call runs: one executor contract and the executors behind it (paper §3.1-3.2)."""
