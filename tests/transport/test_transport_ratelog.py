"""RateLimitedLog: one line per kind per interval, the rest counted into the next line."""

import logging
import time

from transport.ratelog import RateLimitedLog


def test_a_flood_of_one_kind_is_one_line_per_interval_and_counts_the_rest(caplog) -> None:
    rl = RateLimitedLog(logging.getLogger("flood-test"), interval_s=0.2)
    with caplog.at_level(logging.WARNING, logger="flood-test"):
        written = [rl.warning("refused", "refused %d", i) for i in range(100)]
        assert written[0] and not any(written[1:])
        assert rl.warning("other", "another kind")  # kinds are limited apart
        time.sleep(0.25)
        assert rl.warning("refused", "refused %d", 100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["refused 0", "another kind", "refused 100 (and 99 more like it in the last 0.2 s)"]
