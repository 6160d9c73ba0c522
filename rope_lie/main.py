"""Command line: ``python -m rope_lie.main --config=configs/<recipe>.py:<args> --workdir=DIR``.

    python -m rope_lie.main --list                    # recipes, their summaries, encoder names
    python -m rope_lie.main --config=quickstart:smoke --print_config   # the resolved config
    python -m rope_lie.main --config=quickstart:smoke --workdir=/tmp/qs_smoke

``--config`` takes a recipe file (``configs/quickstart.py``; recipes load from any directory,
their shared helpers are ``rope_lie.config_lib``) or the name of a recipe packaged with
rope_lie (``quickstart``, the same files), with its arguments after a colon. Any config value
can be overridden, e.g. ``--config.optim.lr=3e-4 --config.total_steps=200``; the config is
locked, so a misspelt key fails naming the key. Rerunning with the same ``--workdir`` resumes
from its latest checkpoint; the workdir keeps the resolved config (``config.json``,
``config.py``) and ``rope_lie.load(workdir)`` returns the trained model.

Exit status: 0 when the run finished (or was preempted by SIGTERM and saved); 2 for an error in
what was asked (a bad flag, config value, dataset or workdir), printed as one line
``error: <message>`` on stderr, with no traceback and no empty workdir left behind; 1 when the
run stopped on a non-finite loss (one line too); 130 after Ctrl-C (a first Ctrl-C saves a
checkpoint at the next step, a second stops at once). Any other error is a bug and keeps its
traceback.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import sys

# TensorFlow (imported for the data pipeline) logs its start-up from C++ at INFO level (oneDNN,
# CPU features) before anything of ours; keep its warnings and errors. A user's own setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

try:
    from absl import flags, logging  # noqa: E402
    from ml_collections import config_flags  # noqa: E402

    from rope_lie import config_check, config_lib, errors  # noqa: E402
except ModuleNotFoundError as _error:  # the core install: one line naming the extra to install
    from rope_lie import _extras

    if __name__ != "__main__":
        _extras.raise_missing(_error, "rope_lie.main")
    _extras.exit_missing(_error, "python -m rope_lie.main")

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Recipe file with get_config(arg), e.g. configs/quickstart.py:smoke, or a packaged "
    "recipe's name, e.g. quickstart:smoke (--list shows them).",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for checkpoints, metrics, final.json and the resolved config."
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (recipe + overrides) and exit."
)
_LIST = flags.DEFINE_bool("list", False, "List the recipes and the encoder names, and exit.")

EXIT_USER_ERROR = 2
EXIT_NON_FINITE = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process stopped by Ctrl-C
_HELP = ("--help", "-h", "--helpshort", "--helpfull", "-?")


def recipes_dir() -> str:
    """The recipes' directory: ``rope_lie/configs`` (in the wheel; a link to ``configs/`` in a
    checkout), or the checkout's ``configs/`` where the link is not followed."""
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "configs")
    return packaged if os.path.isdir(packaged) else os.path.join(os.path.dirname(here), "configs")


def recipes() -> dict[str, str]:
    """Recipe name -> the first line of its docstring (read without importing the recipe)."""
    out = {}
    directory = recipes_dir()
    for name in sorted(os.listdir(directory) if os.path.isdir(directory) else []):
        if name.endswith(".py") and not name.startswith("_"):
            with open(os.path.join(directory, name)) as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            out[name[:-3]] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


def listing() -> str:
    """What ``--list`` prints: the recipes with their summaries, then the ``pe=`` values."""
    lines = [f"Recipes (--config=NAME[:args], files in {recipes_dir()}):"]
    for name, summary in recipes().items():
        lines.append(f"  {name:<11} {summary}")
    lines.append("Position encodings (pe=... in a recipe's arguments):")
    lines.append("  " + ", ".join(config_lib.pe_choices()))
    return "\n".join(lines)


def usage() -> str:
    """What ``--help`` prints."""
    return (
        f"{__doc__.strip()}\n\nFlags:\n"
        + "\n".join(
            f"  --{f.name}: {flags.FLAGS[f.name].help}"
            for f in (_CONFIG, _WORKDIR, _PRINT_CONFIG, _LIST)
        )
        + "\n  --config.<field>=<value>: override one field (--print_config shows them all)\n\n"
        + listing()
    )


def _resolve_recipe_names(argv: list[str]) -> list[str]:
    """``--config=quickstart[:args]`` -> the packaged recipe's path (a name, not a file)."""
    out = []
    for arg in argv:
        if arg.startswith("--config="):
            spec = arg[len("--config=") :]
            name, colon, rest = spec.partition(":")
            if "/" not in name and not name.endswith(".py") and name in recipes():
                arg = f"--config={os.path.join(recipes_dir(), name + '.py')}{colon}{rest}"
            elif not os.path.isfile(name):
                raise _UsageError(
                    f"--config={spec}: no recipe file {name!r} and no packaged recipe of that "
                    f"name; expected a file with get_config(arg) or one of {sorted(recipes())}"
                )
        out.append(arg)
    return out


def _message(e: BaseException) -> str:
    """An exception's message on one line (TFDS's list of every catalogue name left out)."""
    text = str(e)
    if "Available datasets:" in text:  # tfds DatasetNotFoundError: ~400 names
        hint = re.search(r"Did you mean: .*?\?", text)
        text = text.split("Available datasets:")[0] + (hint.group(0) if hint else "")
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _root_cause(e: BaseException) -> BaseException:
    """The first exception of `e`'s chain: what was raised before anything wrapped it."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    return e


def _flag_message(e: flags.Error, argv: list[str]) -> str | None:
    """One line for a flag error; None when the recipe itself failed with an error that is not
    the user's (``errors.USER_ERROR_TYPES``): a bug, whose traceback is then kept.

    absl raises a flag error with the value's own error as its context; ml_collections wraps an
    error of the recipe once more before that, so the recipe's error is the root of the chain.
    """
    cause = _root_cause(e)
    if cause is e or e.__context__ is cause:  # absl's own line names the flag and the value
        return _message(e)
    if not isinstance(cause, errors.USER_ERROR_TYPES):
        return None
    spec = [a for a in argv if a.startswith("--config=")][-1]
    return f"{spec}: {_message(cause)}"


def _unknown_field(argv: list[str]) -> str | None:
    """The message for the first ``--config.<path>=...`` whose field the recipe's config does
    not have: the flag, the config node that lacks the field, and the closest field's name.
    None when every override names a field. The failed parse left no config: the recipe's is
    loaded again, without the overrides."""
    spec = [a for a in argv if a.startswith("--config=")][-1].removeprefix("--config=")
    config = flags.FLAGS["config"].parser.parse(spec)
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config.") :].partition("=")[0]
        node, parts = config, path.split(".")
        for depth, key in enumerate(parts):
            fields = list(node.keys()) if hasattr(node, "keys") else []
            if key not in fields:
                where = ".".join(["config", *parts[:depth]])
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f'. Did you mean "{close[0]}"?' if close else " (--print_config shows them)"
                return f"--config.{path}: {where} has no field {key!r}{hint}"
            node = node[key]
    return None


def _fail(message: str, status: int = EXIT_USER_ERROR) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


# Fields a recipe's pe= argument sets together (config_lib.pe_fields): overriding one alone
# would leave the others as that pe set them (APE plus RoPE, another family's positions).
_PE_SET_FIELDS = ("model.pe", "model.additive")


def _parse(argv: list[str]):
    """(config, workdir) from the command line; user errors raise ``_UsageError``."""
    argv = _resolve_recipe_names(argv)
    for arg in argv:
        field = arg.removeprefix("--config.").partition("=")[0]
        if arg.startswith("--config.") and field in _PE_SET_FIELDS:
            raise _UsageError(
                f"--config.{field}: choose the encoder with the recipe's pe= argument "
                "(--config=<recipe>:pe=...), which also sets the positions' convention, the "
                "additive table and the block size; an override of one field leaves the others "
                "as the recipe's pe set them"
            )
    try:
        rest = flags.FLAGS(argv)
    except flags.Error as e:
        message = _flag_message(e, argv)
        if message is None:
            raise
        raise _UsageError(message) from e
    except (AttributeError, KeyError) as e:  # a --config.<key> that the config does not have
        message = _unknown_field(argv)
        if message is None:
            raise
        raise _UsageError(message) from e
    except errors.USER_ERROR_TYPES as e:  # the recipe's own argument checks
        raise _UsageError(_message(e)) from e
    if len(rest) > 1:
        raise _UsageError(f"unexpected arguments {rest[1:]}; flags are --name=value")
    if _LIST.value:  # needs no config
        return None, None
    if not flags.FLAGS["config"].present:
        raise _UsageError("--config is required (--list shows the recipes)")
    try:
        config = _CONFIG.value
    except Exception as e:  # the recipe file failed to load or to build its config
        cause = _root_cause(e)
        if not isinstance(cause, errors.USER_ERROR_TYPES):
            raise
        where = flags.FLAGS["config"].config_filename
        raise _UsageError(f"--config={where}: {_message(cause)}") from e
    return config, _WORKDIR.value


class _UsageError(Exception):
    pass


def run(argv: list[str]) -> int:
    """The command line on `argv` (``sys.argv`` form); returns the exit status."""
    if any(a in _HELP for a in argv[1:]):
        print(usage())
        return 0
    try:
        config, workdir = _parse(list(argv))
    except _UsageError as e:
        return _fail(str(e))
    if _LIST.value:
        print(listing())
        return 0
    if _PRINT_CONFIG.value:
        print(config, end="")
        # printed either way (to look at), but a config a run would refuse is not a success
        try:
            config_check.validate(config)
        except ValueError as e:
            return _fail(str(e))
        return 0
    if not workdir:
        return _fail("--workdir is required: the directory for checkpoints, metrics, final.json")
    logging.use_absl_handler()
    if not flags.FLAGS["verbosity"].present:  # Orbax logs every save at INFO; --verbosity=0
        logging.set_verbosity(logging.WARNING)
    return _train(config, workdir)


def _train(config, workdir: str) -> int:
    from rope_lie import train

    return guarded(lambda: train.train_and_evaluate(config, workdir), [workdir])


def guarded(train_fn, workdirs: list[str]) -> int:
    """Run ``train_fn()`` (returning a run's result, or a list of them) and turn its outcome
    into the exit status; the workdirs it created are removed again after a user error that
    left them empty."""
    existed = {w: os.path.exists(w) for w in workdirs}
    try:
        result = train_fn()
    except KeyboardInterrupt:
        print("\nerror: interrupted (Ctrl-C); the latest checkpoint is kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except FloatingPointError as e:
        return _fail(str(e), EXIT_NON_FINITE)
    except errors.USER_ERROR_TYPES as e:
        if not errors.is_user_error(e):
            raise
        for w, was_there in existed.items():
            if not was_there:
                _remove_if_empty(w)
        return _fail(_message(e))
    results = result if isinstance(result, list) else [result]
    if any(r.get("signal") == "SIGINT" for r in results):
        return EXIT_INTERRUPTED
    return 0


def _remove_if_empty(workdir: str) -> None:
    """Remove `workdir` (created by this run) if it holds no file, only empty directories."""
    if not os.path.isdir(workdir):
        return
    for _, _, files in os.walk(workdir):
        if files:
            return
    for root, _, _ in sorted(os.walk(workdir), key=lambda t: -len(t[0])):
        os.rmdir(root)


def main(run_fn=None) -> None:
    """Run the command line (`run_fn`: another one of ``run``'s form, ``rope_lie.ensemble``'s)
    and exit with its status."""
    try:
        status = (run if run_fn is None else run_fn)(sys.argv)
        sys.stdout.flush()
    except BrokenPipeError:  # `--list | head`: the reader closed the pipe; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        status = 0
    sys.exit(status)


if __name__ == "__main__":
    main()
