"""The log's one-record-one-line rule (issue 20, item 7): row data with control characters in a
message's arguments or in an exception's message never forges a line in the log's real format."""

from __future__ import annotations

import io
import logging
import re

from rollout_buffer.core.logconfig import CONTINUATION, FORMAT, OneLineFormatter, escape_controls

FORGED = "g1\n2026-12-04 12:00:00,000 [ERROR] rollout_buffer.lease: FORGED\r\x1b[2K\u2028x"
RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[")


def log_lines(emit) -> list[str]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter(FORMAT))
    logger = logging.getLogger("test_logconfig")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        emit(logger)
    finally:
        logger.removeHandler(handler)
    return out.getvalue().splitlines()


def test_row_data_in_arguments_and_exceptions_never_begins_a_line():
    def emit(logger: logging.Logger) -> None:
        logger.warning("dropped group %s of job %s", FORGED, "job\n1")
        try:
            raise ValueError(f"bad group {FORGED}")
        except ValueError:
            logger.exception("building group %s failed", FORGED)
        logger.error("stack of %s", FORGED, stack_info=True)

    lines = log_lines(emit)
    records = [line for line in lines if RECORD.match(line)]
    assert len(records) == 3, lines  # one per record, none forged
    assert all("FORGED" not in line or not line.startswith("2026-12-04 12:00") for line in lines)
    assert all(line.startswith(CONTINUATION) for line in lines if not RECORD.match(line))
    assert "dropped group g1\\n2026-12-04 12:00:00,000 [ERROR]" in records[0]
    assert "\x1b" not in "".join(lines) and "\r" not in "".join(lines)
    # a traceback keeps its lines, the exception message's too, but each is marked as a continuation
    forged = CONTINUATION + "2026-12-04 12:00:00,000 [ERROR] rollout_buffer.lease: FORGED"
    assert any(line.startswith(forged) for line in lines), lines


def test_escape_controls_keeps_printable_text():
    assert escape_controls("é ü 中 tab\tend") == "é ü 中 tab\\tend"
    assert escape_controls("\x00\x7f\x85\u2029") == "\\x00\\x7f\\x85\\u2029"
