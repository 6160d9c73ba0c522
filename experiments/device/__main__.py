"""``python -m experiments.device``: the device queue's command (``queue.main``)."""

from experiments.device.queue import main

if __name__ == "__main__":
    main()
