"""The device queue: what an accelerator run is for (issue 47), in one command of under 10 minutes.

    python -m experiments.device --out DIR              # on a GPU (or TPU): about 9 minutes
    python -m experiments.device --dry-run --out DIR    # anywhere: every stage at tiny shapes

Writes ``DIR/<device>-<date>.json`` and ``DIR/<device>-<date>.md`` (the same as tables) after
every stage and every timed row, so a run that is cut short keeps what it measured. The stages,
in order, each with a deadline (a share of ``--budget`` seconds from the start: time a stage
leaves unused goes to the ones after it); a stage that fails records its error and the queue
goes on:

1. ``environment``: the device kind and memory, the versions, and whether the jax APIs
   rope_lie uses that have moved or may move between releases import.
2. ``tests``: the GPU tests (``GPU_TESTS``, the quick files first: the Pallas squarings
   against the loop, the FFT against the DFT's products, LieRE's two VJPs, LieRE's two block
   products, then cuDNN attention against "xla") on the device, through pytest in a
   subprocess with ``GPU_TEST_WORKERS`` workers (pass/fail counts, failing test ids);
   meanwhile the encoder tests (``tests/encodings``) run in another subprocess on the device
   machine's CPU with its jax (``JAX_PLATFORMS=cpu``): the current-jax check of issue 47.4.
   Each run's whole log (short tracebacks, each failure's reason) is written beside the JSON,
   ``<stem>-tests-gpu.log`` and ``<stem>-tests-encoders-cpu.log``; each failure's report goes
   to the log as the test fails, and its message to the JSON (``failure_messages``), so that a
   run stopped at the deadline still says why.
3. ``compile``: the real train step (``rope_lie.train.make_train_step``, AdamW's or Adam's
   update included; ViT-B/16 at 224 px, bfloat16 activations, dropout 0) of the ImageNet
   recipe's model for every encoder (``ENCODERS``; the recipes are read from
   ``experiments/device_recipes.json``) on the platform's first attention backend and for the
   first four encoders on the others, at batch 64: lowered one after the other and compiled by
   ``--compile-threads`` threads at once, each encoder's parameters initialised beside them
   by the host's CPU and put on the device (``compile_stage.host_init``), until the stage's
   deadline (the steps not started by then are recorded as skipped; those
   compiling are waited for). RoPE-Mixed, LieRE 8x8, NoPE and dense LieRE come first
   (``LEAD_ENCODERS``). LieRE 8x8 is compiled again with what its platform does not use by
   default (``variant``), leaving out what a run measured slower on this platform
   (``variants.MEASURED_SLOWER``; all with ``--every-variant``): on the first backend, right
   after ``LEAD_ENCODERS``, the other form of the
   exponentials' small products (``expm.SMALL_PRODUCTS``: multiply-adds of slices, or one
   multiply summed), the other layer plan (``position_hook.LAYER_PLANS``: one precompute per
   layer, or one for all), the other squaring loops (``expm.SQUARING_LOOPS``: a loop whose
   trip count is read from the data, a fixed count first, or one Pallas kernel where it runs),
   the exponentials' VJP in reverse mode (``expm_combination.COMBINATION_BACKWARDS``) and
   the pairs of ``COMBINATIONS`` (two of these at once); and the other block product
   (``lie.BLOCK_PRODUCTS``) on "cudnn" and "xla". Dense LieRE is compiled again with the
   reverse-mode VJP right after LieRE 8x8's variants, and Circulant-STRING with the
   real DFT's products in place of the FFT (``lie.SPECTRAL_TRANSFORMS``, the variant
   ``spectral=dft``; ``ENCODER_VARIANTS``) right after its own step on the first backend.
4. ``steps``: every compiled step timed from its encoder's initial state (a copy: the step
   donates it), min and median over ``--steps`` steps after 2 warm-ups: rows
   ``{encoder, attention, batch, step_ms, images_per_s, mfu, ...}``; ``step_ms`` is the min
   of steps each waited for; ``step_ms_pipelined`` and ``mfu_pipelined``, ``--steps`` more
   dispatched back to back and waited for once (a training loop's throughput, without the
   host's dispatch of each step); ``init_wait_s``, ``batch_s``, ``background_wait_s`` and
   ``timed_s`` say where the row's wall time went. Each row's steps are timed once the work
   left in the background (other encoders' initial states, compiles past the compile stage's
   drain) is done, or at the stage's deadline; ``concurrent`` names what still ran beside
   them ([] when nothing did).
   Then the goal's encoders (``GOAL_ENCODERS``: RoPE-Mixed, LieRE 8x8, NoPE with
   their defaults on the first backend) are timed again in reverse order (rows with ``case``
   "repeat"), and the goal's ratios are given from each pass: the spread says whether a ratio
   near its goal is resolved by this run.
5. ``rotations``: LieRE 8x8's exponentials alone (every layer's ``liere.precompute`` at once,
   vmapped, forward and forward plus backward) with the platform's defaults and each variant
   of the exponentials (``rotations.EXPONENTIAL_VARIANTS``), and the rotations' orthogonality
   error; then a step's 24 rotations of q and k alone, chained in one program (no dispatch
   per rotation), for RoPE-Mixed, LieRE 8x8 (its platform's block product and "adds"), dense
   LieRE and Circulant-STRING (by FFT and by the DFT's products) at ViT-B/16's shapes, per
   rotation and over RoPE-Mixed's (``rotations.time_chain``); then ``lie.apply_blocks``'s
   block products alone (einsum, broadcast and, for blocks up to 16, adds; one call each;
   LieRE 8x8 and dense; forward, and forward plus backward), and each one's error against
   float64.
6. ``profile``: the LieRE 8x8, RoPE-Mixed and dense LieRE steps, then each of LieRE 8x8's
   variants, on their fastest backend, traced by ``jax.profiler``: the top operations by
   device time per step (read from the trace's XSpace with ``jax.profiler.ProfileData``, no
   TensorBoard plugin),
   beside the compiled program's instruction counts and XLA's cost analysis.
7. ``largest_batch``: for the encoders in ``ENCODERS`` order, on their fastest backend, the
   largest power-of-two batch whose compiled step fits the device's memory (predicted from
   batch 64's buffer sizes, checked by compiling the candidate and its half), timed as in 4.
8. ``packing``: NaFlex train steps (issue 45) of ``PACKED_ENCODERS`` on "xla", on one batch of
   images whose sides are uniform from half the recipe's grid to all of it (7 to 14 patches at
   224 px): padded one image a row to the full grid (``tokens.pack``), and packed greedily
   into rows of that many tokens (``tokens.pack_images``, ``naflex.pack``'s packing), the
   same images; rows ``{encoder, case, rows, padding_fraction, step_ms, time_over_padded}``.

MFU = ``flops.matmul_train_flops`` (the ViT's matrix products by hand: the same count for every
encoder and backend) / step time / the device's dense bfloat16 peak
(``benchmarks/device.py``'s ``PEAK_TFLOPS``, or ``--peak-tflops``).

Needs only what the device image has: jax, flax, optax, orbax-checkpoint, chex and numpy, and
tqdm and absl-py (imported by rope_lie's training modules); pytest, with pytest-xdist if
installed, for stage 2, which records "pytest is not installed" and goes on without it. No
TensorFlow, TFDS or ml_collections (``tests/test_device_queue.py`` runs the dry run with them
blocked); nothing has to be carried in as wheels. ``--write-recipes`` (which needs
ml_collections) regenerates the recipes from ``configs/imagenet.py``.

On a CPU (``--dry-run``, automatic where the platform is "cpu") every stage runs at tiny shapes:
one layer of ViT-pico with 16 px patches on 32 x 32 images, batch 2, one step, batches up to 8,
and a few fast tests in stage 2.

The package, a module for each part: ``run`` (the command: ``parse_args``, ``main``), ``queue``
(the stages' order and deadlines, and the state a run's stages share), ``recipes``, ``results``
(the JSON and Markdown files), ``variants`` (LieRE 8x8's), and one module for each stage:
``environment``, ``tests_stage``, ``compile_stage``, ``steps``, ``rotations``, ``profile``,
``largest_batch`` and ``packing``. The names below are handed on from them. After a run,
``python -m experiments.device.collect <folder>`` copies its files into
``experiments/benchmarks/device/`` under their committed names (``collect``).
"""

from __future__ import annotations

from experiments.device.compile_stage import ATTENTIONS, GOAL_ENCODERS, LEAD_ENCODERS
from experiments.device.environment import JAX_APIS
from experiments.device.largest_batch import MEMORY_SHARE, batch_candidates
from experiments.device.packing import PACKED_ENCODERS, naflex_batches
from experiments.device.profile import PROFILED, hlo_op_counts, kernel_op_names, op_times
from experiments.device.queue import DEADLINES, STAGES, Queue
from experiments.device.recipes import (
    ENCODERS,
    RECIPES,
    Config,
    read_recipes,
    recipes_from_configs,
    run_config,
)
from experiments.device.results import Results, markdown
from experiments.device.run import DEFAULT_OUT, DRY, FULL, STAGE_FNS, main, parse_args
from experiments.device.tests_stage import (
    ENCODER_TESTS,
    FAILURE_PREFIX,
    GPU_TESTS,
    finish_pytest,
    pytest_counts,
    start_pytest,
)
from experiments.device.variants import (
    COMBINATIONS,
    COMBINED,
    ENCODER_VARIANTS,
    VARIANT_KINDS,
    liere_variants,
    other_variant,
    other_variants,
    split_variant,
    variant,
    variant_choices,
    variant_label,
)

__all__ = [
    "ATTENTIONS",
    "Config",
    "DEADLINES",
    "DEFAULT_OUT",
    "DRY",
    "ENCODERS",
    "ENCODER_VARIANTS",
    "ENCODER_TESTS",
    "FAILURE_PREFIX",
    "FULL",
    "GOAL_ENCODERS",
    "LEAD_ENCODERS",
    "GPU_TESTS",
    "JAX_APIS",
    "MEMORY_SHARE",
    "PACKED_ENCODERS",
    "PROFILED",
    "Queue",
    "RECIPES",
    "Results",
    "STAGES",
    "STAGE_FNS",
    "VARIANT_KINDS",
    "batch_candidates",
    "finish_pytest",
    "hlo_op_counts",
    "kernel_op_names",
    "main",
    "markdown",
    "naflex_batches",
    "op_times",
    "other_variant",
    "other_variants",
    "liere_variants",
    "variant_label",
    "COMBINED",
    "COMBINATIONS",
    "parse_args",
    "pytest_counts",
    "read_recipes",
    "recipes_from_configs",
    "run_config",
    "split_variant",
    "start_pytest",
    "variant",
    "variant_choices",
]
