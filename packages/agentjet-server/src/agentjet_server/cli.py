"""``agentjet-server``: start a swarm server, or ask one what it is doing."""

from __future__ import annotations

import logging
import sys
from inspect import Parameter, Signature
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, get_args, get_origin

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from agentjet_client import tracing
from agentjet_client.logs import configure_logging
from agentjet_server import admin_cli
from agentjet_server.admin_client import as_toml
from agentjet_server.errors import AgentJetServerError
from agentjet_server.starting import StartingPort

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AgentJet swarm server: serve and train one model.")
console = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {escape(message)}")  # messages quote [extras] and paths
    raise typer.Exit(code=2)


def _describe(error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    flag = (
        "-".join(str(x) for x in error["loc"]).replace("_", "-").removesuffix("-s")
    )  # header_timeout_s: --header-timeout
    return f"--{flag}: {message}" if flag else message


# options of `up` that are no setting of their own: the job file, keys (collected from flags, files and the
# environment into ``api_keys``/``admin_keys``) and the logging level; every other option is a field of
# ``ServerSettings``, generated from it (name, type, default, help): a new setting is one edit there
UP_EXTRAS = [
    (
        "config",
        Path | None,
        None,
        "job file (TOML) holding any of these options by name; flags given here override it",
        None,
    ),
    (
        "api_key",
        list[str] | None,
        None,
        "accepted client key (repeatable; visible in ps: prefer AGENTJET_API_KEYS or a file)",
        "Security",
    ),
    ("api_key_file", list[Path] | None, None, "file of accepted client keys, one per line (repeatable)", "Security"),
    ("admin_key", list[str] | None, None, "accepted admin key (repeatable)", "Security"),
    ("admin_key_file", list[Path] | None, None, "file of admin keys, one per line", "Security"),
    ("log_level", str, "info", "logging level", None),
    ("log_format", str, "text", "text, or json: a JSON object per line, with the run's ids", None),
]


def _cli_type(annotation: Any) -> Any:
    """What typer parses a setting's type as: a Literal as its values' type (pydantic checks the value),
    a mapping as text (``--mix math=3,tools=1``), a list as a repeatable option of text."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    optional = len(args) < len(get_args(annotation))
    core = args[0] if optional and len(args) == 1 else annotation
    origin = get_origin(core)
    if origin is Literal:
        core = type(get_args(core)[0])
    elif origin is list:
        core, optional = list[str], True
    elif origin is dict:
        core, optional = str, True
    return core | None if optional else core


def _negated(name: str) -> bool:
    """A switch that is on by default: ``up`` offers only its ``--no-`` side, as a flag of its own."""
    from agentjet_server.settings import ServerSettings

    return ServerSettings.model_fields[name].default is True


ENV_PREFIX = "AGENTJET_SERVER_"


def envvar_of(flag: str) -> str:
    """The environment variable that sets an option of ``up`` (for images and orchestrators, which
    configure by environment): ``--checkpoint-uri`` is ``AGENTJET_SERVER_CHECKPOINT_URI``,
    ``--no-metrics`` is ``AGENTJET_SERVER_NO_METRICS=1``. A flag given on the command line wins."""
    return ENV_PREFIX + flag.split("/")[0].removeprefix("--").replace("-", "_").upper()


def _option(name: str, field: Any, flag: str, panel: str) -> Parameter:
    """A setting as an option of ``up``. A switch is named by the side that changes its default
    (``--resume``, ``--no-memory-check``); one that other settings decide (None) has both sides. Names
    stay short enough to print whole in ``--help`` at 80 columns."""
    default = None if field.default_factory is not None else field.default
    kind = _cli_type(field.annotation)
    if kind is bool and default is True:
        decls, default = [f"--no-{flag}"], False
    elif kind in (bool, bool | None):
        decls = [f"--{flag}/--no-{flag}"] if default is None else [f"--{flag}"]
    else:
        decls = [f"--{flag}"]
    metavar = "<text>" if get_origin(field.annotation) in (list, dict) else None
    option = typer.Option(
        *decls,
        help=field.description,
        rich_help_panel=panel,
        metavar=metavar,
        envvar=envvar_of(decls[0]),
        show_envvar=False,
    )
    return Parameter(name, Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, option])


def _up_signature() -> Signature:
    from agentjet_server.settings import ServerSettings, flag_of, panel_of

    params = [Parameter("ctx", Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]

    def extra(name: str, annotation: Any, default: Any, help_text: str, panel: str | None) -> Parameter:
        metavar = "<file>" if name.endswith("_file") else "<key>" if name.endswith("_key") else None
        # keys themselves come from the environment as AGENTJET_API_KEYS / AGENTJET_ADMIN_KEYS (collect_keys)
        envvar = None if name.endswith("_key") else envvar_of(name.replace("_", "-"))
        option = typer.Option(help=help_text, rich_help_panel=panel, metavar=metavar, envvar=envvar, show_envvar=False)
        return Parameter(name, Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[annotation, option])

    params.append(extra(*UP_EXTRAS[0]))
    for name, field in ServerSettings.model_fields.items():
        flag = flag_of(name)
        if flag is not None:
            params.append(_option(name, field, flag, panel_of(name)))
    params += [extra(*row) for row in UP_EXTRAS[1:]]
    return Signature(params)


@app.command()
def up(ctx: typer.Context, **options: Any) -> None:
    """Serve a model through an OpenAI-compatible API and train it from pushed trajectories.

    Example: agentjet-server up --port 8000 --batch-groups 10 --group-size 16

    After a crash or a stop, continue where it left off (same --state-dir):
    agentjet-server up --resume

    Under torchrun the learner shards over the processes (FSDP2); rank 0 serves:
    torchrun --nproc_per_node 2 -m agentjet_server up --model PATH

    Reachable from other machines, with keys kept out of ps:
    AGENTJET_API_KEYS=client-key-1 agentjet-server up --host 0.0.0.0
    """
    given = {name: value for name, value in options.items() if name != "config"}
    from agentjet_server.settings import ADMIN_KEYS_ENV, API_KEYS_ENV, ServerSettings, collect_keys

    for name in ServerSettings.model_fields:  # `--no-metrics` given: metrics off
        if name in given and _negated(name):
            given[name] = not given[name]
    if options["config"] is not None:
        given = _with_job_file(ctx, options["config"], given)
    if given["log_format"] not in ("text", "json"):
        _fail(f"--log-format is text or json, not {given['log_format']!r}")
    configure_logging(str(given["log_level"]), given["log_format"])
    tracing.configure("agentjet-server")  # with the OTEL_* variables: spans over OTLP
    extras = {name for name, *_ in UP_EXTRAS}
    fields = {k: v for k, v in given.items() if k not in extras and v is not None}  # None: the setting's default
    try:
        fields["api_keys"] = collect_keys(
            list(given["api_key"] or []), [Path(p) for p in given["api_key_file"] or []], API_KEYS_ENV
        )
        fields["admin_keys"] = collect_keys(
            list(given["admin_key"] or []), [Path(p) for p in given["admin_key_file"] or []], ADMIN_KEYS_ENV
        )
        settings = ServerSettings(**fields)
    except ValidationError as exc:
        _fail("; ".join(_describe(e) for e in exc.errors()))
    except ValueError as exc:  # a key file that can't be read
        _fail(str(exc))
    try:
        serve(settings)
    except AgentJetServerError as exc:
        _fail(str(exc))


up.__signature__ = _up_signature()  # type: ignore[attr-defined]


def _with_job_file(ctx: typer.Context, path: Path, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the job file's values for every option not set on the command line. A key is an
    option's name as in --help (with - or _) or the setting's own name (``group_timeout_s``)."""
    import tomllib

    from agentjet_server.settings import ServerSettings, flag_of

    try:
        job = tomllib.loads(path.read_text())
    except OSError as exc:
        _fail(f"cannot read the job file {path}: {exc.strerror}")
    except tomllib.TOMLDecodeError as exc:
        _fail(f"the job file {path} is not valid TOML: {exc}")
    names = {name: name for name in given}
    names.update({(flag_of(n) or n).replace("-", "_"): n for n in ServerSettings.model_fields if n in given})
    out = dict(given)
    unknown = []
    for key, value in job.items():
        name = names.get(key.replace("-", "_"))
        if name is None:
            unknown.append(key)
        elif getattr(ctx.get_parameter_source(name), "name", "DEFAULT") == "DEFAULT":  # not given as a flag
            out[name] = value
    if unknown:
        _fail(
            f"the job file {path} has options `up` does not know: {', '.join(unknown)}; "
            f"it takes these (as in --help, with - or _): {', '.join(sorted(n for n in names if n != 'config'))}"
        )
    return out


def effective_configuration(settings: Any, changed_only: bool = False) -> str:
    """The settings as ``key = value`` lines (TOML: usable as a job file), keys redacted; with
    ``changed_only`` those that differ from their defaults."""
    from agentjet_server.control import public_settings

    shown = public_settings(settings)
    if changed_only:
        defaults = public_settings(type(settings).model_construct())
        shown = {name: value for name, value in shown.items() if value != defaults[name]}
    return as_toml(shown)


def _wrapped(items: list[str], width: int = 118) -> str:
    """``items`` joined by two spaces, as few lines of at most ``width`` characters as fit."""
    lines, line = [], ""
    for item in items:
        if line and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = ""
        line = f"{line}  {item}" if line else item
    return "\n".join([*lines, line])


def serve(settings: Any) -> None:
    """Rank 0 (or the only process): engine + HTTP + learner. Other torchrun ranks: learner only."""
    import os

    from agentjet_server.serving.parsing import check_parser_names

    # what can be refused without the model is refused before it is built or loaded
    check_parser_names(settings.tool_call_parser, settings.reasoning_parser)
    _chat_template(settings.chat_template)
    # rank 0 listens at once (before torch loads) and, until the app serves, answers what the start is doing
    starting = StartingPort.open(settings.host, settings.port) if os.environ.get("RANK", "0") == "0" else None
    if starting is not None and settings.port == 0:
        settings = settings.model_copy(update={"port": starting.sock.getsockname()[1]})
    finished = False
    ctx = None
    try:
        if starting is not None:
            starting.phase("loading torch")
        from agentjet_server.learner import distributed, loop

        ctx = distributed.init_from_env(settings.device, devices=settings.learner_device_list())
        if settings.engine_sleep and settings.engine_replicas > 1 and not _sleeping_replicas(settings, ctx):
            from agentjet_server import memory
            from agentjet_server.errors import ConfigError

            learner = ", ".join(memory.local_learner_devices(settings, ctx.device, ctx.world_size))
            raise ConfigError(
                f"--engine-sleep frees the memory of the engine replicas on the learner's devices ({learner}), "
                f"and --engine-devices {settings.engine_devices} puts none there: every replica serves on "
                "through the steps, so leave --engine-sleep out"
            )
        path = _model_path(settings, ctx, starting)
        settings = _memory_plan(settings, path, ctx)
        replicas = _remote_replicas(settings, path, ctx, starting)
        if not ctx.is_main:
            import signal

            from agentjet_server.runtime import build_learner

            # torchrun passes Ctrl-C / SIGTERM to every rank; this one stops when rank 0 says so,
            # after rank 0's last checkpoint (which needs this rank's shards)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            from agentjet_server.memory import hosts_replica

            # an engine replica sleeping on this rank's device wakes into the memory the step leaves
            hosts_sleeper = settings.engine_sleep and hosts_replica(settings, ctx.device)
            try:
                loop.worker_loop(
                    build_learner(settings, str(path), ctx), ctx, free_cache=hosts_sleeper, replicas=replicas
                )
            finally:
                if replicas is not None and replicas.host is not None:
                    replicas.host.close()
        else:
            assert starting is not None
            _serve_main(settings, path, ctx, starting, replicas)
        finished = True
    finally:
        if starting is not None:
            starting.close()
        if ctx is not None:
            distributed.shutdown(ctx, wait_for_others=finished)


def _sleeping_replicas(settings: Any, ctx: Any) -> list[int]:
    from agentjet_server import memory

    return memory.sleeping_replicas(settings, memory.local_learner_devices(settings, ctx.device, ctx.world_size))


def _memory_plan(settings: Any, path: Path, ctx: Any) -> Any:
    """Print what each device will hold and refuse a layout that cannot fit (every rank decides the
    same); vLLM on a GPU it shares with the learner gets the share the learner leaves."""
    from agentjet_server import memory

    plan = memory.check(settings, path, ctx.device, ctx.world_size, serves=ctx.is_main)
    # on the CPU nothing is planned that could not fit: the plan is for --log-level debug there
    if ctx.is_main and (str(ctx.device) != "cpu" or logging.getLogger().isEnabledFor(logging.DEBUG)):
        console.print("[cyan]agentjet[/cyan] memory plan:")
        console.print(escape(plan.describe()), style="dim")
    util = plan.layout.gpu_memory_utilization
    if settings.engine == "vllm" and settings.gpu_memory_utilization is None and util is not None:
        settings = settings.model_copy(update={"gpu_memory_utilization": util})
    return settings


def _model_path(settings: Any, ctx: Any, starting: StartingPort | None = None) -> Path:
    """``--model``, or the embedded model, built once by rank 0 while the other ranks wait."""
    from agentjet_server.embedded import ensure_embedded_model

    def progress(message: str) -> None:
        console.print(f"[cyan]agentjet[/cyan] {message}")
        if starting is not None:
            starting.phase(f"building its embedded model: {message}")

    if settings.model is not None:
        return Path(settings.model)
    size = settings.model_size
    if ctx.enabled and not ctx.is_main:
        import torch.distributed as dist

        dist.barrier()
        return ensure_embedded_model(size=size)
    path = ensure_embedded_model(progress=progress, size=size)
    if ctx.enabled:
        import torch.distributed as dist

        dist.barrier()
    return path


def _chat_template(path: Path | None) -> str | None:
    if path is None:
        return None
    from agentjet_server.errors import ConfigError

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--chat-template: cannot read the chat template {path}: {exc.strerror}") from exc
    if not text.strip():
        raise ConfigError(f"--chat-template: {path} is empty; give a Jinja chat template")
    return text


def _remote_replicas(settings: Any, path: Path, ctx: Any, starting: StartingPort | None) -> Any:
    """``--remote-replica-ranks``: every rank joins the replicas' group; each named rank starts its engine
    replica (on its own device, from the base model) and rank 0 learns where they listen. None without it."""
    ranks = settings.remote_replica_list()
    if not ranks:
        return None
    import os

    from agentjet_server.errors import ConfigError
    from agentjet_server.learner import distributed

    if not ctx.enabled:
        raise ConfigError("--remote-replica-ranks names ranks of a torchrun job: start the server under torchrun")
    if starting is not None:
        starting.phase(f"waiting for the engine replicas on ranks {', '.join(map(str, ranks))}")

    def start_host(authkey: bytes) -> Any:
        from agentjet_server.engine.remote_replicas import ReplicaHost

        options = {"model_name": settings.model_name or served_name(path), "device": ctx.device}
        options |= {"max_batch": settings.max_batch, "dtype": settings.dtype}
        options["chat_template"] = _chat_template(settings.chat_template)
        return ReplicaHost(settings.engine, path, authkey, os.environ.get("MASTER_ADDR", "127.0.0.1"), **options)

    return distributed.replica_ranks(ctx, ranks, start_host)


def _with_remote_replicas(engine: Any, replicas: Any, ctx: Any, path: Path, options: dict[str, Any]) -> Any:
    """Rank 0's engine and the replicas on other ranks behind one engine; weights reach those by broadcast."""
    from agentjet_server.engine.remote_replicas import RemoteEngine, RemoteReplicas
    from agentjet_server.learner import distributed

    remotes = [RemoteEngine(address, replicas.authkey, path, **options) for address in replicas.addresses]
    console.print(
        "[cyan]agentjet[/cyan] engine replicas on other ranks: "
        + ", ".join(f"rank {r} at {a[0]}:{a[1]}" for r, a in zip(replicas.ranks, replicas.addresses, strict=True))
    )
    return RemoteReplicas(
        engine,
        remotes,
        publish=lambda weights, version: distributed.send_weights(ctx, replicas, dict(weights), version),
    )


def _serve_main(settings: Any, path: Path, ctx: Any, starting: StartingPort, replicas: Any = None) -> None:
    import uvicorn
    from transformers.utils import logging as transformers_logging

    # no library progress bars ("Loading weights", "Writing model shards" at every checkpoint)
    # between the server's own lines, nor in a terminal it shares with a client run
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    from agentjet_server.app import create_app
    from agentjet_server.control import learner_config
    from agentjet_server.embedded import EMBEDDED_SPECS
    from agentjet_server.engine import Engine, create_engine
    from agentjet_server.runtime import create_runtime
    from agentjet_server.state.mirror import open_state_dir

    starting.phase(f"opening its state dir {settings.state_dir}")
    state = open_state_dir(settings)
    try:
        checkpoint = state.resumed
        starting.phase(f"loading {path} into its {settings.engine} engine")
        name = settings.model_name or (
            EMBEDDED_SPECS[settings.model_size].name if settings.model is None else served_name(path)
        )
        state.record_model(path, name)
        options: dict[str, Any] = {
            "model_name": name,
            "device": settings.engine_devices or ctx.device,
            "max_batch": settings.max_batch,
            "dtype": settings.dtype,
            "version": checkpoint.meta.version if checkpoint else 0,
            "chat_template": _chat_template(settings.chat_template),
        }
        if settings.gpu_memory_utilization is not None:
            options["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.tensor_parallel_size > 1:
            options["tensor_parallel_size"] = settings.tensor_parallel_size
        if settings.engine_sleep:
            options["sleep_mode"] = True
        # vLLM in this process serves a LoRA adapter through its LoRA support (replicas and torchrun's
        # engine process take the merged weights); it starts from the base model, and on --resume
        # the runtime gives it the checkpoint's adapter
        adapters = settings.lora_rank > 0 and settings.engine == "vllm" and settings.engine_replicas == 1
        adapters = adapters and not ctx.enabled
        if adapters and "lm_head" in settings.lora_targets.split(","):
            adapters = False  # vLLM takes no adapter on the output head
            console.print("[cyan]agentjet[/cyan] vLLM takes no LoRA adapter on lm_head: it gets merged weights")
        if adapters:
            options["lora"] = learner_config(settings).lora
            options["version"] = 0
        if settings.adapter_names():  # an adapter per agent: the base, and the runtime gives each its weights
            options["lora"] = learner_config(settings).lora
            options["adapters"] = settings.adapter_names()
            adapters = True
        # the engine starts from the checkpoint's weights (HF format) when resuming
        engine_path = checkpoint.model_dir if checkpoint and not adapters else path
        if checkpoint:
            console.print(
                f"[cyan]agentjet[/cyan] resuming from {checkpoint.path} "
                f"(step {checkpoint.meta.step}, policy v{checkpoint.meta.version})"
            )
        engine: Engine
        if settings.engine_replicas > 1:
            from agentjet_server.engine.replicas import ReplicaSet, cpu_threads_per_replica

            devices = settings.engine_device_list() if settings.engine_devices else [str(options["device"])]
            on_cpu = all(d.startswith("cpu") for d in devices)
            console.print(
                f"[cyan]agentjet[/cyan] starting {settings.engine_replicas} {settings.engine} engine replicas on "
                + (
                    f"the CPU ({cpu_threads_per_replica(settings.engine_replicas)} thread(s) each)"
                    if on_cpu
                    else ", ".join(devices)
                )
            )
            sleepers = _sleeping_replicas(settings, ctx) if settings.engine_sleep else []
            if sleepers:
                console.print(
                    f"[cyan]agentjet[/cyan] --engine-sleep: replica(s) {', '.join(map(str, sleepers))} sleep through "
                    "every learner step" + ("; the others serve on" if len(sleepers) < settings.engine_replicas else "")
                )
            engine = ReplicaSet(
                settings.engine,
                engine_path,
                replicas=settings.engine_replicas,
                devices=devices,
                threads=cpu_threads_per_replica(settings.engine_replicas) if on_cpu else None,
                sleepers=sleepers,
                **{k: v for k, v in options.items() if k not in ("device", "sleep_mode")},
            )
        elif settings.engine == "vllm" and ctx.enabled:
            # vLLM's engine core joins torch.distributed wherever it runs; this process belongs to the
            # learner ranks' group, so vLLM gets a process of its own
            from agentjet_server.engine.remote import EngineProcess

            engine = EngineProcess("vllm", engine_path, **options)
        else:
            engine = create_engine(settings.engine, engine_path, **options)
        if replicas is not None:
            engine = _with_remote_replicas(engine, replicas, ctx, path, options)
        starting.phase("loading the learner's copy of the model" + (" and its checkpoint" if checkpoint else ""))
        runtime = create_runtime(engine, settings, str(path), ctx, state=state)
    except BaseException:
        state.close()
        raise
    holder: list[Any] = []
    app = create_app(engine, settings, runtime=runtime, on_stop=lambda: setattr(holder[0], "should_exit", True))
    if not settings.auth_enabled:
        console.print("[yellow]warning:[/yellow] no API key set: the server accepts requests without a key")
    if settings.signatures_required:
        console.print("[cyan]agentjet[/cyan] training only turns this server signed (--require-signed)")
    learner = f"{ctx.world_size} learner ranks (FSDP2)" if ctx.enabled else "1 learner process"
    console.print(
        f"[green]agentjet-server[/green] serving [bold]{engine.model_name}[/bold] with {settings.engine} "
        f"on http://{settings.host}:{settings.port}/v1 (GRPO: {settings.batch_groups} groups x "
        f"{settings.group_size} per step, max staleness {settings.max_staleness}; {learner})"
    )
    console.print(
        f"[cyan]agentjet[/cyan] dashboard http://{settings.host}:{settings.port}/dashboard  "
        f"metrics http://{settings.host}:{settings.port}/metrics"
    )
    every = logging.getLogger().isEnabledFor(logging.DEBUG)
    lines = effective_configuration(runtime.settings, changed_only=not every).splitlines()
    shown = "every setting" if every else "what differs from the defaults (all: `admin config`, --log-level debug)"
    console.print(f"[cyan]agentjet[/cyan] effective configuration: {shown}")
    if lines:
        console.print(escape(_wrapped(lines)), style="dim")
    server = uvicorn.Server(http_config(app, settings))
    holder.append(server)
    server.run(sockets=[starting.hand_over()])


def http_config(app: Any, settings: Any) -> Any:
    """uvicorn's configuration with AgentJet's connection guards (see ``connections``)."""
    import uvicorn

    from agentjet_server.connections import (
        ACCEPT_BACKLOG,
        Guards,
        RepeatFilter,
        default_max_connections,
        guarded_protocol,
        raise_open_file_limit,
    )

    open_files, _ = raise_open_file_limit()
    guards = Guards(
        header_timeout=settings.header_timeout_s,
        write_timeout=settings.write_timeout_s,
        max_connections=settings.max_connections or default_max_connections(open_files),
    )
    for name in ("agentjet_server.connections", "asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(RepeatFilter())  # a flood of one condition: one line a minute
    logging.getLogger(__name__).info(
        "open-file limit %d: at most %d connections at once", open_files, guards.max_connections
    )
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
        http=guarded_protocol(guards),
        backlog=ACCEPT_BACKLOG,
    )


@app.command()
def inspect(
    trajectory_id: Annotated[str | None, typer.Argument(help="trajectory id (default: the newest in the log)")] = None,
    state_dir: Annotated[Path, typer.Option(help="the server's --state-dir")] = Path(".agentjet/server"),
    recompute: Annotated[bool, typer.Option(help="also show log-probs under the newest checkpoint's weights")] = False,
    model: Annotated[
        Path | None, typer.Option(help="model dir for tokenizer/weights (default: newest checkpoint)")
    ] = None,
    limit: Annotated[int, typer.Option(help="rows shown per timeline (head and tail)")] = 200,
) -> None:
    """Show a stored trajectory token by token: timelines, trained tokens, log-probs.

    Example: agentjet-server inspect --state-dir .agentjet/server --recompute
    """
    from agentjet_server.observe.inspection import find_trajectory, latest_ids, rows

    if not (state_dir / "log").is_dir():
        where = "does not exist" if not state_dir.exists() else "holds no trajectory log (log/)"
        _fail(
            f"no server state here: {state_dir.resolve()} {where}; run inspect in the directory the server ran in, "
            "or pass the server's --state-dir"
        )
    try:
        if trajectory_id is None:
            newest = latest_ids(state_dir, 1)
            if not newest:
                _fail(f"the log under {state_dir} holds no untrained trajectory; pass an id or another --state-dir")
            trajectory_id = newest[0]
        trajectory = find_trajectory(state_dir, trajectory_id)
    except AgentJetServerError as exc:
        _fail(str(exc))
    source = model or _newest_checkpoint_model(state_dir)
    from agentjet_server.engine.tokens import load_tokenizer

    tokenizer = load_tokenizer(source)
    weights = None
    if recompute:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

        weights = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
        weights.eval()  # type: ignore[no-untyped-call]
    from agentjet_server.batching.timeline import build_timelines, call_tokens
    from agentjet_server.ingest.signing import SampleSigner

    timelines = build_timelines(trajectory.turns)
    signer = SampleSigner.existing(state_dir / "sample.key")
    checks = [signer.verify_turn(t) for t in trajectory.turns] if signer else []
    sampled = (
        f"turns verified as sampled {checks.count(True)}, not matching {checks.count(False)}, "
        f"unsigned {checks.count(None)}"
        if signer
        else f"no sample.key in {state_dir}: signatures not checked"
    )
    out = Console()
    out.print(
        f"trajectory [bold]{escape(trajectory.id)}[/bold]  task {escape(trajectory.task_id)}  "
        f"status {trajectory.status}  reward {trajectory.reward:g}  {len(trajectory.turns)} calls -> "
        f"{len(timelines)} timelines ({call_tokens(trajectory.turns)} tokens per call, "
        f"{sum(len(t.tokens) for t in timelines)} merged)  {escape(sampled)}  weights: {escape(str(source))}"
    )
    for i, timeline in enumerate(timelines):
        why = (
            "first call of this agent"
            if i == 0 or timelines[i - 1].agent != timeline.agent
            else (
                "new timeline: the prompt of call "
                f"{timeline.turns[0]} does not continue an earlier one token for token (edited or retried history)"
            )
        )
        out.print(
            f"[cyan]-- timeline {i}[/cyan]  agent {escape(timeline.agent)}  calls {timeline.turns}  "
            f"{len(timeline.tokens)} tokens, {len(timeline.trained)} trained  ({why})"
        )
        out.print("   pos      id  what     sampled  recomputed  text")
        listed = list(rows(timeline, tokenizer, weights))
        half = limit // 2
        shown = listed if len(listed) <= limit else [*listed[:half], None, *listed[-half:]]
        for row in shown:
            if row is None:
                out.print(f"   ... {len(listed) - limit} rows not shown (--limit)")
                continue
            what = f"[green]TRAIN {row.turn}[/green]" if row.trained else "ctx    "
            sampled = f"{row.sampled_logprob:8.3f}" if row.sampled_logprob is not None else " " * 8
            again = f"{row.recomputed_logprob:10.3f}" if row.recomputed_logprob is not None else " " * 10
            out.print(f"  {row.position:5d} {row.token_id:6d}  {what} {sampled}  {again}  {escape(repr(row.text))}")


def _newest_checkpoint_model(state_dir: Path) -> Path:
    """Read-only (a running server holds the state dir): the newest checkpoint's model, else the model the
    run started from (as the server noted it in the state dir)."""
    from agentjet_server.state.checkpoint import recorded_model

    done = sorted(p for p in (state_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    if done and (done[-1] / "model" / "config.json").exists():
        return done[-1] / "model"
    record = recorded_model(state_dir)
    if record is not None and Path(record["path"]).is_dir():
        return Path(record["path"])
    _fail(
        f"{state_dir} has no checkpoint yet and no record of the model its run started from (a server older than "
        "this version, or a moved model); pass that model's directory as --model"
    )


def served_name(path: Path) -> str:
    """The name ``/v1/models`` gives a ``--model`` dir: the dir's own name, and for a checkpoint's ``model``
    dir the name its run served with the step (``agentjet-tools-step20``)."""
    if path.name != "model" or not path.parent.name.startswith("step-"):
        return path.name
    from agentjet_server.state.checkpoint import recorded_model

    record = recorded_model(path.parent.parent.parent) or {}
    base = record.get("name") or path.parent.parent.parent.name
    return f"{base}-step{int(path.parent.name.removeprefix('step-'))}"


@app.command(name="build-model")
def build_model(
    name: Annotated[str, typer.Argument(help="the embedded model to build: tiny, small or tools")],
    out: Annotated[
        Path | None, typer.Option(help="write the model here (default: the cache, beside other builds)")
    ] = None,
    threads: Annotated[int, typer.Option(help="CPU threads torch may use (0: its default)")] = 0,
) -> None:
    """Build an embedded model from its recipe (the shipped ones were built this way).

    The server ships the three embedded models prebuilt; this runs the recipe
    again, for a changed spec or to check what a build on this machine learns
    (on 2 idle cores: tiny 15 s, small 25 s, tools about 7 minutes; longer on a
    busy machine). Float sums differ between CPUs, so a build here is close to
    the shipped model, not bit-identical.

    Example: agentjet-server build-model tools --out /tmp/agentjet-tools
    """
    from transformers.utils import logging as transformers_logging

    from agentjet_server.embedded import EMBEDDED_SPECS, default_cache_dir, spec_hash
    from agentjet_server.embedded.recipe import build_model as run_recipe

    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    if name not in EMBEDDED_SPECS:
        _fail(f"no embedded model named '{name}'; choose one of {', '.join(EMBEDDED_SPECS)}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    spec = EMBEDDED_SPECS[name]
    target = out or default_cache_dir() / f"{spec.name}-{spec_hash(spec)}"
    run_recipe(spec, target, lambda m: console.print(f"[cyan]agentjet[/cyan] {m}"))


# `agentjet-server status` and `agentjet-server admin ...`: light commands that only talk to a server
app.command(name="status")(admin_cli.status)
app.add_typer(admin_cli.admin, name="admin")


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
