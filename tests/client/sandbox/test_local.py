"""The local sandbox under bubblewrap, for real: commands, files, limits, isolation, and what a killed client
leaves behind."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from agentjet_client.sandbox import Limits, LocalSandbox, SandboxError


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def test_commands_files_and_copies_stay_in_the_sandboxs_own_directories(tmp_path: Path) -> None:
    async def body() -> None:
        async with LocalSandbox(root=tmp_path / "boxes") as box:
            done = await box.exec("pwd; echo hi > note.txt; echo err >&2; exit 3")
            assert (done.exit_code, done.stdout, done.stderr, done.timed_out) == (3, "/app\n", "err\n", False)
            assert await box.read_file("/app/note.txt") == b"hi\n"
            await box.write_file("/app/deep/dir/file.txt", "written")
            assert (await box.exec("cat /app/deep/dir/file.txt")).stdout == "written"
            source = tmp_path / "src"
            (source / "sub").mkdir(parents=True)
            (source / "sub" / "x.txt").write_text("x")
            await box.copy_in(source, "/app/copied")
            assert (await box.exec("cat /app/copied/sub/x.txt")).stdout == "x"
            await box.copy_out("/app/deep", tmp_path / "out")
            assert (tmp_path / "out" / "dir" / "file.txt").read_text() == "written"
            big = await box.exec("head -c 3000000 /dev/zero | tr '\\0' a")
            assert len(big.stdout) < 1_100_000 and big.stdout.endswith("more bytes cut]")
            await box.exec("ln -s /etc/passwd /app/link; ln -s / /app/rootlink")
            for path in ("/app/link", "/app/rootlink/etc/group", "/app/../etc/passwd", "/etc/passwd", "relative"):
                with pytest.raises(SandboxError):
                    await box.read_file(path)
            with pytest.raises(SandboxError):
                await box.write_file("/usr/evil", "x")
            root = box.root  # type: ignore[attr-defined]
            assert root.is_dir()
        assert not root.exists()  # stopped: nothing left

    run(body())


def test_a_command_past_its_timeout_is_killed_with_everything_it_started(tmp_path: Path) -> None:
    async def body() -> None:
        async with LocalSandbox(Limits(timeout_s=1.0), root=tmp_path / "boxes") as box:
            began = time.monotonic()
            done = await box.exec("sleep 300 & sleep 301; echo never")
            assert done.timed_out and done.exit_code != 0 and "never" not in done.stdout
            assert time.monotonic() - began < 10
        assert "sleep 30" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout

    run(body())


FORKS = """
import os, time
children = []
try:
    for _ in range(100):
        pid = os.fork()
        if pid == 0:
            time.sleep(3)
            os._exit(0)
        children.append(pid)
    print("forked", len(children))
except OSError:
    print("refused after", len(children))
"""


def test_memory_and_processes_are_bounded(tmp_path: Path) -> None:
    async def body() -> None:
        async with LocalSandbox(Limits(memory_mb=64, max_processes=40), root=tmp_path / "boxes") as box:
            hog = await box.exec("python3 -c \"b = bytearray(400 << 20); print('allocated')\"", timeout=60)
            assert hog.exit_code != 0 and "allocated" not in hog.stdout
            await box.write_file("/app/fork.py", FORKS)
            fork = await box.exec("python3 fork.py", timeout=60)
            assert "refused after" in fork.stdout, fork.stdout + fork.stderr

    run(body())


def test_an_agent_cannot_write_outside_read_another_episode_or_reach_the_network(tmp_path: Path) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    async def body() -> None:
        async with LocalSandbox(root=tmp_path / "boxes") as other, LocalSandbox(root=tmp_path / "boxes") as box:
            await other.write_file("/app/secret.txt", "other episode's")
            other_root = other.root  # type: ignore[attr-defined]
            for attempt in ("echo x > /etc/evil", "echo x > /usr/evil", "touch /evil", "echo x > /root/evil"):
                assert (await box.exec(attempt)).exit_code != 0, attempt
            for attempt in (f"cat {other_root}/app/secret.txt", f"ls {other_root}", f"ls {tmp_path}"):
                done = await box.exec(attempt)
                assert done.exit_code != 0 and "other episode" not in done.stdout, attempt
            probe = textwrap.dedent(
                f"""
                import socket
                for host in ("127.0.0.1", "10.0.0.1", "1.1.1.1"):
                    try:
                        socket.create_connection((host, {port} if host == "127.0.0.1" else 80), timeout=2)
                        print("reached", host)
                    except OSError as exc:
                        print("blocked", host, exc)
                """
            )
            done = await box.exec(f"python3 -c '{probe}'")
            assert "reached" not in done.stdout and done.stdout.count("blocked") == 3, done.stdout + done.stderr

    run(body())
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing waits to be accepted: the host's loopback never saw the sandbox
        server.accept()
    server.close()


KILLED_CLIENT = """
import asyncio, sys
from pathlib import Path
from agentjet_client.sandbox import LocalSandbox

async def main():
    box = LocalSandbox(root=Path(sys.argv[1]))
    await box.start()
    print(box.root, flush=True)
    await box.exec("sleep 1234")

asyncio.run(main())
"""


def test_a_client_killed_mid_episode_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    boxes = tmp_path / "boxes"
    client = subprocess.Popen(
        [sys.executable, "-c", KILLED_CLIENT, str(boxes)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert client.stdout is not None
    left = Path(client.stdout.readline().strip())
    deadline = time.monotonic() + 20
    while "sleep 1234" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the sandbox's command never started"
        time.sleep(0.05)
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=10)
    client.stdout.close()
    assert left.is_dir()  # the killed client could not clean up

    import agentjet_client.sandbox.local as local

    local._cleaned = False  # as in a new process: the first sandbox cleans up

    async def body() -> None:
        async with LocalSandbox(root=boxes) as box:
            assert (await box.exec("true")).ok

    run(body())
    assert not left.exists()
    deadline = time.monotonic() + 10
    while "sleep 1234" in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout:
        assert time.monotonic() < deadline, "the killed client's sandbox process is still running"
        time.sleep(0.05)


def test_a_command_reaches_its_model_endpoint_and_the_call_is_captured(model_dir: Path, tmp_path: Path) -> None:
    from agentjet_client import SwarmClient
    from tests.conftest import LiveServer

    server = LiveServer(model_dir, batch_groups=1, group_size=2, max_staleness=100)
    body = '{"model": "m", "messages": [{"role": "user", "content": "Write seven as a digit."}], "max_tokens": 3}'
    call = f"curl -s -X POST \"$OPENAI_BASE_URL/chat/completions\" -H 'content-type: application/json' -d '{body}'"

    async def inside(url: str) -> tuple[str, str]:
        async with LocalSandbox(root=tmp_path / "boxes", model_url=url) as box:
            done = await box.exec(f"{call}; echo; {call}")
            assert done.ok, done.stderr
            return done.stdout, box.model_url_inside  # type: ignore[attr-defined, return-value]

    try:
        with SwarmClient(server.url) as client:
            episode = client.episode("sandboxed")
            answers, url_inside = run(inside(episode.base_url))
            trajectory = episode.to_trajectory(1.0)
            episode.close()
            pushed = client.submit([trajectory]).results[0]
    finally:
        server.stop()
    assert url_inside.startswith("http://127.0.0.1:8000/episodes/")
    assert answers.count('"chat.completion"') == 2  # both answered, through the relay
    assert len(trajectory.turns) == 2 and all(turn.signature for turn in trajectory.turns)  # captured
    assert pushed.status == "accepted", pushed  # the server verified what it sampled: token-exact
