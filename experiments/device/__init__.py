"""The device queue (``python -m experiments.device``): see ``queue.py``."""

from experiments.device.queue import *  # noqa: F403
