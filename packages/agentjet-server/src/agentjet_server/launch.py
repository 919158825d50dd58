"""Starting a server (``agentjet-server up``, after its options became settings): the model (``--model`` or the
embedded one), the memory plan, the engine and its replicas, the runtime with its learner, and uvicorn with
AgentJet's connection guards. Under torchrun, ranks other than 0 run the learner alone (``serve``).

What it tells people goes through ``_tell``: rich markup on the terminal, or plain log lines under
``--log-format json`` (``LINES``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from agentjet_server.admin_client import as_toml
from agentjet_server.starting import StartingPort

console = Console(stderr=True, soft_wrap=True)

LINES = {"json": False}  # `up --log-format json`: what up tells people goes out as JSON lines too


def _tell(markup: str, level: int = logging.INFO, style: str | None = None) -> None:
    """A line of what ``up`` is doing for people: on the terminal (rich markup), or a log line of the
    server's JSON logs (its plain text), so that ``--log-format json`` writes nothing but JSON lines."""
    if LINES["json"]:
        from rich.text import Text

        logging.getLogger(__name__).log(level, Text.from_markup(markup).plain)
    else:
        console.print(markup, style=style)


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
        if settings.adapter_names() and ctx.enabled:  # before the model loads, not as the learner's traceback
            from agentjet_server.errors import ConfigError

            raise ConfigError(
                f"--adapters runs in one learner process, not under torchrun ({ctx.world_size} ranks): start "
                "agentjet-server up without torchrun, or leave --adapters out"
            )
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
        _tell("[cyan]agentjet[/cyan] memory plan:")
        _tell(escape(plan.describe()), style="dim")
    util = plan.layout.gpu_memory_utilization
    if settings.engine == "vllm" and settings.gpu_memory_utilization is None and util is not None:
        settings = settings.model_copy(update={"gpu_memory_utilization": util})
    return settings


def _model_path(settings: Any, ctx: Any, starting: StartingPort | None = None) -> Path:
    """``--model``, or the embedded model, built once by rank 0 while the other ranks wait."""
    from agentjet_server.embedded import ensure_embedded_model

    def progress(message: str) -> None:
        _tell(f"[cyan]agentjet[/cyan] {message}")
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
    _tell(
        "[cyan]agentjet[/cyan] engine replicas on other ranks: "
        + ", ".join(f"rank {r} at {a[0]}:{a[1]}" for r, a in zip(replicas.ranks, replicas.addresses, strict=True))
    )
    return RemoteReplicas(
        engine,
        remotes,
        publish=lambda weights, version: distributed.send_weights(ctx, replicas, dict(weights), version),
    )


def _serve_main(settings: Any, path: Path, ctx: Any, starting: StartingPort, replicas: Any = None) -> None:
    """Rank 0: the engine, the runtime over it (learner included), the app, then uvicorn on the port that
    answered while all of this started."""
    import uvicorn
    from transformers.utils import logging as transformers_logging

    # no library progress bars ("Loading weights", "Writing model shards" at every checkpoint)
    # between the server's own lines, nor in a terminal it shares with a client run
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    from agentjet_server.app import create_app
    from agentjet_server.runtime import create_runtime
    from agentjet_server.state.mirror import open_state_dir

    starting.phase(f"opening its state dir {settings.state_dir}")
    state = open_state_dir(settings)
    try:
        engine = _engine(settings, path, ctx, starting, state, replicas)
        starting.phase("loading the learner's copy of the model" + (" and its checkpoint" if state.resumed else ""))
        runtime = create_runtime(engine, settings, str(path), ctx, state=state)
    except BaseException:
        state.close()
        raise
    holder: list[Any] = []
    app = create_app(engine, settings, runtime=runtime, on_stop=lambda: setattr(holder[0], "should_exit", True))
    _announce(settings, runtime, engine, ctx)
    server = uvicorn.Server(http_config(app, settings))
    holder.append(server)
    server.run(sockets=[starting.hand_over()])


def _engine(settings: Any, path: Path, ctx: Any, starting: StartingPort, state: Any, replicas: Any) -> Any:
    """The engine ``--engine`` and its replicas name, loaded with the checkpoint's weights when resuming."""
    from agentjet_server.embedded import EMBEDDED_SPECS
    from agentjet_server.engine import create_engine

    checkpoint = state.resumed
    starting.phase(f"loading {path} into its {settings.engine} engine")
    name = settings.model_name or (
        EMBEDDED_SPECS[settings.model_size].name if settings.model is None else served_name(path)
    )
    state.record_model(path, name)
    options, adapters = _engine_options(settings, ctx, name, checkpoint)
    # the engine starts from the checkpoint's weights (HF format) when resuming
    engine_path = checkpoint.model_dir if checkpoint and not adapters else path
    if checkpoint:
        _tell(
            f"[cyan]agentjet[/cyan] resuming from {checkpoint.path} "
            f"(step {checkpoint.meta.step}, policy v{checkpoint.meta.version})"
        )
    if settings.engine_replicas > 1:
        engine = _replica_set(settings, ctx, engine_path, options)
    elif settings.engine == "vllm" and ctx.enabled:
        # vLLM's engine core joins torch.distributed wherever it runs; this process belongs to the
        # learner ranks' group, so vLLM gets a process of its own
        from agentjet_server.engine.remote import EngineProcess

        engine = EngineProcess("vllm", engine_path, **options)
    else:
        engine = create_engine(settings.engine, engine_path, **options)
    return _with_remote_replicas(engine, replicas, ctx, path, options) if replicas is not None else engine


def _engine_options(settings: Any, ctx: Any, name: str, checkpoint: Any) -> tuple[dict[str, Any], bool]:
    """The engine's options, and whether it serves LoRA adapters (then it starts from the base model)."""
    from agentjet_server.control import learner_config

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
        _tell("[cyan]agentjet[/cyan] vLLM takes no LoRA adapter on lm_head: it gets merged weights")
    if adapters:
        options["lora"] = learner_config(settings).lora
        options["version"] = 0
    if settings.adapter_names():  # an adapter per agent: the base, and the runtime gives each its weights
        options["lora"] = learner_config(settings).lora
        options["adapters"] = settings.adapter_names()
        adapters = True
    return options, adapters


def _replica_set(settings: Any, ctx: Any, engine_path: Path, options: dict[str, Any]) -> Any:
    """``--engine-replicas``: that many engines in processes of their own, behind one."""
    from agentjet_server.engine.replicas import ReplicaSet, cpu_threads_per_replica

    devices = settings.engine_device_list() if settings.engine_devices else [str(options["device"])]
    on_cpu = all(d.startswith("cpu") for d in devices)
    threads = cpu_threads_per_replica(settings.engine_replicas)
    where = f"the CPU ({threads} thread(s) each)" if on_cpu else ", ".join(devices)
    _tell(f"[cyan]agentjet[/cyan] starting {settings.engine_replicas} {settings.engine} engine replicas on {where}")
    sleepers = _sleeping_replicas(settings, ctx) if settings.engine_sleep else []
    if sleepers:
        _tell(
            f"[cyan]agentjet[/cyan] --engine-sleep: replica(s) {', '.join(map(str, sleepers))} sleep through "
            "every learner step" + ("; the others serve on" if len(sleepers) < settings.engine_replicas else "")
        )
    return ReplicaSet(
        settings.engine,
        engine_path,
        replicas=settings.engine_replicas,
        devices=devices,
        threads=threads if on_cpu else None,
        sleepers=sleepers,
        **{k: v for k, v in options.items() if k not in ("device", "sleep_mode")},
    )


def _announce(settings: Any, runtime: Any, engine: Any, ctx: Any) -> None:
    """What the server serves, where, how it trains, and what differs from the default settings."""
    if not settings.auth_enabled:
        _tell("[yellow]warning:[/yellow] no API key set: the server accepts requests without a key", logging.WARNING)
    if settings.signatures_required:
        _tell("[cyan]agentjet[/cyan] training only turns this server signed (--require-signed)")
    learner = f"{ctx.world_size} learner ranks (FSDP2)" if ctx.enabled else "1 learner process"
    training = (
        "serve only: it never trains"
        if settings.serve_only
        else f"{settings.algorithm.upper()}: {settings.batch_groups} groups x {settings.group_size} per step, "
        f"max staleness {settings.max_staleness}; {learner}"
    )
    _tell(
        f"[green]agentjet-server[/green] serving [bold]{engine.model_name}[/bold] with {settings.engine} "
        f"on http://{settings.host}:{settings.port}/v1 ({training})"
    )
    _tell(
        f"[cyan]agentjet[/cyan] dashboard http://{settings.host}:{settings.port}/dashboard  "
        f"metrics http://{settings.host}:{settings.port}/metrics"
    )
    every = logging.getLogger().isEnabledFor(logging.DEBUG)
    lines = effective_configuration(runtime.settings, changed_only=not every).splitlines()
    shown = "every setting" if every else "what differs from the defaults (all: `admin config`, --log-level debug)"
    _tell(f"[cyan]agentjet[/cyan] effective configuration: {shown}")
    if lines:
        _tell(escape(_wrapped(lines)), style="dim")


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


def served_name(path: Path) -> str:
    """The name ``/v1/models`` gives a ``--model`` dir: the dir's own name, and for a checkpoint's ``model``
    dir the name its run served with the step (``agentjet-tools-step20``)."""
    if path.name != "model" or not path.parent.name.startswith("step-"):
        return path.name
    from agentjet_server.state.checkpoint import recorded_model

    record = recorded_model(path.parent.parent.parent) or {}
    base = record.get("name") or path.parent.parent.parent.name
    return f"{base}-step{int(path.parent.name.removeprefix('step-'))}"
