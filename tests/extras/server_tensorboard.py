"""agentjet-server[tensorboard] alone: --log-to tensorboard's sink writes the history, read back by TensorBoard."""

import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agentjet_server.observe.metrics import History
from agentjet_server.observe.sinks import open_sinks

state = Path(tempfile.mkdtemp(prefix="agentjet-smoke-tb-"))
history = History(state / "metrics.jsonl", open_sinks(["tensorboard"], state, {}))
for step in (1, 2):
    history.append("step", step=step, policy_version=step, loss=1 / step, reward=step / 4)
history.close()
events = EventAccumulator(str(state / "tensorboard"))
events.Reload()
assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 0.5)], events.Tags()
print("tensorboard: two steps written and read back")
