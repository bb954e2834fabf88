"""libgomp's settings (the OpenMP of the bundled ggml), made before it loads with libllama:
it reads them once, as it loads, so the package's import makes them."""

from __future__ import annotations

import os

# libgomp's idle threads spin this many times before they sleep (GOMP_SPINCOUNT). Its default,
# 300000, keeps the generator's second OpenMP thread spinning for milliseconds after a graph ran
# on two threads, on the core that the codec decoder takes for the next frame's decode: in the
# pipeline the decoder's pass took 54-59 ms a frame against 47-52 ms with 3000-30000 (RTF
# 0.92-0.96 against 0.87-0.92; docs/measurements.md); 10000 still bridges the gaps between the
# code predictor's passes (0 took it from 47 to 60 ms a frame).
OPENMP_SPIN_COUNT = 10000


def spin_openmp_briefly() -> None:
    """Set GOMP_SPINCOUNT to `OPENMP_SPIN_COUNT`, unless the environment sets it. libgomp reads
    it once, as it loads with the bundled ggml."""
    os.environ.setdefault("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))
