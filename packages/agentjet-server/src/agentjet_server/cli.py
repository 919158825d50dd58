"""``agentjet-server``: start a swarm server, or ask one what it is doing."""

from __future__ import annotations

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
from agentjet_server.errors import AgentJetServerError
from agentjet_server.launch import LINES, serve

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AgentJet swarm server: serve and train one model.")
console = Console(stderr=True, soft_wrap=True)


def _fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {escape(message)}")  # messages quote [extras] and paths
    raise typer.Exit(code=2)


def _describe(error: Any) -> str:
    """A settings error as the flag a user typed: the setting's own flag (``lam`` is ``--gae-lambda``), not
    the field's name, and never an item's index (``--log-to``, not ``--log-to-0``)."""
    from agentjet_server.settings import ServerSettings, flag_of

    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:  # a rule across settings: its message names them
        return message
    name = str(error["loc"][0])
    flag = flag_of(name) if name in ServerSettings.model_fields else None
    return f"--{flag or name.replace('_', '-')}: {message}"


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
    a mapping as text (``--mix math=3,tools=1``), bounds as text (``--token-mask 0.5,5``), a list as a
    repeatable option of text."""
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
    elif origin is tuple:  # bounds, as LOW,HIGH
        core = str
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
    if any(get_origin(a) is tuple for a in get_args(field.annotation)):
        metavar = "LOW,HIGH"
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
    LINES["json"] = given["log_format"] == "json"
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
        import difflib

        known = sorted(n.replace("_", "-") for n in names if n != "config")
        said = []
        for key in unknown:
            close = difflib.get_close_matches(key.replace("_", "-"), known, n=1)
            said.append(f"{key} (did you mean {close[0]}?)" if close else key)
        _fail(
            f"the job file {path} has options `up` does not know: {', '.join(said)}; its keys are up's options "
            "as `agentjet-server up --help` lists them, without the dashes (with - or _)"
        )
    return out


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
    from agentjet_server.observe.inspection import find_trajectory, latest_ids

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
    _print_trajectory(trajectory, state_dir, source, tokenizer, weights, limit)


def _print_trajectory(trajectory: Any, state_dir: Path, source: Path, tokenizer: Any, weights: Any, limit: int) -> None:
    """``inspect``'s table: the trajectory's figures, then each timeline token by token."""
    from agentjet_server.batching.timeline import build_timelines, call_tokens
    from agentjet_server.ingest.signing import SampleSigner
    from agentjet_server.observe.inspection import reward_detail, rows

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
    for line in reward_detail(trajectory):
        out.print(f"   {escape(line)}", highlight=False)
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
            logprob = f"{row.sampled_logprob:8.3f}" if row.sampled_logprob is not None else " " * 8
            again = f"{row.recomputed_logprob:10.3f}" if row.recomputed_logprob is not None else " " * 10
            out.print(f"  {row.position:5d} {row.token_id:6d}  {what} {logprob}  {again}  {escape(repr(row.text))}")


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
