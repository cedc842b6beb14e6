"""`LLM(None, device="cpu")` (the embedded SmolLM2 on the CPU) in a fresh process: seconds to
import slipstream, then to build the engine.  Run from a tree, or with PYTHONPATH=<tree>
for another (A/B: alternate the trees in one shell loop; results in benchmarks/results/)."""
import time

t0 = time.monotonic()
import slipstream  # noqa: E402
from slipstream import LLM  # noqa: E402

t1 = time.monotonic()
LLM(None, device="cpu", max_model_len=256)
print(f"{slipstream.__file__.rsplit('/slipstream/', 1)[0]}: import {t1 - t0:.2f} s, "
      f"LLM(None) {time.monotonic() - t1:.2f} s")
