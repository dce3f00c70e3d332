"""A JAX job for the elastic-memory measurement (tests/gpu/elastic.sh): GIB GiB of float32 in 1 GiB
arrays, each step multiplying every array in place (a jitted function that donates its input).
JAX runs with its defaults (it preallocates a share of the memory the device reports). Prints one
line per step with its time, then 'done' with the mean step time after the first; 'oom' and
status 3 on an out-of-memory error, status 4 when JAX did not start on the GPU. Usage:
elastic_jax.py GIB STEPS"""
import functools
import sys
import time

import jax
import jax.numpy as jnp

gib, steps = float(sys.argv[1]), int(sys.argv[2])
CHUNK = 1 << 30


@functools.partial(jax.jit, donate_argnums=0)
def scale(array):
    return array * 1.0001


# JAX falls back to the CPU when the GPU backend cannot start: that is a failure here, not a run.
if jax.default_backend() != "gpu":
    print(f"not on the GPU: JAX's backend is {jax.default_backend()}", flush=True)
    sys.exit(4)
try:
    start = time.time()
    arrays, left = [], int(gib * CHUNK)
    while left > 0:
        size = min(CHUNK, left)
        arrays.append(jnp.ones(size // 4, dtype=jnp.float32))
        left -= size
    jax.block_until_ready(arrays)
    stats = jax.devices()[0].memory_stats() or {}
    print(f"allocated {gib} GiB in {time.time() - start:.2f} s; JAX's bytes_limit "
          f"{stats.get('bytes_limit', 0) >> 20} MiB", flush=True)
    times = []
    for step in range(steps):
        began = time.time()
        for index, array in enumerate(arrays):
            arrays[index] = scale(array)
        jax.block_until_ready(arrays)
        times.append(time.time() - began)
        print(f"step {step} {times[-1]:.4f} s", flush=True)
    later = times[1:] or times
    print(f"done mean_after_first_s {sum(later) / len(later):.4f}", flush=True)
except Exception as error:  # JAX raises XlaRuntimeError (RESOURCE_EXHAUSTED) on out of memory.
    if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
        raise
    print("oom", str(error).splitlines()[0][:160], flush=True)
    sys.exit(3)
