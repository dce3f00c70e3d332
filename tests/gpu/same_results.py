"""Deterministic computations whose results must not change under the hook.
Usage: same_results.py torch|jax|cupy  -> prints one JSON line of checksums."""
import json
import sys

framework = sys.argv[1]
result = {"framework": framework}
if framework == "torch":
    import torch

    torch.manual_seed(0)
    a = torch.randn(2048, 2048, device="cuda")
    result["gemm_sum"] = float((a @ a).double().sum())
    x = torch.ones(1 << 16, device="cuda")
    for _ in range(1000):
        x.mul_(1.0001)
    result["small_loop_sum"] = float(x.double().sum())
    free, total = torch.cuda.mem_get_info()
    result["mem_total_MiB"] = total >> 20
elif framework == "jax":
    import jax
    import jax.numpy as jnp

    m = jax.random.normal(jax.random.PRNGKey(0), (1024, 1024))
    result["dot_sum"] = float(jnp.dot(m, m).sum())
    result["devices"] = [str(d) for d in jax.devices()]
elif framework == "cupy":
    import cupy as cp

    cp.random.seed(0)
    m = cp.random.rand(1024, 1024)
    result["matmul_sum"] = float((m @ m).sum())
    kernel = cp.ElementwiseKernel("float64 x", "float64 y", "y = x * 2 + 1", "affine")
    result["kernel_sum"] = float(kernel(m).sum())
print(json.dumps(result, sort_keys=True))
