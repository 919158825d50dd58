"""agentjet-client[openenv] alone: the example's environment served by OpenEnv's own server, played by the model."""

import subprocess
import sys
import tempfile
from pathlib import Path

from _smoke import ROOT, free_port, try_example, wait_for

port = free_port()
log = Path(tempfile.mkdtemp(prefix="agentjet-smoke-openenv-")) / "env.log"
with log.open("wb") as out:
    env = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "openenv_echo" / "echo_env.py"), "--port", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
try:
    wait_for(f"http://127.0.0.1:{port}/health", env, log)
    played = try_example("openenv_echo", {"AGENTJET_OPENENV_URL": f"http://127.0.0.1:{port}"})
finally:
    env.terminate()
    env.wait(timeout=30)
assert "── call 0" in played and "reward" in played, played
print("openenv: examples/openenv_echo plays an episode against OpenEnv's server")
