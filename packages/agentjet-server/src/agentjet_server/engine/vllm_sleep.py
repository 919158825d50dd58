"""Sleep and wake for the vLLM engine (``--engine-sleep``): asked for by the learner, carried out between steps.

The learner's thread asks (``SleepSwitch.ask``) and waits; the engine thread carries the asks out between
two steps (``carry_out``): vLLM's sleep level 1 frees the KV cache and moves the weights to host memory,
and the requests running are preempted, to be recomputed when the engine wakes. Each sleep and wake is
timed (``sleeps``). On CPU vLLM frees nothing, but serving pauses the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentjet_server.errors import EngineError

logger = logging.getLogger(__name__)

Ask = Literal["sleep", "wake"]


class _Quiet(logging.Filter):
    """vLLM's CPU worker warns at every sleep and wake that it frees nothing; said once at start instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sleep mode is not supported on CPU" not in record.getMessage()


def sleep_engine_args(device: str) -> dict[str, Any]:
    """vLLM's engine arguments for sleep mode on ``device``: on a GPU, weights and KV cache in vLLM's own
    pool, which it can free; elsewhere none (it frees nothing there, which is said once, here)."""
    if device.startswith("cuda"):
        return {"enable_sleep_mode": True}
    logger.info("--engine-sleep on %s: vLLM frees no memory there; serving still pauses during steps", device)
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_Quiet())
    return {}


@dataclass
class _Command:
    """``sleep`` or ``wake``, carried out by the engine thread between steps."""

    kind: Ask
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class SleepSwitch:
    """Whether one vLLM ``LLMEngine`` sleeps; changed only by the engine thread, on the asks of others."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._asks: queue.Queue[_Command] = queue.Queue()
        self.asleep = False
        self.sleeps: deque[tuple[float, float]] = deque(maxlen=256)  # (seconds to fall asleep, to wake)

    def ask(self, kind: Ask, wake_thread: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """For any thread but the engine's: leave ``kind`` for the engine thread (``wake_thread`` rouses it)
        and wait until it is done; raises if it failed, or if the engine has ``stopped`` meanwhile."""
        command = _Command(kind)
        self._asks.put(command)
        wake_thread()
        while not command.done.wait(0.5):
            if stopped():
                raise EngineError(f"the engine stopped before it could {kind}")
        if command.error is not None:
            raise EngineError(f"vLLM could not {kind}: {command.error}") from command.error

    def carry_out(self, woken: Callable[[], None]) -> None:
        """For the engine thread, between steps: every ask waiting; ``woken`` runs after a wake."""
        while True:
            try:
                command = self._asks.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            try:
                if command.kind == "sleep" and not self.asleep:
                    # level 1: KV cache freed, weights to host memory; "keep": the running requests are
                    # preempted (their KV cache goes) and recomputed when the engine wakes
                    self._engine.sleep(level=1, mode="keep")
                    self.asleep = True
                    self.sleeps.append((time.perf_counter() - started, 0.0))
                elif command.kind == "wake" and self.asleep:
                    self.wake()
                    woken()
            except Exception as exc:  # reported to the caller (the learner)
                command.error = exc
            finally:
                command.done.set()

    def wake(self) -> None:
        """For the engine thread: weights and KV cache back on the device (the weights it had: an update
        loads over them)."""
        started = time.perf_counter()
        self._engine.wake_up()
        self.asleep = False
        if self.sleeps:
            self.sleeps[-1] = (self.sleeps[-1][0], time.perf_counter() - started)

    def cancel(self) -> None:
        """For the engine thread as it stops: release whoever still waits on an ask."""
        while not self._asks.empty():
            self._asks.get_nowait().done.set()
