"""The two CLIs' status commands and their error lines, as a user runs them."""

import subprocess
import sys
from pathlib import Path

import httpx2

BIN = Path(sys.executable).parent


def run(*args):
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


def test_status_commands_print_one_line_summary(live_server):
    for cli in ("agentjet-server", "agentjet-client"):
        out = run(cli, "status", "--server", live_server.url)
        assert out.returncode == 0, out.stderr
        assert "model agentjet-tiny" in out.stdout and "admission budget" in out.stdout
    status = httpx2.get(live_server.url + "/v1/status").json()["learner"]
    assert status["last_error"] is None and isinstance(status["skipped_batches"], int)


def test_cli_errors_are_one_clear_line():
    out = run("agentjet-server", "up", "--batch-groups", "0")
    assert out.returncode == 2 and "--batch-groups" in out.stderr and "Traceback" not in out.stderr
    out = run("agentjet-client", "run", "--code-dir", "/nonexistent/dir")
    assert out.returncode == 2 and "is not a directory" in out.stderr and "Traceback" not in out.stderr


def test_engine_choice_errors_say_how_to_fix_them(tmp_path):
    import importlib.util
    import os

    out = run("agentjet-server", "up", "--engine", "tensorrt")
    assert out.returncode == 2 and "--engine" in out.stderr and "'vllm'" in out.stderr
    env = {**os.environ, "WORLD_SIZE": "2"}  # half a torchrun environment
    out = subprocess.run([str(BIN / "agentjet-server"), "up"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "torchrun --nproc_per_node" in out.stderr and "Traceback" not in out.stderr
    if importlib.util.find_spec("vllm") is None:  # here: says which package to install
        from tests.conftest import CACHE

        env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
        out = subprocess.run(
            [str(BIN / "agentjet-server"), "up", "--engine", "vllm", "--port", "0", "--state-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 2 and "agentjet-server[vllm]" in out.stderr and "Traceback" not in out.stderr


def test_a_state_dir_with_an_earlier_run_needs_resume_or_fresh(tmp_path):
    import os

    from agentjet_server.wal import TrajectoryLog
    from tests.conftest import CACHE

    log = TrajectoryLog(tmp_path / "log")
    log.append([{"k": "r", "id": "t0", "why": "stale"}])
    log.close()
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    command = [str(BIN / "agentjet-server"), "up", "--port", "0", "--state-dir", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    message = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds an earlier run (a trajectory log, no checkpoint yet); pass --resume" in message
    assert "--fresh to discard it" in message


def test_client_status_shows_the_spool(live_server, tmp_path):
    from agentjet_client.protocol import Trajectory
    from agentjet_client.spool import Spool, spool_key

    spool = Spool(tmp_path / spool_key(live_server.url))
    spool.put(Trajectory(id="left-1", task_id="t", turns=[], status="failed", reward=0.0))
    spool.note_error("server unreachable")
    spool.close()
    out = run("agentjet-client", "status", "--server", live_server.url, "--spool-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace("\n", " ")
    assert "spool depth 1/100000" in text and "spooled 1" in text and "server unreachable" in text
    assert "model agentjet-tiny" in text  # then the server's line
