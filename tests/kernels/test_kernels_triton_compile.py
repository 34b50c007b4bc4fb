"""Every Triton kernel compiles for a real GPU target (sm_90) without a GPU.

The interpreter runs kernels in numpy and checks none of the GPU compiler's
rules (dot shapes, layouts, shared memory). Triton can compile ahead of time
to a cubin with the ptxas shipped in its wheel, so this catches a kernel that
passes the interpreter tests but would not build on the device.

WHY a subprocess (this file run as a script): compilation needs Triton
imported without TRITON_INTERPRET, and a private compile cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support.triton_backend import compile_env, requires_nvidia_backend


REPO_ROOT = Path(__file__).resolve().parents[2]
# Pointer arguments whose element type does not follow the tensor dtype under test.
FIXED_POINTER_TYPES = {
    "query_start_ptr": "*i32",
    "seq_lens_ptr": "*i32",
    "block_tables_ptr": "*i32",
    "pos_ptr": "*i64",
    "slot_ptr": "*i64",
    "cache_ptr": "*fp32",
}
FLOAT_ARGS = {"eps", "scale_log2"}


def _compile(fn, dtype: str, constexprs: dict, num_warps: int = 4, num_stages: int = 2) -> int:
    """Compile `fn` for sm_90 -> shared memory bytes it needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = FIXED_POINTER_TYPES.get(name, f"*{dtype}")
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    return kernel.metadata.shared


def main() -> None:
    from trillium.kernels import triton_attention, triton_kv_cache, triton_pointwise

    attention = triton_attention._paged_attention_kernel
    # (dtype, head block, G_PAD, BLOCK_M): fp32 decode with GQA 4, bf16 prefill
    # at head_dim 128, fp16 at head_dim 8 (padded to a 16-wide dot).
    for dtype, block_d, g_pad, block_m in [("fp32", 64, 4, 16), ("bf16", 128, 1, 64), ("fp16", 16, 2, 64)]:
        consts = dict(
            BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // g_pad, G_PAD=g_pad, BLOCK_N=64, BLOCK_D=block_d,
            DOT_FP32=False, INPUT_PRECISION="ieee" if dtype == "fp32" else "tf32",
        )  # fmt: skip
        shared = _compile(attention, dtype, consts)
        assert shared <= 227 * 1024, f"attention {dtype}: {shared} B of shared memory"
    for dtype in ("fp32", "bf16"):
        _compile(triton_pointwise._rms_norm_kernel, dtype, dict(BLOCK=4096), num_stages=1)
        _compile(triton_pointwise._silu_and_mul_kernel, dtype, dict(BLOCK=1024), num_stages=1)
        _compile(triton_pointwise._rotary_kernel, dtype, dict(BLOCK_HQ=8, BLOCK_HK=4, BLOCK_HALF=32), num_stages=1)
        _compile(triton_kv_cache._write_kv_kernel, dtype, dict(BLOCK=512), num_stages=1)
    print("compiled")


@requires_nvidia_backend
def test_triton_kernels_compile_for_sm90(tmp_path: Path) -> None:
    env = compile_env(tmp_path, TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, __file__], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, (proc.stdout + proc.stderr)[-6000:]


if __name__ == "__main__":
    main()
