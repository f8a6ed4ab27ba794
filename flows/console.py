"""The terminal of `lopd run` / `lopd study`: log lines and progress bars, and errors that explain themselves.

Each log line clears the bars first and redraws them after (`tqdm.external_write_mode`), so the two never share a
line. A record of an error whose message already says what to do (`clear_errors()`: an unreachable MLflow, a
damaged bank) is printed without its traceback; the Prefect API still receives the full record.

    with logs_above_bars():          # wraps the console handlers of the root logger (Prefect's among them)
        lopd_pipeline(config=cfg)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from tqdm import tqdm


class AboveTheBars(logging.Handler):
    """A console handler's records, written while tqdm's bars are cleared from the terminal."""

    def __init__(self, inner: logging.StreamHandler) -> None:  # type: ignore[type-arg]
        super().__init__(inner.level)
        self.inner = inner

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and isinstance(record.exc_info[1], clear_errors()):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        with tqdm.external_write_mode(file=getattr(self.inner, "stream", None)):
            self.inner.handle(record)


def clear_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message names the problem and what to do: the console shows the message, not the traceback."""
    from components.memory import BankDamagedError
    from components.tracking import TrackingError
    from flows.lifecycle import RunDirBusy

    return (TrackingError, BankDamagedError, RunDirBusy)


@contextlib.contextmanager
def logs_above_bars(loggers: list[logging.Logger] | None = None) -> Iterator[None]:
    """Within the block, the stream handlers of `loggers` (default: the root logger) write above the bars."""
    loggers = loggers or [logging.getLogger()]
    saved = [(logger, logger.handlers) for logger in loggers]
    try:
        for logger in loggers:
            logger.handlers = [AboveTheBars(h) if isinstance(h, logging.StreamHandler) else h for h in logger.handlers]
        yield
    finally:
        for logger, handlers in saved:
            logger.handlers = handlers
