"""The body gate: a helper process that judges large request bodies before the server parses them.

Parsing JSON holds Python's global lock: an 11 MB body of integers keeps the server's event loop
waiting about 150 ms, and a few such bodies at once hold hundreds of MB. So a body over
``GATE_BYTES`` is first parsed, shape-checked and validated here, in a process of its own (no
torch: about 60 MB), which answers with a verdict: fine, or the 400 to send. Only a body the gate
passes is parsed by the server itself — a hostile body costs the gate its CPU and memory, not the
server. The gate takes one body at a time; the routes let at most ``LARGE_IN_FLIGHT`` large bodies
be read at once, so memory stays bounded however many arrive.

Protocol over the child's stdin/stdout: the server writes ``<kind: 1 byte><length: 8 bytes LE>
<body>`` (kind ``c`` a chat request, ``p`` a text completion request, ``t`` a trajectory batch),
the gate answers one JSON line: ``null``, or ``{"message", "param", "code"}``. A gate that dies is
restarted; meanwhile the server judges bodies itself.

    python -m agentjet_server.ingest.body_gate        # what ``BodyGate`` starts
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

from pydantic import BaseModel, ValidationError

from agentjet_client.protocol import ChatCompletionRequest, CompletionRequest, TrajectoryBatch
from agentjet_server.errors import RequestError
from agentjet_server.ingest.bodies import GATE_BYTES, describe_validation_error, parse_model

logger = logging.getLogger(__name__)

__all__ = ["GATE_BYTES", "BodyGate", "judge", "main"]
# every wire type a route reads with the gate (``bodies.read_model``), by the byte that names it in a frame
MODELS: dict[bytes, type[BaseModel]] = {b"c": ChatCompletionRequest, b"p": CompletionRequest, b"t": TrajectoryBatch}
KINDS = {model: kind for kind, model in MODELS.items()}


def judge(raw: bytes, model: type[BaseModel]) -> dict[str, Any] | None:
    """None if ``raw`` is a valid ``model``, else the 400's message, param and code."""
    try:
        parse_model(raw, model)
    except RequestError as exc:
        return {"message": exc.message, "param": exc.param, "code": exc.code}
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        return {"message": message, "param": param, "code": "invalid_value"}
    return None


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def main() -> None:
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while (header := _read_exactly(source, 9)) is not None:
        kind, size = header[:1], struct.unpack("<Q", header[1:])[0]
        raw = _read_exactly(source, size)
        if raw is None:
            return
        verdict = judge(raw, MODELS[kind])
        del raw
        sink.write(json.dumps(verdict, ensure_ascii=True).encode() + b"\n")
        sink.flush()


COMMAND = (sys.executable, "-m", "agentjet_server.ingest.body_gate")


class BodyGate:
    """The server's side: ``judge`` a body in the helper process (call from a worker thread).
    ``command`` starts the helper: this module's ``main`` (tests hand in a helper that misbehaves)."""

    def __init__(self, command: Sequence[str] = COMMAND) -> None:
        self._command = list(command)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is not None:
            logger.warning("the body gate had stopped (exit status %s); starting a new one", self._proc.returncode)
            self.close()  # its pipes, before a new gate takes its place
        if self._proc is None:
            self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        return self._proc

    def judge(self, raw: bytes, model: type[BaseModel]) -> dict[str, Any] | None:
        """The gate's verdict; where the gate can't answer (it died), the server judges itself."""
        with self._lock:
            try:
                proc = self._start()
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(KINDS[model] + struct.pack("<Q", len(raw)))
                proc.stdin.write(raw)
                proc.stdin.flush()
                line = proc.stdout.readline()
                if line:
                    verdict: dict[str, Any] | None = json.loads(line)
                    return verdict
            except (OSError, ValueError) as exc:
                logger.warning("the body gate failed (%s); judging this body in the server", exc)
            self.close()
        return judge(raw, model)

    def close(self) -> None:
        """End the gate process and close its pipes; never raises for a gate that died or stopped reading."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout) if proc is not None else ():
            if stream is not None:
                # closing flushes what a failed write left buffered, which into a gate that stopped reading
                # fails (EPIPE): the file is closed all the same, and the bytes were for that gate alone
                with contextlib.suppress(OSError):
                    stream.close()


if __name__ == "__main__":
    main()
