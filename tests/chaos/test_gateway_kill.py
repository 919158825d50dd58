"""The gateway under live traffic and faults, with real processes on 127.0.0.1.

200 sessions at once talk to ``agentjet-client gateway`` in front of ``agentjet-server up``: a tenth opt
out of training, ten never give feedback, the rest give it 0-2 s after their last call (single- and
two-call sessions). Meanwhile the gateway is SIGKILLed and restarted on the same spool dir, and later the
training server is SIGKILLed and resumed. Users retry what was not answered (a connection error, or the
gateway's documented 503 while the server is down).

At the end: every session whose feedback was acknowledged is in the server's log exactly once with its
reward; the sessions without feedback expired and were counted; the counts add up; no opted-out session
reached the server; the redaction hook's output, not the secret it replaced, is what every file on disk
holds (journal, spools, the server's log).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx2

from agentjet_server.ingest.wal import Accepted, TrajectoryLog, read_records
from tests.conftest import ServerProcess, free_port, wait_healthy

SESSIONS = 200
LATE = 150  # sessions from this one on start while the training server is down
NEVER = {i for i in range(100) if i % 10 == 1}  # sessions that never give feedback (early ones: they expire soon)
HOOK = """
import re

def scrub(text):
    return re.sub(r"secret-[0-9]+", "[redacted]", text)
"""


class GatewayProcess:
    def __init__(self, args: list[str], log: Path, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.log = log
        exe = str(Path(sys.executable).parent / "agentjet-client")
        self._out = log.open("a")
        self.proc = subprocess.Popen(
            [exe, "gateway", "--port", str(port), *args], stdout=self._out, stderr=subprocess.STDOUT
        )
        wait_healthy(self.proc, self.url + "/healthz", log, 60, poll=0.1)

    def status(self) -> dict:  # type: ignore[type-arg]
        return httpx2.get(self.url + "/v1/gateway/status").json()  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._out.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self._out.close()


class Users:
    """The deployed agent's users: each session's calls, retried until answered, then its feedback."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.acked: dict[str, float] = {}  # session key -> reward, feedback acknowledged (trained)
        self.refused: Counter[str] = Counter()  # feedback answers other than 200, by status
        self.unavailable = 0  # 503s the gateway gave while the server was down
        self.untrained_calls = 0
        self.rng = random.Random(7)
        self.server_down = asyncio.Event()  # the last sessions start once the server is down

    async def call(self, http: httpx2.AsyncClient, key: str, messages: list[dict], headers: dict) -> str:  # type: ignore[type-arg]
        body = {"model": "agentjet-tiny", "messages": messages, "max_tokens": 4}
        while True:
            try:
                reply = await http.post(self.base + "/v1/chat/completions", json=body, headers=headers)
            except httpx2.TransportError:  # the gateway is down: not answered, so not acknowledged
                await asyncio.sleep(0.3)
                continue
            if reply.status_code == 503:
                assert (
                    "not answering" in reply.json()["error"]["message"]
                    or "starting" in reply.json()["error"]["message"]
                )
                self.unavailable += 1
                await asyncio.sleep(0.3)
                continue
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-agentjet-session"] == key
            return str(reply.json()["choices"][0]["message"]["content"])

    async def feedback(self, http: httpx2.AsyncClient, key: str, reward: float) -> None:
        while True:
            try:
                answer = await http.post(self.base + "/v1/feedback", json={"session": key, "reward": reward})
            except httpx2.TransportError:
                await asyncio.sleep(0.3)
                continue
            if answer.status_code == 200:
                assert answer.json()["outcome"] == "trained" and answer.json()["reward"] == reward
                self.acked[key] = reward
            else:
                self.refused[str(answer.status_code)] += 1
            return

    async def session(self, http: httpx2.AsyncClient, i: int) -> None:
        key = f"user-{i:03d}"
        opted_out = i % 10 == 0
        headers = {"X-AgentJet-Session": key, "X-AgentJet-Group": f"kind-{i % 5}"}
        if opted_out:
            headers["X-AgentJet-Train"] = "no"
        if i >= LATE:
            await self.server_down.wait()
        await asyncio.sleep(self.rng.uniform(0, 4))
        messages = [{"role": "user", "content": f"My code is secret-{1000 + i}. Write seven as a digit."}]
        answer = await self.call(http, key, messages, headers)
        if i % 2:  # a second turn continues the first
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again, please."}]
            await self.call(http, key, messages, headers)
        if opted_out:
            self.untrained_calls += 1 + i % 2
            return
        if i in NEVER:  # never gives feedback: expires
            return
        await asyncio.sleep(self.rng.uniform(0, 2))
        await self.feedback(http, key, round((i % 7) / 6, 3))


def test_gateway_and_server_killed_under_200_sessions_lose_nothing(tmp_path):
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    state, spool = tmp_path / "state", tmp_path / "gateway"
    server_port, gateway_port = free_port(), free_port()
    args = ["--group-size", "4", "--batch-groups", "2", "--group-timeout", "5", "--max-staleness", "100000"]
    args += ["--checkpoint-every", "1000", "--state-dir", str(state)]
    server = ServerProcess(args, tmp_path / "server.log", port=server_port)
    gateway_args = ["--server", server.url, "--spool-dir", str(spool), "--idle", "15", "--ttl", "15"]
    gateway_args += ["--group-by", "header", "--redact", f"{hook}:scrub"]
    gateway = GatewayProcess(gateway_args, tmp_path / "gateway.log", gateway_port)
    users = Users(gateway.url)

    async def traffic() -> None:
        limits = httpx2.Limits(max_connections=SESSIONS + 10)
        async with httpx2.AsyncClient(timeout=120, limits=limits) as http:
            jobs = [asyncio.create_task(users.session(http, i)) for i in range(SESSIONS)]
            nonlocal gateway, server

            async def until(acked: int) -> None:
                while len(users.acked) < acked:
                    failed = [job for job in jobs if job.done() and job.exception() is not None]
                    if failed:
                        raise failed[0].exception()  # type: ignore[misc]
                    assert not all(job.done() for job in jobs), f"all sessions ended with {len(users.acked)} acked"
                    await asyncio.sleep(0.05)

            await until(30)
            gateway.kill()  # mid-run: calls and feedback in flight fail, users retry
            gateway = await asyncio.to_thread(GatewayProcess, gateway_args, tmp_path / "gateway.log", gateway_port)
            await until(80)
            server.kill()
            users.server_down.set()
            await asyncio.sleep(1.0)  # the gateway answers 503 meanwhile
            health = await http.get(gateway.url + "/healthz")
            assert health.status_code == 200
            server = await asyncio.to_thread(
                ServerProcess, [*args, "--resume"], tmp_path / "server.log", port=server_port
            )
            await asyncio.gather(*jobs)

    try:
        asyncio.run(traffic())
        deadline = time.monotonic() + 90
        while True:  # every unrewarded session expires, every trajectory is delivered
            status = gateway.status()
            counts = status["counts"]
            if counts["open"] == counts["waiting"] == 0 and status["spooled"] == 0:
                break
            assert time.monotonic() < deadline, (status, (tmp_path / "gateway.log").read_text()[-3000:])
            time.sleep(0.5)
        final = server.status()
    finally:
        gateway.stop()
        server.stop()

    logged = [r for r in read_records(state / "log", compacted=True, recent=True) if isinstance(r, Accepted)]
    trajectory_log = TrajectoryLog(state / "log")
    answered = Counter(trajectory_id for kind, trajectory_id in trajectory_log.answers() if kind == "a")
    trajectory_log.close()
    bodies = {r.id: r.trajectory for r in logged if r.trajectory is not None}
    sessions_logged = Counter(str(b["metadata"]["session"]) for b in bodies.values())
    print(
        f"gateway: {counts}; users: {len(users.acked)} acknowledged feedbacks, refused {dict(users.refused)}, "
        f"{users.unavailable} 503s while the server was down; server log: {len(answered)} accepted; "
        f"server: {final['trajectories']}"
    )
    # every acknowledged session is in the server's log exactly once, with its reward
    assert len(users.acked) == SESSIONS - SESSIONS // 10 - len(NEVER)  # no feedback was refused
    assert all(n == 1 for n in answered.values()) and len(answered) == len(users.acked)
    assert set(sessions_logged) == set(users.acked) and all(n == 1 for n in sessions_logged.values())
    wrong = [b["id"] for b in bodies.values() if b["reward"] != users.acked[str(b["metadata"]["session"])]]
    assert not wrong, f"trained with another reward than their feedback gave: {wrong}"
    # the counts add up: every session the gateway opened ended one way
    assert counts["trained"] == len(users.acked)
    assert counts["sessions"] == counts["trained"] + counts["expired"] + counts["opted_out"] + counts["fallback"]
    assert counts["expired"] >= len(NEVER) and counts["opted_out"] == 0
    assert counts["untrained_calls"] >= users.untrained_calls
    assert users.unavailable > 0  # the server's outage was seen, and answered as documented
    # opted-out sessions never reached the server
    assert not any(key.startswith("user-") and int(key[5:]) % 10 == 0 for key in sessions_logged)
    # the redaction hook's output is what every file holds
    for root in (spool, state):
        for path in root.rglob("*"):
            if path.is_file():
                assert b"secret-" not in path.read_bytes(), path
    assert any(b"[redacted]" in p.read_bytes() for p in (state / "log").rglob("*") if p.is_file())
    assert final["trajectories"]["accepted"] >= len(users.acked) - 90  # the resumed server's own count
