"""Benchmark 1: LieRE rotations R(p) = expm(sum_a p_a G_a) at ViT-B/16 shapes, one layer.

197 tokens (14 x 14 patches, sequential positions in [0, 1], class token at 0) x 12 heads,
head_dim 64, generators from ``liere.init`` (entries U[0, 2*pi), the reference init), dense
(b = 64) and blocks of 8 and 2. Every implementation maps the same (generators, positions) to
rotations, so fwd+bwd is the gradient of sum(w * R) with respect to the raw generators:

- ours: ``liere.rotations`` (``expm_combination.expm_skew_combination``; closed form for b = 2);
- ours, expm_skew: ``expm.expm_skew`` of the formed exponents sum_a p_a G_a;
- jax.scipy: ``jax.scipy.linalg.expm`` of the formed exponents, under jit;
- torch: ``torch.linalg.matrix_exp`` of the formed exponents (float32, CPU).

The implementations of one (block size, mode) are timed round-robin. Accuracy: max |R - R_f64|
over 48 random (token, head, block) matrices against scipy's float64 expm, and max |R^T R - I|
over all of them. ``accuracy_over_norms`` sweeps the Frobenius norm of random skew-symmetric 64
x 64 matrices from 1e-3 to 1e4."""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from experiments.benchmarks import common
from rope_lie.encodings import expm, expm_combination, lie, liere, positions

HEADS, HEAD_DIM, GRID = 12, 64, (14, 14)
IMPLS = ("ours", "ours_expm_skew", "jax_scipy", "torch")


def make_inputs(block: int, seed: int = 0):
    """Raw generators (A, N, K, b, b), positions (T, 2) and a cotangent (T, N, K, b, b)."""
    params = liere.init(
        jax.random.key(seed),
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        num_axes=2,
        block_size=None if block == HEAD_DIM else block,
    )
    pos = positions.grid_positions(GRID, "sequential", num_prefix=1, train_grid=GRID)
    gen = np.asarray(params["gen_ANKbb"])
    w = np.random.default_rng(seed).normal(size=(pos.shape[0], *gen.shape[1:])).astype(np.float32)
    return gen, np.asarray(pos, np.float32), w


def _exponents(gen, pos):
    return jnp.einsum("TA,ANKij->TNKij", pos, lie.skew_from_upper(gen), precision="highest")


_JAX_FORWARD = {
    "ours": lambda gen, pos: liere.rotations({"gen_ANKbb": gen}, pos),
    "ours_expm_skew": lambda gen, pos: expm.expm_skew(_exponents(gen, pos)),
    "jax_scipy": lambda gen, pos: jax.scipy.linalg.expm(_exponents(gen, pos)),
}


def jax_fn(impl: str, mode: str):
    """The jitted forward (gen, pos) -> R, or fwd+bwd (gen, pos, w) -> dL/dgen."""
    forward = _JAX_FORWARD[impl]
    if mode == "fwd":
        return jax.jit(forward)
    return jax.jit(jax.grad(lambda gen, pos, w: jnp.sum(w * forward(gen, pos))))


def torch_fn(mode: str):
    """torch.linalg.matrix_exp of the formed exponents, forward or fwd+bwd."""
    torch = common.maybe_torch()

    def forward(gen, pos):
        upper = torch.triu(gen, diagonal=1)
        skew = upper - upper.transpose(-1, -2)
        return torch.linalg.matrix_exp(torch.einsum("ta,anKij->tnKij", pos, skew))

    if mode == "fwd":
        return lambda gen, pos: forward(gen, pos)

    def fwd_bwd(gen, pos, w):
        gen = gen.detach().requires_grad_(True)
        (forward(gen, pos) * w).sum().backward()
        return gen.grad

    return fwd_bwd


def _args(impl: str, mode: str, gen, pos, w):
    if impl == "torch":
        torch = common.maybe_torch()
        gen, pos, w = (torch.from_numpy(np.array(x)) for x in (gen, pos, w))
    else:
        gen, pos, w = (jnp.asarray(x) for x in (gen, pos, w))
    return (gen, pos) if mode == "fwd" else (gen, pos, w)


def _fn(impl: str, mode: str):
    return torch_fn(mode) if impl == "torch" else jax_fn(impl, mode)


def accuracy(r, gen, pos, seed: int = 1) -> dict[str, float]:
    """max |R - R_f64| on 48 random matrices, max |R^T R - I| on all."""
    r = np.asarray(r, np.float64)
    b = r.shape[-1]
    flat = r.reshape(-1, b, b)
    a64 = np.einsum(
        "TA,ANKij->TNKij", pos.astype(np.float64), np.asarray(lie.skew_from_upper(gen), np.float64)
    ).reshape(-1, b, b)
    idx = np.random.default_rng(seed).choice(len(flat), size=min(48, len(flat)), replace=False)
    err = max(np.abs(flat[i] - scipy.linalg.expm(a64[i])).max() for i in idx)
    ortho = np.abs(np.swapaxes(flat, -1, -2) @ flat - np.eye(b)).max()
    return {"max_abs_err": float(err), "max_orthogonality_err": float(ortho)}


def memory_child(case: dict) -> dict:
    """In a fresh process: peak RSS growth while the first calls run (after compilation, so
    that the allocators start empty) and, for JAX, XLA's buffer sizes."""
    gen, pos, w = make_inputs(case["block"])
    args = _args(case["impl"], case["mode"], gen, pos, w)
    out = {}
    if case["impl"] == "torch":
        fn = torch_fn(case["mode"])
    else:
        fn = jax_fn(case["impl"], case["mode"]).lower(*args).compile()
        out["xla"] = common.xla_memory(fn)
    out["rss_peak_growth_bytes"] = common.peak_rss_growth(lambda: fn(*args))
    return out


def run(quick: bool = False) -> dict:
    """Time, accuracy and memory of every implementation, dense and blocks of 8 and 2."""
    torch = common.maybe_torch()
    impls = [i for i in IMPLS if i != "torch" or torch is not None]
    blocks = (64, 8) if quick else (64, 8, 2)
    repeats = 3 if quick else 5
    results = {"load_before": common.machine()["loadavg_1_5_15"], "cases": [], "notes": []}
    if torch is None:
        results["notes"].append("torch not importable: torch.matrix_exp skipped")
    for block in blocks:
        gen, pos, w = make_inputs(block)
        for mode in ("fwd", "fwd_bwd"):
            here = [
                impl
                for impl in impls
                # jax.scipy fwd+bwd dense: about 3 s per call, full runs only
                if not (quick and impl == "jax_scipy" and mode == "fwd_bwd" and block == 64)
            ]
            args = {impl: _args(impl, mode, gen, pos, w) for impl in here}
            fns = {impl: _fn(impl, mode) for impl in here}
            times = common.timeit_interleaved(
                {impl: functools.partial(fns[impl], *args[impl]) for impl in here}, repeats
            )
            for impl in here:
                case = {"block": block, "mode": mode, "impl": impl, "time": times[impl]}
                if mode == "fwd":
                    out = fns[impl](*args[impl])
                    out = out.numpy() if impl == "torch" else out
                    case["accuracy"] = accuracy(out, gen, pos)
                if not quick:
                    case["memory"] = common.run_child(
                        "experiments.benchmarks.rotations", {**case, "time": None}
                    )
                results["cases"].append(case)
                print(
                    f"  rotations b={block} {mode} {impl}: {common.fmt_time(case['time'])} ms",
                    flush=True,
                )
    results["accuracy_over_norms"] = accuracy_over_norms(quick)
    results["load_after"] = common.machine()["loadavg_1_5_15"]
    return results


def accuracy_over_norms(quick: bool = False) -> list[dict]:
    """max |R - R_f64| and max |R^T R - I| of 16 random skew 64 x 64 matrices per norm."""
    torch = common.maybe_torch()
    norms = (1e-3, 1.0, 1e2, 1e3, 1e4) if quick else (1e-3, 1e-2, 1e-1, 1.0, 10.0, 1e2, 1e3, 1e4)
    rng = np.random.default_rng(2)
    rows = []
    for norm in norms:
        x = rng.normal(size=(16, HEAD_DIM, HEAD_DIM))
        a = x - np.swapaxes(x, -1, -2)
        a = (a / np.linalg.norm(a, axis=(-2, -1), keepdims=True) * norm).astype(np.float32)
        ref = np.stack([scipy.linalg.expm(m) for m in a.astype(np.float64)])
        outs = {
            "ours": expm_combination.expm_skew_combination(np.ones((1, 1), np.float32), a[None])[0],
            "ours_expm_skew": expm.expm_skew(a),
            "jax_scipy": jax.jit(jax.scipy.linalg.expm)(a),
        }
        if torch is not None:
            outs["torch"] = torch.linalg.matrix_exp(torch.from_numpy(a)).numpy()
        for impl, r in outs.items():
            r = np.asarray(r, np.float64)
            rows.append(
                {
                    "norm": norm,
                    "impl": impl,
                    "max_abs_err": float(np.abs(r - ref).max()),
                    "max_orthogonality_err": float(
                        np.abs(np.swapaxes(r, -1, -2) @ r - np.eye(HEAD_DIM)).max()
                    ),
                    "finite": bool(np.isfinite(r).all()),
                }
            )
    return rows


def table(results: dict) -> None:
    """Print times, ratios against jax.scipy and torch in the same run, accuracy, memory."""
    cases = {(c["block"], c["mode"], c["impl"]): c for c in results["cases"]}
    rows = []
    for (block, mode, impl), c in cases.items():
        jsp, torch = cases.get((block, mode, "jax_scipy")), cases.get((block, mode, "torch"))
        acc, mem = c.get("accuracy", {}), c.get("memory", {})
        rows.append(
            [
                block,
                mode,
                impl,
                common.fmt_time(c["time"]),
                common.fmt_ratio(common.ratio(jsp and jsp["time"], c["time"])),
                common.fmt_ratio(common.ratio(torch and torch["time"], c["time"])),
                f"{acc['max_abs_err']:.1e}" if acc else "-",
                f"{acc['max_orthogonality_err']:.1e}" if acc else "-",
                f"{mem['rss_peak_growth_bytes'] / 2**20:.0f}"
                if "rss_peak_growth_bytes" in mem
                else "-",
                f"{mem['xla']['temp_bytes'] / 2**20:.0f}" if mem.get("xla") else "-",
            ]
        )
    common.print_table(
        "1. LieRE rotations, ViT-B/16 one layer (197 tokens x 12 heads, head_dim 64)",
        [
            "b",
            "mode",
            "impl",
            "ms min / median",
            "jax.scipy / it",
            "torch / it",
            "max|R-R64|",
            "max|RtR-I|",
            "RSS peak MiB",
            "XLA temp MiB",
        ],
        rows,
    )
    rows = [
        [
            r["norm"],
            r["impl"],
            f"{r['max_abs_err']:.1e}",
            f"{r['max_orthogonality_err']:.1e}",
            r["finite"],
        ]
        for r in results["accuracy_over_norms"]
    ]
    common.print_table(
        "1b. Accuracy over norms (16 random skew 64 x 64 matrices, Frobenius norm)",
        ["norm", "impl", "max|R-R64|", "max|RtR-I|", "finite"],
        rows,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", help="internal: one memory case as JSON")
    parser.add_argument("--quick", action="store_true")
    flags = parser.parse_args()
    if flags.child:
        print(json.dumps(memory_child(json.loads(flags.child))))
    else:
        table(run(flags.quick))
