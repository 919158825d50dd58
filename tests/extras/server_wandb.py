"""agentjet-server[wandb] alone: --log-to wandb's sink logs a run offline into the state dir."""

import os
import tempfile
from pathlib import Path

from agentjet_server.observe.metrics import History
from agentjet_server.observe.sinks import open_sinks

os.environ.pop("WANDB_MODE", None)  # offline is the sink's default
os.environ["WANDB_SILENT"] = "true"
state = Path(tempfile.mkdtemp(prefix="agentjet-smoke-wandb-"))
history = History(None, open_sinks(["wandb"], state, {"lr": 0.001}))
history.append("step", step=1, policy_version=1, loss=0.5, reward=0.25)
history.close()
runs = list((state / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
assert len(runs) == 1 and runs[0].stat().st_size > 0, runs
print(f"wandb: an offline run of {runs[0].stat().st_size} bytes")
