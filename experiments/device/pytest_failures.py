"""A pytest plugin of the tests stage: each failure's report in the log as soon as it fails.

pytest prints the failures' tracebacks and assertion messages only when its session ends, and
the stage stops its pytest runs at their deadline, so a run cut short would say which tests
failed but not why. ``start_pytest`` loads this with ``-p experiments.device.pytest_failures``;
the lines it writes (``tests_stage.failure_lines``) are read back by
``tests_stage.failure_reports`` and passed over by ``pytest_counts``.
"""

from __future__ import annotations

import pytest

from experiments.device.tests_stage import failure_lines


class _FailureWriter:
    def __init__(self, config, reporter):
        self.config, self.reporter = config, reporter

    def test_id(self, report) -> str:
        """The test's id as its -v line writes it (relative to the working directory), so
        that the failing ids pytest_counts reads find their reports. pytest 9.2 relates a
        NodeId (``report.id``), earlier releases a str; where that fails, the node id: an
        exception in a hook would end the whole run."""
        try:
            return str(self.config.cwd_relative_nodeid(getattr(report, "id", report.nodeid)))
        except Exception:
            return str(report.nodeid)

    # After the terminal reporter's own line for the report: the status, then why.
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report) -> None:
        if not report.failed:
            return
        for line in failure_lines(self.test_id(report), report.when, report.longreprtext):
            self.reporter.write_line(line)
        self.reporter.flush()  # a run stopped by a signal keeps what was flushed


# Last, so that the terminal reporter is registered.
@pytest.hookimpl(trylast=True)
def pytest_configure(config) -> None:
    # An xdist worker's reports reach the controller, whose hook writes them once.
    if hasattr(config, "workerinput"):
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.register(_FailureWriter(config, reporter), "device_failure_writer")
