"""What ``agentjet-client gateway`` reads from its command line: the redaction hook, the label table, the judge."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from agentjet_client.errors import InputError
from agentjet_client.logs import console_logging

if TYPE_CHECKING:
    from agentjet_client.tasks.judges import Judge


def load_hook(spec: str) -> Callable[[str], str]:
    """``module:function`` (importable from the working directory) or ``path/to/file.py:function``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"--redact {spec}: give MODULE:FUNCTION or FILE.py:FUNCTION")
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"--redact {spec}: no file {path}")
        loaded = importlib.util.spec_from_file_location(f"agentjet_redact_{path.stem}", path)
        assert loaded is not None and loaded.loader is not None
        module: Any = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ValueError(f"--redact {spec}: cannot import {where} ({exc})") from exc
    hook = getattr(module, name, None)
    if not callable(hook):
        raise ValueError(f"--redact {spec}: {where} has no function {name}")
    return hook  # type: ignore[no-any-return]


def parse_labels(values: list[str]) -> dict[str, float]:
    from agentjet_client.gateway.service import DEFAULT_LABELS

    labels = dict(DEFAULT_LABELS)
    for value in values:
        name, sep, number = value.partition("=")
        try:
            labels[name.strip()] = float(number)
        except ValueError:
            raise ValueError(f"--label {value}: give NAME=REWARD, say thumbs_up=1") from None
        if not sep or not name.strip():
            raise ValueError(f"--label {value}: give NAME=REWARD, say thumbs_up=1")
    return labels


def make_judge(url: str | None, model: str | None, criteria: str) -> Judge | None:
    """The judge of ``--judge-url``/``--judge-model``/``--judge-criteria`` (``@FILE`` reads the criteria), or
    None without a URL. Its API key comes from ``AGENTJET_JUDGE_API_KEY``."""
    if url is None:
        if model is not None:
            raise ValueError("--judge-model names the judge's model: give its endpoint with --judge-url too")
        return None
    if not model:
        raise ValueError(f"--judge-url {url}: name the judge's model with --judge-model")
    if criteria.startswith("@"):
        path = Path(criteria[1:]).expanduser()
        if not path.is_file():
            raise ValueError(f"--judge-criteria {criteria}: no file {path}")
        criteria = path.read_text()
    if not criteria.strip():
        raise ValueError("--judge-criteria is empty: say what the judge rewards")
    from agentjet_client.tasks.judges import Judge

    return Judge(url, model, criteria)


console = Console(soft_wrap=True)  # a line stays one line in a pipe or a log (grep-able)
err = Console(stderr=True, soft_wrap=True)


# gateway's options, one type each (the command's signature then reads as a list)
Servers = Annotated[
    list[str] | None,
    typer.Option(
        metavar="<url>",
        help="the swarm server for every agent; NAME=URL (repeatable) sends agent NAME's calls to another "
        "[default: http://127.0.0.1:8000]",
    ),
]
ApiKey = Annotated[str | None, typer.Option(help="server API key", envvar="AGENTJET_API_KEY")]
Host = Annotated[str, typer.Option(help="the address deployed agents reach the gateway at")]
Port = Annotated[int, typer.Option(help="the gateway's port")]
SpoolDir = Annotated[
    Path | None, typer.Option(help="its journal and spools; a restart with the same folder goes on [default: data dir]")
]
Idle = Annotated[float, typer.Option(min=0.001, help="seconds without a call after which a session ends")]
Ttl = Annotated[float, typer.Option(min=0.001, help="seconds after its last call that a session waits for its reward")]
FanOut = Annotated[int, typer.Option(min=0, help="sample a session's first call N times; the user gets the first")]
OptIn = Annotated[bool, typer.Option("--opt-in", help="train only sessions whose calls send X-AgentJet-Train: yes")]
Redact = Annotated[
    str | None,
    typer.Option(
        metavar="<module:function>", help="str -> str, applied to every text of a request before it leaves the gateway"
    ),
]
Fallback = Annotated[
    str | None, typer.Option(metavar="<url>", help="an OpenAI base URL to answer from while the server is down")
]
Labels = Annotated[
    list[str] | None, typer.Option(metavar="<name=reward>", help="a feedback label and its reward (repeatable)")
]
GroupBy = Annotated[
    str, typer.Option(help="GRPO siblings: prompt (same first request), header (X-AgentJet-Group), session")
]
Tag = Annotated[str | None, typer.Option(help="the task tag of its episodes (a multi-task mix)")]
JudgeUrl = Annotated[
    str | None,
    typer.Option(metavar="<url>", help="an OpenAI base URL whose model rewards sessions without feedback"),
]
JudgeModel = Annotated[str | None, typer.Option(help="the judge's model name")]
JudgeCriteria = Annotated[str, typer.Option(help="what the judge rewards; @FILE reads it from a file")]
JudgeAfter = Annotated[
    float, typer.Option(min=0.0, help="seconds an ended session waits for feedback before it is judged")
]
LogLevel = Annotated[str, typer.Option(help="logging level")]
CRITERIA = "Score how well the assistant's final answer serves the user's request."


def gateway_command(
    server: Servers = None,
    api_key: ApiKey = None,
    host: Host = "127.0.0.1",
    port: Port = 8100,
    spool_dir: SpoolDir = None,
    idle: Idle = 600.0,
    ttl: Ttl = 21600.0,
    fan_out: FanOut = 0,
    opt_in: OptIn = False,
    redact: Redact = None,
    fallback: Fallback = None,
    label: Labels = None,
    group_by: GroupBy = "prompt",
    tag: Tag = None,
    judge_url: JudgeUrl = None,
    judge_model: JudgeModel = None,
    judge_criteria: JudgeCriteria = CRITERIA,
    judge_after: JudgeAfter = 60.0,
    log_level: LogLevel = "warning",
) -> None:
    """Serve the server's API to deployed agents and train on their sessions.

    Point an agent's base_url at http://HOST:PORT/v1. Its calls are captured
    per session (X-AgentJet-Session header, or the request's user); POST
    /v1/feedback {"session": ID, "reward": R} trains it. See docs/online.md.
    Example:
    agentjet-client gateway --server http://127.0.0.1:8000 --port 8100
    """
    from agentjet_client.delivery.spool import default_spool_dir
    from agentjet_client.gateway.service import Gateway, GatewayConfig
    from agentjet_client.run.session import parse_servers

    console_logging(log_level, err)
    try:
        default, agents = parse_servers(server or [])
        config = GatewayConfig(
            server=default,
            agents=agents,
            api_key=api_key,
            spool_dir=(spool_dir or default_spool_dir() / "gateway" / str(port)).expanduser(),
            idle_s=idle,
            ttl_s=ttl,
            fan_out=fan_out,
            opt_in=opt_in,
            redact=load_hook(redact) if redact else None,
            fallback=fallback,
            labels=parse_labels(label or []),
            group_by=group_by,
            task_tag=tag,
            judge=make_judge(judge_url, judge_model, judge_criteria),
            judge_after_s=judge_after,
        )
        made = Gateway(config, progress=lambda line: err.print(escape(line), highlight=False))
    except ValueError as exc:
        raise InputError(str(exc)) from None
    where = f"gateway {made.book.gateway_id} on http://{host}:{port}/v1 -> {made.client.server_url}"
    console.print(f"[cyan]agentjet-client[/cyan] {escape(where)}; journal {escape(str(made.journal.path))}")
    made.serve(host, port)
