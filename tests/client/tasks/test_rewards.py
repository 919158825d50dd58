"""Rewards apart from the agent: rubrics of weighted reward functions, and LLM judges (per episode and per
group) run by the judging stage from the spool, against a real server and a real judge endpoint."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx2
import pytest

from agentjet_client import GroupJudge, Judge, Rubric, RunConfig, Runner, Spool, SwarmClient, swarm_agent
from agentjet_client.delivery.spool import WAITING
from agentjet_client.protocol import Trajectory, Turn
from agentjet_client.run.judging import JudgingStage, waiting_for
from agentjet_client.run.report import RunReport
from agentjet_client.tasks.judges import JudgeError, JudgeUnfit, parse_scores
from tests.conftest import RulesJudge

ASK = [{"role": "user", "content": "Write four as a digit."}]


def correct(task, result):
    return float(result.strip() == task["answer"])


async def brief(result):
    await asyncio.sleep(0)
    return 1.0 if len(result) <= 2 else 0.0


def test_a_rubric_sums_weighted_components_and_passes_what_each_function_asks_for():
    rubric = Rubric([(correct, 1.0), (brief, 0.5), lambda episode: 2.0])
    scored = asyncio.run(rubric.score({"answer": "4"}, "4", episode=None))
    assert scored.components == {"correct": 1.0, "brief": 1.0, "<lambda>": 2.0}
    assert scored.reward == 1.0 + 0.5 + 2.0
    with pytest.raises(TypeError, match="takes completion; a reward function takes any of task, result, episode"):
        Rubric([lambda completion: 1.0])
    with pytest.raises(ValueError, match="two reward functions are named correct"):
        Rubric([correct, correct])
    with pytest.raises(TypeError, match="weights are finite numbers"):
        Rubric([(correct, float("nan"))])
    with pytest.raises(TypeError, match="returned 'yes'; a reward function returns a finite number"):
        asyncio.run(Rubric([lambda result: "yes"]).score({}, "4", None))
    with pytest.raises(TypeError, match="give a function, a Rubric, a Judge or a GroupJudge"):
        swarm_agent(tasks=[{"id": "a"}], reward=3)(lambda task, episode: 1)


def test_judge_answers_are_read_wherever_the_scores_are_and_refused_without_them():
    assert parse_scores('{"scores": [0.2, 1.5, -1]}', 3) == [0.2, 1.0, 0.0]
    assert parse_scores('Ranking first.\n```json\n{"scores": [1, 0]}\n```', 2) == [1.0, 0.0]
    assert parse_scores('{"score": 0.7}', 1) == [0.7]
    for bad in ('{"scores": [1]}', "the second is better", '{"scores": [true, 0]}'):
        with pytest.raises(JudgeError, match="holds no"):
            parse_scores(bad, 2)


def test_a_run_with_a_rubric_records_its_components_and_a_raising_reward_fails_only_its_episodes(live_server):
    def strict(task, result):
        if task["id"] == "bad":
            raise ValueError("cannot score this one")
        return 1.0

    @swarm_agent(tasks=[{"id": "ok", "answer": "4"}, {"id": "bad", "answer": "4"}], reward=Rubric([correct, strict]))
    async def answer(task, episode):
        reply = await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=3)
        return reply.choices[0].message.content or ""

    with SwarmClient(live_server.url) as client:
        config = RunConfig(episodes=8, group_size=2, concurrency=4, seed=0, epochs=2, shuffle=False)
        report = asyncio.run(Runner(client, answer, config).run())
    assert report.finished == 8 and report.failed == 4
    ((reason, count),) = report.failure_reasons.items()
    assert count == 4 and "ValueError: cannot score this one" in reason
    listed = httpx2.get(f"{live_server.url}/v1/trajectories", params={"limit": 8}, timeout=10).json()["trajectories"]
    fine = [t for t in listed if t["status"] == "complete"]
    assert len(fine) == 4
    for item in fine:
        view = httpx2.get(f"{live_server.url}/v1/trajectories/{item['id']}", timeout=10).json()
        components = view["metadata"]["reward_components"]
        assert set(components) == {"correct", "strict"} and view["reward"] == components["correct"] + 1.0


def waiting_trajectory(group: str, k: int, result: str, judge: Judge, size: int) -> Trajectory:
    turn = Turn(
        policy_version=0,
        prompt_token_ids=[1, 2],
        completion_token_ids=[3],
        completion_logprobs=[-0.1],
        finish_reason="stop",
    )
    metadata = {"task": "t", WAITING: waiting_for(judge, {"id": "t", "word": "four"}, result, size, None)}
    return Trajectory(id=f"{group}/{k}", task_id=group, turns=[turn], metadata=metadata)


def judge_all(stage: JudgingStage, spool: Spool) -> None:
    async def main() -> None:
        job = asyncio.create_task(stage.run())
        deadline = asyncio.get_running_loop().time() + 30
        while spool.waiting():
            assert asyncio.get_running_loop().time() < deadline, "the stage did not judge everything"
            stage.wake()
            await asyncio.sleep(0.05)
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)

    asyncio.run(main())


def test_a_group_judge_ranks_a_group_in_one_call_keeps_the_answer_and_never_calls_twice_for_it(tmp_path: Path):
    endpoint = RulesJudge("length")
    try:
        judge = GroupJudge(endpoint.url, "rules", "Longer is better.")
        spool, report = Spool(tmp_path / "spool"), RunReport()
        results = ["aaa", "a", "aaaa", "aa"]
        spool.put_many([waiting_trajectory("g1", k, r, judge, 4) for k, r in enumerate(results[:3])])
        stage = JudgingStage(judge, {"s": spool}, "s", report, lambda: None)
        assert stage._ready() == []  # three of four: the group is not complete
        spool.put(waiting_trajectory("g1", 3, results[3], judge, 4))
        judge_all(stage, spool)
        judged = {t.id: t for _, t in spool.peek(10)}
        assert endpoint.calls() == 1 and report.judging["calls"] == 1
        ranking = sorted(judged, key=lambda i: judged[i].reward)
        assert ranking == ["g1/1", "g1/3", "g1/0", "g1/2"]  # the judge's ranking: by length
        assert judged["g1/2"].reward == 1.0 and WAITING not in judged["g1/2"].metadata
        assert judged["g1/2"].metadata["judge"]["kind"] == "group" and not judged["g1/2"].metadata["judge"]["cached"]
        # the same group again (the same results of the same task): its kept answer, no call
        spool.put_many([waiting_trajectory("g2", k, r, judge, 4) for k, r in enumerate(results)])
        judge_all(JudgingStage(judge, {"s": spool}, "s", report, lambda: None), spool)
        assert endpoint.calls() == 1 and report.judging["cached"] == 1
        again = {t.id: t.reward for _, t in spool.peek(10) if t.task_id == "g2"}
        assert again == {i.replace("g1", "g2"): judged[i].reward for i in judged}
        # one judge per episode: one call each
        single = Judge(endpoint.url, "rules", "Longer is better.")
        spool.put_many([waiting_trajectory(f"s{k}", 0, "x" * (k + 1), single, 1) for k in range(3)])
        judge_all(JudgingStage(single, {"s": spool}, "s", report, lambda: None), spool)
        assert endpoint.calls() == 4
        assert {t.reward for _, t in spool.peek(20) if t.task_id.startswith("s")} == {1.0}  # each alone: best
    finally:
        endpoint.stop()


def test_a_judge_that_is_down_holds_the_group_until_it_answers(tmp_path: Path):
    endpoint = RulesJudge("length")
    port = endpoint.port
    endpoint.stop()
    judge = GroupJudge(f"http://127.0.0.1:{port}/v1", "rules", "Longer is better.", retries=0, timeout=2)
    spool, report = Spool(tmp_path / "spool"), RunReport()
    spool.put_many([waiting_trajectory("g", k, "a" * (k + 1), judge, 2) for k in range(2)])
    stage = JudgingStage(judge, {"s": spool}, "s", report, lambda: None, retry=(0.2, 0.5))

    async def main() -> int:
        job = asyncio.create_task(stage.run())
        while report.judging["errors"] < 2:  # down: tried, failed, held, tried again
            stage.wake()
            await asyncio.sleep(0.05)
        held = len(spool.waiting())
        restarted = RulesJudge("length", port=port)
        try:
            while spool.waiting():
                await asyncio.sleep(0.05)
        finally:
            restarted.stop()
        job.cancel()
        await asyncio.gather(job, return_exceptions=True)
        return held

    assert asyncio.run(main()) == 2
    assert sorted(t.reward for _, t in spool.peek(10)) == [0.5, 1.0] and spool.depth == 2


def test_a_model_that_cannot_judge_stops_the_stage_after_answers_in_a_row_without_scores(
    live_server, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """The embedded model as a judge (it was never taught to answer with scores): the stage stops after
    ``max_unparsed`` such answers in a row, counts what they cost, says it once, and the episodes wait."""
    judge = GroupJudge(f"{live_server.url}/v1", "agentjet-tiny", "Prefer the digit.", max_tokens=8, max_unparsed=3)
    spool, report = Spool(tmp_path / "spool"), RunReport()
    for group in range(4):
        spool.put_many([waiting_trajectory(f"g{group}", k, str(k), judge, 2) for k in range(2)])
    stage = JudgingStage(judge, {"s": spool}, "s", report, lambda: None, retry=(0.05, 0.1))

    async def main() -> None:
        await asyncio.wait_for(stage.run(), timeout=60)

    with caplog.at_level("WARNING", logger="agentjet_client.run.judging"), pytest.raises(JudgeUnfit) as raised:
        asyncio.run(main())
    assert "3 answers in a row held no scores, so this model cannot judge" in str(raised.value)
    counts = report.judging
    # the calls under way when the third answer came are counted too (4 groups are judged at once)
    assert 3 <= counts["unparsed"] == counts["calls"] <= 4 and counts["errors"] == 0
    assert counts["prompt_tokens"] > 0 and counts["completion_tokens"] > 0 and counts["milliseconds"] > 0
    assert len(spool.waiting()) == 8  # nothing lost: they wait for a judge that can
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and len(warnings[0].getMessage()) < 400, [r.getMessage() for r in warnings]


def test_a_run_whose_judge_cannot_judge_ends_with_why(live_server, tmp_path: Path):
    """The run ends with the reason (it kept waiting for the judge for ever before)."""
    import subprocess
    import sys

    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(
        "from agentjet_client import GroupJudge, swarm_agent\n"
        f"judge = GroupJudge('{live_server.url}/v1', 'agentjet-tiny', 'Prefer the digit.', max_tokens=8)\n"
        "@swarm_agent(tasks=[{'id': 'three'}, {'id': 'eight'}], reward=judge)\n"
        "async def write(task, episode):\n"
        "    reply = await episode.async_openai().chat.completions.create(\n"
        "        model='m', messages=[{'role': 'user', 'content': 'Write three as a digit.'}], max_tokens=3)\n"
        "    return reply.choices[0].message.content\n"
    )
    exe = str(Path(sys.executable).parent / "agentjet-client")
    command = [exe, "run", "--code-dir", str(code), "--server", live_server.url, "--episodes", "64"]
    command += ["--spool-dir", str(tmp_path / "spool")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert "5 answers in a row held no scores, so this model cannot judge" in said, said[-3000:]


def test_calls_made_with_train_false_are_served_and_never_recorded_in_process_or_in_a_worker(live_server, tmp_path):
    """``episode.openai(train=False)``: a helper call (a critic, a judge of its own) goes to the server and
    is answered, and the trajectory holds only the episode's recorded call; the same from a sync agent in
    a worker process, through the proxy's untrained route."""
    seen: dict[str, int] = {}

    @swarm_agent(tasks=[{"id": "t"}])
    async def in_process(task, episode):
        critic = await episode.async_openai(agent="critic", train=False).chat.completions.create(
            model="agentjet-tiny", messages=ASK, max_tokens=2
        )
        seen["critic"] = len(critic.choices)
        await episode.async_openai().chat.completions.create(model="agentjet-tiny", messages=ASK, max_tokens=2)
        return 1.0

    code = tmp_path / "worker_agent"
    code.mkdir()
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n"
        "ASK = [{'role': 'user', 'content': 'Write four as a digit.'}]\n"
        "@swarm_agent(tasks=[{'id': 'w'}])\n"
        "def in_worker(task, episode):\n"
        "    critic = episode.openai(agent='critic', train=False)\n"
        "    critic.chat.completions.create(model='agentjet-tiny', messages=ASK, max_tokens=2)\n"
        "    episode.openai().chat.completions.create(model='agentjet-tiny', messages=ASK, max_tokens=2)\n"
        "    return 1.0\n"
    )
    from agentjet_client.run.tracks import open_track

    with SwarmClient(live_server.url) as client:
        config = RunConfig(episodes=2, group_size=2, concurrency=2, seed=0)
        report = asyncio.run(Runner(client, in_process, config).run())
        assert report.accepted == 2 and seen["critic"] == 1
        track = open_track(code, concurrency=2, watch=False)
        assert track.workers is not None  # a sync agent: its episodes run in worker processes
        try:
            worker_report = asyncio.run(Runner(client, [track], config).run())
        finally:
            track.workers.close()
    assert worker_report.accepted == 2 and worker_report.failed == 0
    listed = httpx2.get(f"{live_server.url}/v1/trajectories", params={"limit": 4}, timeout=10).json()["trajectories"]
    assert len(listed) == 4 and all(t["turns"] == 1 and t["agents"] == ["default"] for t in listed)
