"""One SIGTERM mechanism for a process that owns a training job (the Airflow task process, job_main, a test).

While a `sigterm_raises` block runs, the first SIGTERM marks the process as shutting down, tells the registered
listeners (a job's supervisor: relaunch nothing), runs the handler it replaced (Airflow's on_kill) and raises a
cancellation in the main thread, so the job's cleanup stops its workers at once. Later SIGTERMs are ignored: the
cleanup the first one started must finish. Blocks nest (a stage inside a task, a job inside a stage): the
innermost block's exception is raised. Design: docs/fault_tolerance.md#shutdown-and-orphans.
"""
from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class JobCancelled(BaseException):
    """The process owning the job is shutting down (SIGTERM: a task cancelled, marked failed or timed out, or the
    services stopping): its workers are stopped and nothing is relaunched. A BaseException, so `except Exception`
    blocks on the way out do not swallow it."""


_lock = threading.Lock()
_listeners: list[Callable[[str], None]] = []
_depth = 0  # sigterm_raises blocks open in this process
_reason: str | None = None  # why this process is shutting down (set by the first SIGTERM inside a block)
_chaining = False  # the innermost handler is passing the signal on to the handlers it replaced


def shutting_down() -> str | None:
    """Why this process is shutting down, or None."""
    return _reason


@contextmanager
def on_shutdown(listener: Callable[[str], None]) -> Iterator[None]:
    """Call `listener(reason)` when this process starts shutting down (at once if it already is). It runs in the
    signal handler: it must only set a flag or an event."""
    with _lock:
        _listeners.append(listener)
    try:
        if _reason is not None:
            listener(_reason)
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


@contextmanager
def sigterm_raises(exc_type: type[BaseException] = JobCancelled,
                   message: str = "SIGTERM: the training job was cancelled (task stopped, marked failed or timed out, "
                                  "or the services stopping); its workers are stopped") -> Iterator[None]:
    """While the block runs, the first SIGTERM raises `exc_type(message)` in the main thread (after the listeners
    and the handler it replaced ran). A no-op outside the main thread (signal handlers live there); in a process
    forked from this one before it exec'd, SIGTERM kills as by default."""
    global _depth, _reason
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: Any) -> None:
        global _reason, _chaining
        if os.getpid() != owner:  # a child forked before it exec'd: die as SIGTERM means
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if _chaining:  # called by an inner block of ours: on to the handler this one replaced (Airflow's)
            if callable(previous):
                previous(signum, frame)
            return
        if _reason is not None:  # once per process: a second SIGTERM must not break the cleanup
            return
        _reason = message
        for listener in list(_listeners):
            listener(message)
        _chaining = True
        try:
            if callable(previous):
                previous(signum, frame)  # Airflow's (on_kill), through any outer blocks of ours
        finally:
            _chaining = False
        raise exc_type(message)

    signal.signal(signal.SIGTERM, on_term)
    _depth += 1
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _depth -= 1
        if _depth == 0:
            _reason = None
