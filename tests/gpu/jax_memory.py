"""JAX under a memory limit: it preallocates a fraction of what it is told the device has."""
import json

import jax
import jax.numpy as jnp

m = jax.random.normal(jax.random.PRNGKey(0), (2048, 2048))
result = {"dot_sum": float(jnp.dot(m, m).sum())}
stats = jax.devices()[0].memory_stats() or {}
result["bytes_limit_MiB"] = stats.get("bytes_limit", 0) >> 20
result["bytes_in_use_MiB"] = stats.get("bytes_in_use", 0) >> 20
print(json.dumps(result))
