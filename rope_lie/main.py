"""Command line: ``python -m rope_lie.main --config=configs/<recipe>.py:<args> --workdir=DIR``.

Recipes load from any directory (their shared helpers are ``rope_lie.config_lib``). Any config
value can be overridden, e.g. ``--config.optim.lr=3e-4 --config.total_steps=200``. The config
is locked, so a misspelt key fails at parse time naming the key. Rerunning with the same
``--workdir`` resumes from its latest checkpoint.
"""

from __future__ import annotations

import os

# TensorFlow (imported for the data pipeline) logs its start-up from C++ at INFO level (oneDNN,
# CPU features) before anything of ours; keep its warnings and errors. A user's own setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from rope_lie import train  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Recipe file with get_config(arg), e.g. configs/quickstart.py:smoke.",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics and final.json."
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    if not flags.FLAGS[
        "verbosity"
    ].present:  # Orbax logs every save at INFO; --verbosity=0 shows it
        logging.set_verbosity(logging.WARNING)
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main)
