"""``agentjet-server status`` and ``agentjet-server admin ...``: commands that only talk to a
running server over HTTP (no torch, no engine), through ``admin_client.AdminClient``."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from agentjet_server.admin_client import CALLER_KEY_ENVS, AdminClient, as_toml
from agentjet_server.errors import AgentJetServerError

err = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> None:
    err.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code=2)


_SERVER = Annotated[str, typer.Option(help="the server's base URL")]
_KEY = Annotated[
    str | None,
    typer.Option(
        help="the key to send: admin commands need an admin key, status any key",
        envvar=CALLER_KEY_ENVS,
        show_envvar=True,
    ),
]


def _call(server: str, api_key: str | None, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    try:
        with AdminClient(server, api_key, timeout=660.0) as client:
            return client.request(method, path, body)
    except AgentJetServerError as exc:
        _fail(str(exc))


def status(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """Show a server's policy version, learner step, trajectory counts and admission budget.

    Example: agentjet-server status --server http://127.0.0.1:8000
    """
    from agentjet_client.protocol import ServerStatus

    st = ServerStatus.model_validate(_call(server, api_key, "GET", "/v1/status"))
    Console(soft_wrap=True).print(f"server {escape(server)}: {escape(st.summary())}")


admin = typer.Typer(
    no_args_is_help=True,
    help="Steer a running server through its admin API (with keys set: an admin key, from --api-key or"
    " AGENTJET_ADMIN_KEY).",
)


@admin.command("pause")
def admin_pause(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """Stop learning after the step in progress; serving and ingestion go on.

    Example: agentjet-server admin pause --server http://127.0.0.1:8000
    """
    Console().print(_call(server, api_key, "POST", "/v1/admin/pause")["message"])


@admin.command("resume")
def admin_resume(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """Start learning again after a pause.

    Example: agentjet-server admin resume --server http://127.0.0.1:8000
    """
    Console().print(_call(server, api_key, "POST", "/v1/admin/resume")["message"])


@admin.command("checkpoint")
def admin_checkpoint(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """Write a checkpoint now (after the step in progress) and print its step and path.

    Example: agentjet-server admin checkpoint --server http://127.0.0.1:8000
    """
    info = _call(server, api_key, "POST", "/v1/admin/checkpoint")
    Console(soft_wrap=True).print(
        f"checkpoint at step {info['step']} (policy v{info['policy_version']}) in {info['seconds']:.1f}s: "
        f"{escape(info['path'])}"
    )


@admin.command("adopt")
def admin_adopt(
    checkpoint: Annotated[str, typer.Argument(help="a checkpoint dir (<state-dir>/checkpoints/step-N) or a state dir")],
    server: _SERVER = "http://127.0.0.1:8000",
    api_key: _KEY = None,
) -> None:
    """Take another run's checkpoint (its weights and optimizer state) after the step in progress,
    keeping this run's settings and step count: population-based training's exploit step. The
    path is read by the server, on its machine.

    Example (the server at --server takes another run's checkpoint):
    agentjet-server admin adopt runs/a/state/checkpoints/step-00000040
    """
    info = _call(server, api_key, "POST", "/v1/admin/adopt", {"checkpoint": checkpoint})
    Console(soft_wrap=True).print(
        f"adopted {escape(info['source'])} (step {info['source_step']} of its run): served as policy "
        f"v{info['policy_version']} from learner step {info['step']}"
        + (f"; checkpoint {escape(info['checkpoint'])}" if info["checkpoint"] else "")
    )


@admin.command("stop")
def admin_stop(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """Write a checkpoint, then stop the server cleanly (`up --resume` continues from it).

    Example: agentjet-server admin stop --server http://127.0.0.1:8000
    """
    Console(soft_wrap=True).print(escape(_call(server, api_key, "POST", "/v1/admin/stop")["message"]))


@admin.command("config")
def admin_config(
    server: _SERVER = "http://127.0.0.1:8000",
    api_key: _KEY = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="KEY=VALUE to change (repeatable); without it: show")
    ] = None,
) -> None:
    """Show the effective configuration, or change live settings (they apply from the next step).

    Example: agentjet-server admin config --set lr=0.0005 --set max_staleness=2
    """
    import json

    changes: dict[str, Any] = {}
    for item in set_ or []:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            _fail(f"--set {item!r}: write KEY=VALUE, e.g. --set lr=0.0005")
        try:
            changes[key.strip().replace("-", "_")] = json.loads(text)
        except ValueError:
            changes[key.strip().replace("-", "_")] = text  # a bare string
    out = Console(soft_wrap=True)
    if changes:
        result = _call(server, api_key, "PATCH", "/v1/admin/config", changes)
        change = result["changes"][-1] if result["changes"] else None
        out.print(f"changed: {escape(json.dumps(change['changes'] if change else changes))} (from the next step)")
        return
    result = _call(server, api_key, "GET", "/v1/admin/config")
    out.print(escape(as_toml(result["config"])))
    out.print(f"live settings (admin config --set KEY=VALUE): {', '.join(result['live'])}")
    if result["paused"]:
        out.print("learning is PAUSED (agentjet-server admin resume)")
    for change in result["changes"]:
        out.print(f"changed at step {change['step']}: {escape(json.dumps(change['changes']))}")


@admin.command("clients")
def admin_clients(server: _SERVER = "http://127.0.0.1:8000", api_key: _KEY = None) -> None:
    """List the client runs that pushed to the server: last seen, episodes, spool depth.

    Example: agentjet-server admin clients --server http://127.0.0.1:8000
    """
    import time

    clients = _call(server, api_key, "GET", "/v1/admin/clients")["clients"]
    out = Console(soft_wrap=True)
    if not clients:
        out.print("no client has pushed to this server yet")
    for c in clients:
        out.print(
            f"{escape(c['id'])}  last seen {time.time() - c['last_seen']:.0f}s ago  episodes {c['episodes']}  "
            f"running {c['running']}  spool {c['spool_depth']}  accepted {c['accepted']}  "
            f"rejected {c['rejected']}  evaluated {c['evaluated']}  code {escape(str(c['code_version']))}"
        )
