"""Session 38, from the repository root: python benchmarks/results/h100-2026-12-07-s38/capped_model.py TRACE [policy_model.py flags]:
policy_model.py with the re-miss rule's forced fills capped at the call's q (reused misses take q's fills first, never more). A model, not a measurement."""
import inspect, sys, os
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from freetoken_sglang.cache import residency
src = inspect.getsource(residency.decide_reference)
old = "    rest = miss & ~forced\n"
assert src.count(old) == 1
src = src.replace(old, "    qcap = fill_count(miss.sum().int(), split)\n"
                       "    forced = forced & (torch.cumsum(forced.int(), 0) - 1 < qcap)\n" + old)
exec(src, residency.__dict__)
import policy_model
policy_model.decide_reference = residency.decide_reference
sys.exit(policy_model.main(sys.argv[1:]))
