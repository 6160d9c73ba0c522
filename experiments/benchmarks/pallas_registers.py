"""The Pallas squaring kernels compiled for an H100/H200 (sm_90a) without a GPU: registers, spills.

    python -m experiments.benchmarks.pallas_registers [--json]

Each kernel of ``rope_lie/encodings/expm_pallas.py`` (the squarings, their forward-mode pairs
and the reverse-mode adjoint) on matrices of 4 x 4, 8 x 8 and 16 x 16 is lowered by Pallas's Triton
backend (its Triton IR captured from ``jax._src.pallas.triton.lowering``), compiled by the
``triton`` package to PTX and by its ``ptxas`` to sm_90a, which prints the registers a thread
uses and any spills: a kernel that spills keeps values in memory that were meant to stay in
registers (``expm_pallas.PALLAS_BLOCK_ELEMENTS``). A GPU compiles the same IR with XLA's own
Triton, which may allocate differently. Needs a jax that lowers Pallas's Triton kernels for
CUDA on a CPU-only process (0.10; 0.11 refuses without a GPU) and the ``triton`` package
(installed with PyTorch, the ``interop`` extra); without either it says so and exits 2. Run it
in a process of its own: importing triton's compiler beside other native libraries (a test
worker that had loaded PyTorch's) crashed the process.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tempfile

KERNELS = ("squarings", "pairs", "adjoint")
# Where Pallas lowers a kernel to Triton IR (a jax internal, captured here): its message when a
# jax has moved it.
NO_HOOK = "this jax has no jax._src.pallas.triton.lowering.lower_jaxpr_to_triton_module"
NO_PTXAS = "this triton package ships no ptxas"
SIDES = (4, 8, 16)  # matrix sides, a power of two each (smaller ones are padded to them)


def triton_ir(kernel: str, block_matrices: int = 45, h: int = 8) -> str:
    """The Triton IR (text) of one of ``KERNELS`` on `block_matrices` H x H matrices."""
    import jax
    import jax.numpy as jnp

    from rope_lie.encodings import expm_pallas

    try:
        from jax._src.pallas.triton import lowering

        original = lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"{NO_HOOK} ({e})") from e
    captured = []

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(str(result.module))
        return result

    s = jnp.zeros((block_matrices,), jnp.int32)
    r = jnp.zeros((block_matrices, h, h), jnp.float32)
    fns = {
        "squarings": lambda s, a, b: expm_pallas._pallas_squarings(False, s, a),
        "pairs": lambda s, a, b: expm_pallas._pallas_squarings(False, s, a, b),
        "adjoint": functools.partial(expm_pallas.squarings_adjoint, False),
    }
    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fns[kernel]).trace(s, r, r).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    if len(captured) != 1:
        raise RuntimeError(f"{kernel}: expected one Triton kernel, lowered {len(captured)}")
    return captured[0]


def ptxas_report(ir: str, arch: str = "sm_90a", num_warps: int = 4) -> dict:
    """Registers a thread, spill stores and loads (bytes) of `ir` compiled for `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        raise RuntimeError(f"{NO_PTXAS} ({ptxas})")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ir)
        capability = int(re.sub(r"\D", "", arch))
        compiled = triton.compile(
            path, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps}
        )
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = out.stdout + out.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas said nothing of registers or spills:\n{text}")
    return {
        "registers": int(registers.group(1)),
        "spill_stores": int(spills.group(1)),
        "spill_loads": int(spills.group(2)),
    }


def main(argv=None) -> int:
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)  # one JSON line of rows
    try:
        import triton  # noqa: F401
    except ImportError:
        print("needs the triton package (pip install triton, or the interop extra)")
        return 2
    try:
        irs = {(k, h): triton_ir(k, h=h) for h in SIDES for k in KERNELS}
    except RuntimeError as e:
        if NO_HOOK in str(e):
            print(e)
            return 2
        if "No supported GPU devices found" not in str(e):
            raise
        print(f"this jax lowers Pallas's Triton kernels for CUDA only beside a GPU: {e}")
        return 2
    rows = []
    for (kernel, h), ir in irs.items():
        try:
            rows.append({"kernel": kernel, "side": h} | ptxas_report(ir))
        except RuntimeError as e:
            if NO_PTXAS not in str(e):
                raise
            print(e)
            return 2
    if as_json:
        print(json.dumps(rows))
        return 0
    print("kernel     side  registers  spill stores  spill loads  (4 warps, sm_90a)")
    for r in rows:
        print(
            f"{r['kernel']:10s} {r['side']:4d}  {r['registers']:9d}  {r['spill_stores']:12d}  "
            f"{r['spill_loads']:11d}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
