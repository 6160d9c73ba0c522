"""``python -m experiments.device``: the device queue's command (``run.main``)."""

from experiments.device.run import main

if __name__ == "__main__":
    main()
