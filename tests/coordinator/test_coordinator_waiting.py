"""A wait says what it waits for, every few seconds, and says nothing once it is over."""

import logging
import threading
import time

import pytest

from diloco.coordinator.waiting import waiting


def test_a_long_wait_is_announced_repeatedly_and_a_short_one_never(caplog):
    log = logging.getLogger("test.waiting")
    state = {"who": "group 1"}
    with caplog.at_level(logging.WARNING, logger="test.waiting"):
        with waiting(log, "nothing", every_s=0.5):
            time.sleep(0.1)
        with waiting(log, lambda: f"the quorum: {state['who']} missing", every_s=0.2):
            time.sleep(0.5)
            state["who"] = "group 2"
            time.sleep(0.3)
        time.sleep(0.5)  # nothing more once the block has ended
    lines = [r.getMessage() for r in caplog.records]
    assert not any("nothing" in line for line in lines)
    assert len(lines) in (3, 4), lines
    assert lines[0].startswith("waiting for the quorum: group 1 missing (0 s so far)")
    assert lines[-1].startswith("waiting for the quorum: group 2 missing")


def test_concurrent_waits_each_get_their_own_notices(caplog):
    log = logging.getLogger("test.waiting.many")

    def wait(name: str, seconds: float) -> None:
        with waiting(log, name, every_s=0.2):
            time.sleep(seconds)

    with caplog.at_level(logging.WARNING, logger="test.waiting.many"):
        threads = [threading.Thread(target=wait, args=(f"peer {i}", 0.5)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(3):
        assert sum(f"peer {i} " in r.getMessage() for r in caplog.records) == 2


def test_a_failing_description_does_not_break_the_wait(caplog):
    log = logging.getLogger("test.waiting.bad")
    with caplog.at_level(logging.WARNING, logger="test.waiting.bad"):
        with waiting(log, lambda: 1 / 0, every_s=0.1):
            time.sleep(0.25)
    assert "cannot describe the wait" in caplog.text
    with pytest.raises(ValueError, match="every_s"):
        with waiting(log, "x", every_s=0):
            pass
