"""experiments/benchmarks: the measuring helpers the reported numbers rest on (the benchmarks
themselves are not tests: they take minutes and print ratios)."""

import time

import numpy as np
import pytest

from experiments.benchmarks import common, rotations


def test_timeit_interleaved_varies_the_order_and_keeps_every_time():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = common.timeit_interleaved(fns, repeats=3)
    # One warm-up each, then Williams rows: abc, its mirror cba, then bca.
    assert calls == list("abc") + list("abc") + list("cba") + list("bca")
    assert set(times) == set("abc")
    assert all(t["repeats"] == 3 and 0 <= t["min_s"] <= t["median_s"] for t in times.values())


def _predecessors(orders):
    """{(before, after): times} of the functions called one right after the other in a round."""
    pairs = {}
    for order in orders:
        for before, after in zip(order, order[1:], strict=False):
            pairs[before, after] = pairs.get((before, after), 0) + 1
    return pairs


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 12])
def test_round_orders_give_every_function_every_predecessor_and_position(n):
    full = n if n % 2 == 0 else 2 * n
    orders = common.round_orders(n, full)
    assert all(sorted(order) == list(range(n)) for order in orders)
    for position in range(n):  # every function in every position, equally often
        assert sorted(order[position] for order in orders) == sorted(list(range(n)) * (full // n))
    pairs = _predecessors(orders)
    assert pairs == {(a, b): full // n for a in range(n) for b in range(n) if a != b}


def test_round_orders_with_fewer_rounds_than_functions_never_repeat_a_predecessor():
    """model_steps times 6 train steps in 5 rounds and 15 eval calls in 5."""
    for n, rounds in [(6, 5), (15, 5), (12, 5), (4, 3)]:
        pairs = _predecessors(common.round_orders(n, rounds))
        most = 1 if n % 2 == 0 else 2
        assert max(pairs.values()) <= most, (n, rounds)


class FakeClock:
    """A clock that moves only when told: the timers are tested without measuring anything."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_timeit_interleaved_times_each_call_on_the_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(common, "time", clock)
    times = common.timeit_interleaved(
        {"fast": lambda: clock.sleep(0.001), "slow": lambda: clock.sleep(0.02)}, repeats=2
    )
    assert times["slow"]["min_s"] == pytest.approx(0.02)
    assert times["fast"]["median_s"] == pytest.approx(0.001)
    assert common.ratio(times["slow"], times["fast"])["min_s"] == pytest.approx(20.0)


def test_peak_rss_growth_sees_a_transient_allocation():
    size = 256 * 2**20

    def allocate():
        x = np.ones(size // 8)  # touched: resident, freed on return
        time.sleep(0.02)
        return x.sum()

    growth = common.peak_rss_growth(allocate, min_seconds=0.05)
    assert 0.8 * size < growth < 2 * size, growth
    assert common.peak_rss_growth(lambda: None, min_seconds=0.05) < 32 * 2**20


def test_rotation_accuracy_flags_a_wrong_exponential():
    gen, pos, _ = rotations.make_inputs(block=2)
    good = rotations._JAX_FORWARD["ours"](gen, pos)
    assert rotations.accuracy(good, gen, pos)["max_abs_err"] < 1e-5
    bad = np.asarray(good).copy()
    bad[..., 0, 0] += 1e-2
    assert rotations.accuracy(bad, gen, pos)["max_abs_err"] == pytest.approx(1e-2, rel=1e-3)


def test_timeit_alternating_pauses_before_every_call_and_rotates(monkeypatch):
    from experiments.benchmarks import vs_pytorch

    clock, stamps = FakeClock(), []
    monkeypatch.setattr(vs_pytorch, "time", clock)

    def call(name):
        stamps.append((name, clock.now))
        clock.sleep(0.005)

    fns = {name: (lambda name=name: call(name)) for name in "ab"}
    times = vs_pytorch.timeit_alternating(fns, repeats=2, pause=0.03)
    names = [n for n, _ in stamps]
    assert names == list("aabb") + list("ab") + list("ba")  # two warm-ups each, then rounds
    timed = [t for _, t in stamps[4:]]
    np.testing.assert_allclose(np.diff(timed), 0.03 + 0.005)  # a pause before every call
    assert set(times) == {"a", "b"} and all(t["repeats"] == 2 for t in times.values())
    # the pause is idle time before the clock starts, not part of the measured call
    assert all(t["median_s"] == pytest.approx(0.005) for t in times.values())


def test_profile_summary_sums_ops_per_thread_kind_and_operation():
    from experiments.benchmarks import profile_step

    hlo = (
        "  %dot.40 = f32[2]{0} dot(%a, %b), "
        'metadata={op_name="jit(step)/jvp(BTNH,BSNH->BNTS)/dot_general"}\n'
        "  ROOT %ynn_fusion.12 = f32[2]{0} fusion(%x), "
        'metadata={op_name="jit(step)/blocks.3/reduce_max"}\n'
        "  %copy.1 = f32[2]{0} copy(%y)\n"
    )
    names = profile_step.op_names(hlo)
    assert names == {
        "dot.40": "jvp(BTNH,BSNH->BNTS)/dot_general",
        "ynn_fusion.12": "blocks.#/reduce_max",
        "copy.1": "",
    }
    events = [
        {"name": "dot.40", "dur": 4000, "tid": 1},
        {"name": "ynn_fusion.12", "dur": 2000, "tid": 2},
        {"name": "ynn_fusion.12", "dur": 2000, "tid": 1},
    ]
    out = profile_step.summarise(events, names, steps=2)
    assert out["threads_ms"] == [3.0, 1.0] and out["total_ms"] == 4.0
    assert dict(out["kinds_ms"]) == {"dot": 2.0, "ynn_fusion": 2.0}
    assert dict(out["op_names_ms"])["blocks.#/reduce_max"] == 2.0


def test_cayley_speed_rows_give_epochs_per_image_times_and_ratios_of_the_same_run():
    from experiments.benchmarks import cayley_speed

    names = [name for name, _, _ in cayley_speed.cases()]
    assert names == [
        "dense/folded",
        "dense/per_token",
        "block2x2/folded",
        "block2x2/per_token",
        "banded/folded",
        "banded/per_token",
        "topk/folded",
        "topk/per_token",
        "rope_mixed",
    ]
    train = {n: {"min_s": 0.1, "median_s": 0.1} for n in names}
    infer = {n: {"min_s": 0.512, "median_s": 0.6} for n in names}
    train["dense/per_token"] = {"min_s": 0.3, "median_s": 0.3}
    results = {
        "train": train,
        "infer": infer,
        "params": dict.fromkeys(names, 1234),
        "shapes": {"train_batch": 128, "eval_batch": 256, "repeats": 2},
    }
    rows = {row[0]: row for row in cayley_speed.rows(results)}
    # 469 steps of 128 for 60,000 images; 0.512 s / 256 images = 2 ms per image.
    assert rows["dense/folded"][1:5] == ["1,234", "46.9", "2.000", "1.00 / 1.00"]
    assert rows["dense/per_token"][2] == "140.7"
    assert rows["dense/per_token"][4:] == ["3.00 / 1.00", "3.00 / 1.00"]
    assert rows["dense/folded"][5] == rows["rope_mixed"][5] == "-"


def test_device_benchmark_counts_the_same_flops_on_the_cpu():
    """device.py's MFU for accelerators whose cost analysis counts no FLOPs: the train step
    lowered for one CPU device counts what the timed step's own lowering counts (here both run
    on the CPU), and more for a larger batch."""
    from experiments.benchmarks import device

    config = device.make_config("rope_mixed", "xla", "float32", "pico")
    config.model.image_shape = (32, 32)
    row = device.time_step(config, batch=4, steps=1)
    assert row["xla_flops"] > 0
    assert device.cpu_lowered_flops(config, 4) == row["xla_flops"]
    assert device.cpu_lowered_flops(config, 8) > 1.5 * row["xla_flops"]


def test_matmul_train_flops_by_hand_is_xla_count_less_the_elementwise_work():
    """The hand count of the device queue's MFU (``flops.matmul_train_flops``: matrix products
    only) is just under XLA:CPU's count of the same train step, which adds norms, softmax,
    activations, the rotations and the optimiser (0.8 % more at ViT-Ti/16 224 px)."""
    from experiments.benchmarks import device, flops

    config = device.make_config("rope_mixed", "xla", "float32", "Ti")
    by_xla = device.cpu_lowered_flops(config, 4)
    by_hand = flops.matmul_train_flops(config.model.to_dict(), 4)
    assert by_hand < by_xla < 1.02 * by_hand
    assert flops.matmul_train_flops(config.model.to_dict(), 8) == 2 * by_hand


def test_flops_counts_every_row_group_of_the_exponentials():
    """On a CPU ``expm_combination`` runs its rows in groups (a ``lax.map``, its body counted
    once by XLA): the count must grow by the same amount for every further group's rows."""
    import jax
    import jax.numpy as jnp

    from experiments.benchmarks import flops
    from rope_lie.encodings import expm_combination

    heads, h = 2, 64
    most = expm_combination._GROUP_BYTES // (heads * h * h * 4)  # rows in one group

    def rows(x):
        return flops.xla_flops(
            expm_combination.expm_skew_combination,
            jax.ShapeDtypeStruct((x, 2), jnp.float32),
            jax.ShapeDtypeStruct((2, heads, h, h), jnp.float32),
        )

    one, two, three = rows(most), rows(2 * most), rows(3 * most)
    assert two - one == pytest.approx(three - two, rel=1e-3)
    assert two - one > 0.5 * one  # all but the generators' word basis grows with the rows


def test_cayley_speed_checks_the_logits_with_a_nonzero_s():
    """The recipe's S = 0 makes P = I, where folded and per-token agree whatever they do: the
    benchmark's check draws S, and the two ways still agree."""
    from experiments.benchmarks import cayley_speed

    images = cayley_speed._images(cayley_speed.model_config("block2x2", True), 4, seed=1)[0]
    (folded, s_max), (per_token, _) = (
        cayley_speed.check_logits("block2x2", fold, images) for fold in (True, False)
    )
    assert s_max > 0.1
    assert np.abs(folded - per_token).max() <= 1e-5 * np.abs(folded).max()


def test_device_mfu_peak_is_the_dtypes_or_none():
    """``PEAK_TFLOPS`` holds bfloat16 peaks: a float32 step gets no MFU unless a peak is given."""
    from experiments.benchmarks import device

    kind = "NVIDIA H100 80GB HBM3"
    assert device.peak_flops(kind, None) == device.peak_flops(kind, None, "bfloat16") == 989e12
    assert device.peak_flops(kind, None, "float32") is None
    assert device.peak_flops(kind, 67.0, "float32") == 67e12
