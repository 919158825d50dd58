"""agentjet-client[research] alone: a study's report draws its plots with matplotlib."""

import tempfile
from pathlib import Path

from _smoke import ROOT

from agentjet_client.research.report import write_report
from agentjet_client.research.study import load_study
from agentjet_client.research.trial import StudyState, TrialDir, TrialRecord, write_atomic

study, digest = load_study(ROOT / "examples" / "research" / "digits_study.toml", check_code=False)
out = Path(tempfile.mkdtemp(prefix="agentjet-smoke-research-"))
trials = ["t000", "t001"]
for index, (trial, lr) in enumerate(zip(trials, (1e-3, 3e-3), strict=True)):
    folder = TrialDir(out, trial)
    folder.save(
        TrialRecord(
            id=trial, index=index, settings={"server.lr": lr}, phase="done", status="finished", metric=0.5 + index / 4
        )
    )
    for step in range(1, 6):
        folder.append_point("train", {"episodes": step * 1000, "t": step * 30.0, "reward": step / 10 + index / 20})
state = StudyState(
    name=study.study.name,
    study_file="study.toml",
    study_hash=digest,
    trials=trials,
    parallel=1,
    parallel_reason="smoke",
)
write_atomic(out / "study.json", state.model_dump_json())
report = write_report(out, study).read_text()
plots = sorted(p.name for p in (out / "plots").glob("*.png"))
assert "reward_vs_episodes.png" in plots and "No plots" not in report, (plots, report[:2000])
print(f"research: the report drew {len(plots)} plots ({', '.join(plots)})")
