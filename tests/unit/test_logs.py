"""init_logging: the console shows the volunteer's level, while INFO still reaches the handler
that forwards the node's log lines to the dashboard (issue 11: the Log screen stayed empty)."""

import logging

import pytest

from peer.logs import init_logging


class Collect(logging.Handler):
    """Stands for peer.node._LogToControl: a root handler at INFO."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def root(monkeypatch):
    """The root logger without our console handler (init_logging adds one that writes to the
    test's captured stderr), restored afterwards."""
    monkeypatch.delenv("SWARMSTREAM_LOG", raising=False)
    r = logging.getLogger()
    saved = (r.level, list(r.handlers), logging.getLogRecordFactory())
    for h in list(r.handlers):
        if getattr(h, "_swarmstream", False):
            r.removeHandler(h)
    collect = Collect()
    yield r, collect
    r.handlers[:] = saved[1]
    r.setLevel(saved[0])
    logging.setLogRecordFactory(saved[2])


def test_info_reaches_the_control_handler_while_stderr_shows_warnings_only(root, capsys):
    r, collect = root
    init_logging()
    r.addHandler(collect)
    log = logging.getLogger("peer.node")
    log.info("fragment synced fragment=1 round=4")
    log.warning("sync failed fragment=0 round=5")
    log.debug("not for anyone")
    assert [rec.getMessage() for rec in collect.records] == ["fragment synced fragment=1 round=4",
                                                              "sync failed fragment=0 round=5"]
    err = capsys.readouterr().err
    assert "sync failed fragment=0 round=5" in err and "WARNING peer.node" in err
    assert "fragment synced" not in err and "not for anyone" not in err


@pytest.mark.parametrize("level, shown, hidden", [
    ("debug", ["a debug line", "an info line", "a warning"], []),
    ("INFO", ["an info line", "a warning"], ["a debug line"]),
    ("error", [], ["a debug line", "an info line", "a warning"]),
])
def test_the_console_level_is_the_users_and_the_root_never_drops_info(root, capsys, level, shown, hidden):
    r, collect = root
    init_logging(level)
    r.addHandler(collect)
    log = logging.getLogger("peer.allreduce")
    log.debug("a debug line")
    log.info("an info line")
    log.warning("a warning")
    err = capsys.readouterr().err
    assert all(s in err for s in shown) and not any(h in err for h in hidden), err
    assert [rec.getMessage() for rec in collect.records] == ["an info line", "a warning"]


def test_the_environment_sets_the_console_level_and_a_second_call_adds_no_handler(root, capsys, monkeypatch):
    r, _ = root
    monkeypatch.setenv("SWARMSTREAM_LOG", "info")
    init_logging()
    init_logging()
    assert sum(getattr(h, "_swarmstream", False) for h in r.handlers) == 1
    logging.getLogger("peer.node").info("once")
    assert capsys.readouterr().err.count("once") == 1
    init_logging("WARNING")  # a later call changes the console's level, not the root's
    logging.getLogger("peer.node").info("hidden now")
    assert "hidden now" not in capsys.readouterr().err and r.level == logging.INFO


def test_an_unknown_level_is_refused(root):
    with pytest.raises(ValueError):
        init_logging("LOUD")


def test_hivemind_lines_do_not_reach_the_dashboard(root):
    """hivemind's loggers keep their own handler and do not propagate to the root, so a root
    at INFO does not forward the DHT's and the daemon's chatter to the Log screen."""
    from hivemind.utils.logging import get_logger

    r, collect = root
    init_logging()
    r.addHandler(collect)
    get_logger("hivemind.dht.dht").info("hivemind info line")
    get_logger("hivemind.p2p.p2p_daemon").warning("hivemind warning line")
    assert not collect.records


def test_warnings_reach_the_dashboard_although_hivemind_renames_the_level(root, capsys):
    """Importing hivemind renames WARNING to "WARN" process-wide; LogRecorded accepts only the
    standard names, so the node's forwarder used to drop every warning."""
    from types import SimpleNamespace

    import hivemind  # noqa: F401  (the node process always has it)
    from peer.node import _LogToControl

    assert logging.getLevelName(logging.WARNING) == "WARN"
    r, _ = root
    init_logging()
    sent: list = []
    forward = _LogToControl(SimpleNamespace(_emit=sent.append, _log_history=[]))  # the node's own handler
    r.addHandler(forward)
    try:
        log = logging.getLogger("peer.allreduce")
        log.info("late slice ignored peer=x")
        log.warning("dropped member reason=timeout peer=x")
        log.error("state sync failed")
    finally:
        r.removeHandler(forward)
    assert [(m.level, m.logger, m.text) for m in sent] == [
        ("INFO", "peer.allreduce", "late slice ignored peer=x"),
        ("WARNING", "peer.allreduce", "dropped member reason=timeout peer=x"),
        ("ERROR", "peer.allreduce", "state sync failed")]
    assert "WARNING peer.allreduce: dropped member" in capsys.readouterr().err
