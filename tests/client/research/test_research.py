"""The study file, the trial plan, early stopping and the metrics reader, without servers
(tests/e2e/test_research.py runs studies against real ones)."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentjet_client.errors import StudyError
from agentjet_client.research.launch import server_command
from agentjet_client.research.monitor import Observation, eval_episodes, parse_metrics, reward_totals
from agentjet_client.research.series import Series, train_metric
from agentjet_client.research.stopping import Point, RewardWindow, stop_reason
from agentjet_client.research.study import StopSection, StudySection, load_study, machine_parallel
from agentjet_client.research.trial import TrialDir, TrialRecord

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "research" / "digits_study.toml"


def write(tmp_path: Path, space: str, study: str = "", server: str = "", client: str = "") -> Path:
    path = tmp_path / "study.toml"
    path.write_text(
        f"[study]\n{study}\n[trial]\nepisodes = 100\n[server]\n{server}\n"
        f'[client]\ncode_dir = "{ROOT / "examples" / "digits"}"\n{client}\n[space]\n{space}\n'
    )
    return path


def test_the_example_study_plans_a_grid_of_four_trials_with_code_dirs_relative_to_the_file():
    study, digest = load_study(EXAMPLE)
    configurations = study.configurations()
    assert configurations == [  # every combination, keys in sorted order
        {"server.group_size": 8, "server.lr": 1e-3},
        {"server.group_size": 8, "server.lr": 3e-3},
        {"server.group_size": 16, "server.lr": 1e-3},
        {"server.group_size": 16, "server.lr": 3e-3},
    ]
    assert len(configurations) == 4 and len(digest) == 16
    server = study.server_settings(configurations[0])
    assert server["batch_groups"] == 10 and server["lr"] == configurations[0]["server.lr"]
    client = study.client_settings(configurations[0], EXAMPLE.parent)
    assert client.code_dir == ROOT / "examples" / "digits"


def test_random_search_draws_the_same_trials_for_a_seed_within_the_ranges(tmp_path):
    space = '"server.lr" = { log_uniform = [1e-4, 1e-2] }\n"server.group_size" = [4, 8]\n'
    space += '"client.env.AGENTJET_DIGITS" = ["3,8", "1,2"]\n"server.clip_high" = { uniform = [0.2, 0.3] }\n'
    path = write(tmp_path, space, study='search = "random"\ntrials = 6\nseed = 3')
    first, _ = load_study(path)
    again, _ = load_study(path)
    drawn = first.configurations()
    assert drawn == again.configurations() and len(drawn) == 6
    for settings in drawn:
        assert 1e-4 <= settings["server.lr"] <= 1e-2 and settings["server.group_size"] in (4, 8)
        assert 0.2 <= settings["server.clip_high"] <= 0.3
    assert len({d["server.lr"] for d in drawn}) == 6
    client = first.client_settings(drawn[0], tmp_path)
    assert client.env["AGENTJET_DIGITS"] == drawn[0]["client.env.AGENTJET_DIGITS"]


def test_bare_dotted_space_keys_are_read_as_settings(tmp_path):
    """``server.lr = [...]`` without quotes is a nested TOML table; it means the same."""
    study, _ = load_study(write(tmp_path, "server.lr = [1e-3, 2e-3]\nclient.concurrency = [8]"))
    assert study.configurations() == [
        {"client.concurrency": 8, "server.lr": 1e-3},
        {"client.concurrency": 8, "server.lr": 2e-3},
    ]
    assert study.client_settings(study.configurations()[0], tmp_path).concurrency == 8


@pytest.mark.parametrize(
    ("space", "study", "server", "message"),
    [
        ('"lr" = [1e-3]', "", "", "write server.NAME"),
        ('"server.lr" = { log_uniform = [1e-4, 1e-2] }', "", "", "a grid needs lists of values"),
        ('"server.lr" = { log_uniform = [0, 1e-2] }', 'search = "random"\ntrials = 2', "", "low > 0"),
        ('"server.lr" = []', "", "", "empty list"),
        ('"server.port" = [1, 2]', "", "", "the runner sets port"),
        ('"client.spool_dir" = ["x"]', "", "", "the client settings a study can search"),
        ('"server.lr" = [1e-3]', "", "port = 8000", "leave them out"),
        ('"server.lr" = [1e-3]', 'search = "random"', "", "set trials"),
        ('"server.lr" = [1e-3]', "parallel = 0", "", "parallel"),
        ('"server.lr" = [1e-3]', 'serch = "grid"', "", "[study.serch]"),
        ("", "", "", "[space] is empty"),
    ],
)
def test_a_bad_study_file_is_refused_with_what_to_change(tmp_path, space, study, server, message):
    with pytest.raises(StudyError) as caught:
        load_study(write(tmp_path, space, study=study, server=server))
    assert message in str(caught.value)


def test_a_code_dir_without_an_agent_is_refused_relative_to_the_study_file(tmp_path):
    path = write(tmp_path, '"client.code_dir" = ["missing"]')
    with pytest.raises(StudyError, match=r"missing has no agent.py \(paths are relative to the study file\)"):
        load_study(path)


def test_the_command_line_prints_one_line_for_a_bad_study(tmp_path):
    path = write(tmp_path, '"lr" = [1]')
    proc = subprocess.run(
        [sys.executable, "-m", "agentjet_client", "research", "run", str(path), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "write server.NAME" in proc.stderr and "Traceback" not in proc.stderr


def test_parallel_trials_follow_the_devices_listed_or_the_cores_and_memory():
    n, why = machine_parallel(StudySection(devices=["cuda:0", "cuda:1", "cuda:2"]))
    assert n == 3 and "device" in why
    n, why = machine_parallel(StudySection(cores_per_trial=1, memory_per_trial_gb=1e-3))
    cores = len(__import__("os").sched_getaffinity(0))
    assert n == cores and f"{cores} cores" in why
    n, _ = machine_parallel(StudySection(cores_per_trial=1, memory_per_trial_gb=1e6))
    assert n == 1  # the memory bounds it
    n, why = machine_parallel(StudySection(parallel=5, cores_per_trial=10_000))
    assert n == 5 and "the machine suggests 1" in why


def test_a_trial_server_takes_the_devices_in_turn_or_else_its_share_of_the_cores(tmp_path):
    on_cpu, _ = load_study(write(tmp_path, "server.lr = [0.001]", study="cores_per_trial = 3"))
    files = TrialDir(tmp_path, "t1")
    record = TrialRecord(id="t1", index=1, settings={"server.lr": 0.001}, port=12345)
    command, env = server_command(["agentjet-server"], on_cpu, record, files, resume=True, parallel=2)
    assert command[:2] == ["agentjet-server", "up"] and "--resume" in command and "--device" not in command
    assert command[command.index("--port") + 1] == "12345" and env["OMP_NUM_THREADS"] == "3"
    alone = server_command(["agentjet-server"], on_cpu, record, files, resume=False, parallel=1)
    assert "--fresh" in alone[0] and alone[1].get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")
    on_gpus, _ = load_study(write(tmp_path, "server.lr = [0.001]", study='devices = ["cuda:0", "cuda:1"]'))
    command, env = server_command(["agentjet-server"], on_gpus, record, files, resume=False, parallel=2)
    assert command[command.index("--device") + 1] == "cuda:1"  # trial index 1


def points(rewards: list[float], window: int = 100) -> list[Point]:
    return [Point(t=i * 10.0, episodes=(i + 1) * window, reward=r, n=window) for i, r in enumerate(rewards)]


def step(n: int, **figures: float) -> dict[str, float]:
    return {"step": n, "loss": 0.1, "grad_norm": 0.5, **figures}


def test_a_reward_that_falls_below_half_its_best_for_three_windows_is_a_collapse():
    rules = StopSection(window=400)
    series = points([0.1, 0.12, 0.0, 0.01, 0.0], 400)
    reason = stop_reason(rules, series, [], [])
    assert reason is not None and reason.startswith("collapse: training reward fell from 0.120 (at 800 episodes)")
    assert stop_reason(rules, series[:-1], [], []) is None  # two windows are not enough
    fell = stop_reason(rules, points([0.5, 0.9, 0.8, 0.3, 0.2, 0.3], 400), [], [])
    assert fell is not None and fell.startswith("collapse: training reward fell from 0.900")
    assert stop_reason(rules, points([0.5, 0.9, 0.8, 0.3, 0.5, 0.2], 400), [], []) is None  # one window back above
    assert stop_reason(rules, points([0.0, 0.0, 0.0, 0.0], 400), [], []) is None  # never above the floor
    assert stop_reason(StopSection(max_drop=None), points([0.9, 0.1, 0.1, 0.1], 400), [], []) is None
    # a small best over small windows: the fall is within what luck explains (under 4 standard errors)
    assert stop_reason(rules, points([0.04, 0.05, 0.01, 0.01, 0.01], 100), [], []) is None
    assert stop_reason(rules, points([0.04, 0.05, 0.01, 0.01, 0.01], 1000), [], []) is not None
    # rewards in [-1, 1]: the floor and ceiling say so
    signed = StopSection(reward_floor=-1.0, reward_ceiling=1.0)
    assert stop_reason(signed, points([0.0, 0.5, -0.6, -0.7, -0.8], 400), [], []) is not None
    assert stop_reason(signed, points([0.0, 0.5, 0.4, 0.3, 0.2], 400), [], []) is None


@pytest.mark.parametrize(("chance", "window"), [(0.25, 400), (0.1, 400), (0.05, 400), (0.02, 400), (0.05, 160)])
def test_an_untrained_policy_at_chance_is_not_called_collapsed(chance, window):
    """Windows of a policy at chance: the dips are noise, never a collapse (100 runs of 40 windows)."""
    rng = random.Random(0)
    rules = StopSection(window=window)
    for _ in range(100):
        series = points([sum(rng.random() < chance for _ in range(window)) / window for _ in range(40)], window)
        for end in range(4, len(series) + 1):
            assert stop_reason(rules, series[:end], [], []) is None, [p.reward for p in series[:end]]


def test_entropy_kl_and_non_finite_figures_outside_their_bounds_stop_the_trial():
    train = points([0.1, 0.2])
    rules = StopSection(min_entropy=0.05, max_entropy=5.0, max_kl=0.5)
    low = stop_reason(rules, train, [], [step(1, entropy=0.04), step(2, entropy=0.01)])
    assert low is not None and low.startswith("collapse: entropy 0.0250 below min_entropy 0.05")
    high = stop_reason(rules, train, [], [step(1, entropy=6.0)])
    assert high is not None and "above max_entropy" in high
    kl = stop_reason(rules, train, [], [step(1, entropy=1.0, approx_kl=0.9)])
    assert kl is not None and kl.startswith("collapse: approx KL 0.9000 above max_kl")
    assert stop_reason(rules, train, [], [step(1, entropy=1.0, approx_kl=0.1)]) is None
    nan = stop_reason(StopSection(), train, [], [{"step": 4, "grad_norm": 1.0}])  # the history drops a NaN loss
    assert nan == "collapse: non-finite loss at learner step 4"
    inf = stop_reason(StopSection(), train, [], [step(5, grad_norm=math.inf)])
    assert inf == "collapse: non-finite grad norm at learner step 5"


def test_a_plateau_on_evaluation_rounds_or_training_reward_ends_the_trial_after_min_episodes():
    rules = StopSection(plateau_points=3, plateau_delta=0.02, min_episodes=500)
    flat = points([0.1, 0.5, 0.6, 0.61, 0.6, 0.59])
    reason = stop_reason(rules, flat, [], [])
    assert reason is not None and reason.startswith("plateau: no gain over 0.02 in the last 3 windows")
    assert stop_reason(rules, points([0.1, 0.5, 0.6, 0.61, 0.6, 0.65]), [], []) is None  # still climbing
    assert stop_reason(StopSection(plateau_points=3, min_episodes=10_000), flat, [], []) is None
    assert stop_reason(StopSection(), flat, [], []) is None  # no plateau rule unless asked
    evals = [
        Point(t=i, episodes=200 * (i + 1), reward=r, n=50, version=i) for i, r in enumerate([0.2, 0.7, 0.7, 0.7, 0.7])
    ]
    on_evals = stop_reason(rules, points([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), evals, [])
    assert on_evals is not None and "evaluation rounds" in on_evals


def test_the_reward_window_reads_cumulative_totals_across_a_server_restart():
    window = RewardWindow(10)
    assert window.add(2.0, 6) is None
    assert window.add(5.0, 12) == (5.0 / 12, 12)
    assert window.add(6.0, 16) is None
    # the server restarted: its totals begin again from zero
    assert window.add(3.0, 8) == (4.0 / 12, 12)
    again = RewardWindow(10)
    again.restore(window.state())
    assert again.add(4.0, 18) == (1.0 / 10, 10)


def test_the_metrics_reader_sums_rewards_of_one_purpose_over_tags():
    text = "\n".join(
        [
            "# HELP agentjet_episode_reward Rewards of accepted episodes",
            "# TYPE agentjet_episode_reward summary",
            'agentjet_episode_reward_count{purpose="train",tag=""} 40.0',
            'agentjet_episode_reward_sum{purpose="train",tag=""} 10.0',
            'agentjet_episode_reward_count{purpose="train",tag="a \\"quoted\\" tag"} 10.0',
            'agentjet_episode_reward_sum{purpose="train",tag="a \\"quoted\\" tag"} 5.0',
            'agentjet_episode_reward_count{purpose="eval",tag=""} 7.0',
            'agentjet_episode_reward_sum{purpose="eval",tag=""} 7.0',
            "agentjet_learner_loss NaN",
            "agentjet_policy_version 12.0",
        ]
    )
    samples = parse_metrics(text)
    assert reward_totals(samples, "train") == (15.0, 50)
    assert reward_totals(samples, "eval") == (7.0, 7)
    assert samples[("agentjet_policy_version", frozenset())] == 12.0
    assert math.isnan(samples[("agentjet_learner_loss", frozenset())])
    episodes = eval_episodes(
        [
            {"kind": "eval", "task_id": "eval:digit-3@c1:2", "policy_version": 3, "reward": 1.0},
            {"kind": "eval", "task_id": "eval:digit-8@c1:2", "policy_version": 4, "reward": 0.0},
            {"kind": "step", "policy_version": 4},
            {"kind": "eval", "task_id": "eval:digit-3@c1:3", "policy_version": 5, "reward": 1.0},
            {"kind": "eval", "task_id": "other", "policy_version": 6, "reward": 0.5},
            {"kind": "eval", "task_id": "other", "policy_version": 6},  # no reward: not an episode to count
        ]
    )
    assert [(e.round, e.version, e.reward) for e in episodes] == [
        ("c1:2", 3, 1.0),  # one round though the policy moved during it
        ("c1:2", 4, 0.0),
        ("c1:3", 5, 1.0),
        ("v6", 6, 0.5),
    ]


def test_the_series_makes_a_point_per_window_and_per_finished_round_and_reloads_from_disk(tmp_path):
    files = TrialDir(tmp_path, "t0")
    files.path.mkdir(parents=True)
    record = TrialRecord(id="t0", index=0, settings={}, phase="training", run_started_at=time.time())
    series = Series.load(files, 10, record)

    def poll(total: float, count: int, lines: list[dict[str, object]], last_seq: int) -> Observation:
        return Observation({"trajectories": {"accepted": count}}, total, count, lines, last_seq)

    def episode(round_: int, version: int, reward: float) -> dict[str, object]:
        return {"kind": "eval", "task_id": f"eval:a@c1:{round_}", "policy_version": version, "reward": reward}

    first_round = [episode(1, 2, 1.0), episode(1, 3, 0.0)]
    series.observe(record, poll(3.0, 6, [*first_round, {"kind": "step", "step": 1, "loss": 0.5}], 3))
    assert series.train == [] and series.evals == [] and len(series.steps) == 1  # the round may still grow
    series.observe(record, poll(8.0, 12, [episode(2, 4, 1.0)], 4))
    assert [(p.reward, p.n) for p in series.train] == [(8.0 / 12, 12)] and record.last_reward == 8.0 / 12
    assert [(p.reward, p.n, p.version) for p in series.evals] == [(0.5, 2, 2)]  # round 2 began; at its oldest version
    assert record.episodes == 12 and record.history_seq == 4

    again = Series.load(files, 10, record)  # the runner restarted: the points and the window come back
    assert [p.to_json() for p in again.train + again.evals] == [p.to_json() for p in series.train + series.evals]
    assert again.window.state() == series.window.state()
    assert train_metric(again.train) == 8.0 / 12

    assert not series.final(record, [{"kind": "step"}])  # no evaluation episode yet
    assert series.final(record, first_round) and record.metric == 0.5
    assert Point.from_json(files.points()[-1]).version == 3  # the newest policy that played it
    assert [p["kind"] for p in files.points()] == ["train", "eval", "final"]


def test_every_problem_of_a_study_file_is_reported_at_once(tmp_path):
    path = write(tmp_path, '"lr" = [1e-3]\n"server.port" = [1]', study='search = "random"', server="port = 8000")
    with pytest.raises(StudyError) as caught:
        load_study(path)
    for problem in ("write server.NAME", "the runner sets port", "leave them out", "set trials"):
        assert problem in str(caught.value), caught.value


def test_an_eval_reward_study_of_an_agent_without_eval_tasks_is_refused_before_it_trains(tmp_path):
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(
        "from agentjet_client import swarm_agent\n\n\n"
        '@swarm_agent(tasks=[{"id": "t"}])\n'
        "async def no_held_out(task, episode):\n"
        "    return 1.0\n"
    )
    path = write(tmp_path, f'"server.lr" = [1e-3]\n"client.code_dir" = ["{code}"]')
    with pytest.raises(StudyError, match='metric = "eval_reward" needs held-out tasks') as caught:
        load_study(path)
    assert f"the agent in {code} has none" in str(caught.value)
    load_study(
        write(tmp_path, f'"server.lr" = [1e-3]\n"client.code_dir" = ["{code}"]', study='metric = "train_reward"')
    )


def test_pbt_exploits_only_from_the_bottom_and_only_a_trial_that_leads_by_min_z_standard_errors():
    from agentjet_client.research.tuning import Candidate, exploit_choice

    def at(i: str, score: float, n: int = 800) -> Candidate:
        return Candidate(i, score, n, score * (1 - score))

    rng = random.Random(0)
    population = [at("a", 0.6), at("b", 0.5), at("c", 0.3), at("d", 0.1)]
    assert exploit_choice("d", population, 0.25, rng, min_z=2.0) == "a"  # the worst takes from the best
    assert exploit_choice("c", population, 0.25, rng, min_z=2.0) is None  # not in the bottom quarter
    assert {exploit_choice("c", population, 0.5, rng) for _ in range(50)} == {"a", "b"}  # the top half, at random
    noisy = [at("a", 0.12, 320), at("b", 0.10, 320)]  # both at chance: a lead of 0.02 is luck
    assert exploit_choice("b", noisy, 0.5, rng, min_z=2.0) is None
    assert exploit_choice("b", noisy, 0.5, rng, min_z=0.0) == "a"
    assert exploit_choice("a", [at("a", 0.5)], 0.5, rng) is None  # a population of one


def test_explore_perturbs_numbers_keeps_integers_whole_and_resamples_from_the_space():
    from agentjet_client.research.tuning import explore

    rng = random.Random(1)
    values = {"server.lr": 1e-3, "server.group_size": 8, "server.off_policy": "tis"}
    seen = [explore(values, [0.8, 1.25], 0.0, lambda k: None, rng) for _ in range(40)]
    assert {s["server.lr"] for s in seen} == {8e-4, 1.25e-3}
    assert {s["server.group_size"] for s in seen} == {6, 10} and {s["server.off_policy"] for s in seen} == {"tis"}
    drawn = explore(values, [0.8], 1.0, lambda k: f"drawn {k}", rng)
    assert drawn == {k: f"drawn {k}" for k in values}


def test_an_adjust_rule_fires_on_the_mean_of_its_last_steps_and_scales_or_sets_settings():
    from agentjet_client.research.tuning import AdjustRule

    rule = AdjustRule(when="approx_kl > 0.05", over=3, set={"lr": "x0.5", "entropy_coef": 0.01})
    steps = [{"step": i, "approx_kl": kl} for i, kl in enumerate([0.2, 0.01, 0.01, 0.01], 1)]
    assert rule.fires(steps) is None  # the last three: 0.01 on average
    assert rule.fires(steps[:3]) == (pytest.approx((0.2 + 0.01 + 0.01) / 3), 3)  # with the spike: 0.073
    assert rule.fires(steps[:2]) is None  # fewer steps than `over`
    assert rule.fires([{"step": 1, "approx_kl": None}] * 3) is None  # a figure the steps lack
    assert rule.new_values({"lr": 3e-3, "entropy_coef": 0.0}) == {"lr": 1.5e-3, "entropy_coef": 0.01}
    for when in ("kl is high", "approx_kl >> 1", "approx_kl > x"):
        with pytest.raises(ValueError, match=r"FIGURE > BOUND|is not a number"):
            AdjustRule(when=when, set={"lr": "x0.5"})
    with pytest.raises(ValueError, match=r"\"x0\.5\" to multiply"):
        AdjustRule(when="loss > 1", set={"lr": "half"})


def test_pbt_and_adjust_problems_in_a_study_file_are_refused_with_what_to_change(tmp_path):
    pbt = "\n[pbt]\nevery_episodes = 100\n"
    path = write(tmp_path, '"server.lr" = [1e-3, 2e-3]', study='search = "halving"')
    path.write_text(path.read_text() + pbt + '\n[[adjust]]\nwhen = "loss > 1"\nset = { port = 1 }\n')
    with pytest.raises(StudyError) as caught:
        load_study(path)
    assert "[pbt] and halving" in str(caught.value) and "[[adjust]] sets port" in str(caught.value)
    path = write(tmp_path, '"client.concurrency" = [8, 16]')
    path.write_text(path.read_text() + pbt)
    with pytest.raises(StudyError, match=r"\[pbt\] explores searched server settings"):
        load_study(path)
    path = write(tmp_path, '"server.lr" = [1e-3, 2e-3]')
    path.write_text(path.read_text() + pbt + 'keys = ["client.concurrency"]\n')
    with pytest.raises(StudyError, match=r"\[pbt\] keys client.concurrency"):
        load_study(path)
    path = write(tmp_path, '"server.lr" = [1e-3, 2e-3]')
    path.write_text(path.read_text() + pbt)
    study, _ = load_study(path)
    assert study.pbt_keys() == ["server.lr"] and machine_parallel(study.study, 2)[0] == 2


def test_one_runner_per_study_directory_and_the_second_is_told_who_holds_it(tmp_path):
    import os
    import subprocess
    import sys

    from agentjet_client.errors import StudyError
    from agentjet_client.research.trial import RunnerLock

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from agentjet_client.research.trial import RunnerLock; lock = RunnerLock(Path(sys.argv[1])); lock.take(); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock = RunnerLock(tmp_path)
        assert lock.held_elsewhere()
        with pytest.raises(StudyError, match=rf"another runner \(pid {holder.pid}\) is running the study in"):
            lock.take()
    finally:
        holder.kill()  # SIGKILL: the lock goes with the process
        holder.wait(timeout=30)
        holder.stdout.close()  # type: ignore[union-attr]
    lock = RunnerLock(tmp_path)
    assert not lock.held_elsewhere()
    lock.take()
    assert (tmp_path / "runner.pid").read_text() == f"pid {os.getpid()}"
    lock.release()
