"""The commands' options, declared once: the option types, the decorators handing a command its
storage (``storage``), the scheduled flow's options (``scheduled``) and options generated from a
settings model (``settings``), and the checks of options that go together."""

from __future__ import annotations

import functools
import importlib.util
import json
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from inspect import Parameter, signature
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rollout_capture.cli.output import InputError

if TYPE_CHECKING:
    from rollout_capture.location import Location

CaptureDirOpt = Annotated[
    str, typer.Option("--capture-dir", "-c", help="Capture root: a path or fsspec URL.")
]
OptionsOpt = Annotated[
    str | None,
    typer.Option("--storage-options", help='fsspec options as JSON (no secrets), e.g. {"anon": false}.'),
]
BlockOpt = Annotated[
    str | None, typer.Option("--credentials-block", help="Name of a prefect-aws AwsCredentials block.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON summary on stdout instead.")]
AllowEmptyOpt = Annotated[
    bool, typer.Option(help="Accept a capture dir that does not exist or holds nothing.")
]
MaxGapShareOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        max=1,
        help='Above this share of rollouts with a gap: end "Completed with gaps", emit gaps-exceeded.',
    ),
]
OtlpFlowOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp",
        metavar="URL",
        help="Once the output is written, send its rollouts as traces to this OTLP/HTTP endpoint.",
    ),
]
OtlpHeadersBlockOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-headers-block",
        metavar="BLOCK",
        help="A Prefect Secret block holding the endpoint's headers (an API key; only its name is passed).",
    ),
]
OtlpProjectOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-project",
        metavar="NAME",
        help="The project the traces land in (Phoenix's; default its own, for enrich-runs the root's name).",
    ),
]
OtlpRunNameOpt = Annotated[
    str | None,
    typer.Option(
        "--otlp-run-name",
        metavar="NAME",
        help="Names the run in its trace ids (default: the output's location); enrich-runs: NAME/<run>.",
    ),
]
MaxFailedShareOpt = Annotated[
    float | None,
    typer.Option(
        min=0,
        max=1,
        help='Above this share of failed calls: end "Completed with failed calls", emit '
        "failed-calls-exceeded.",
    ),
]


class RunnerName(StrEnum):
    """Where batches run."""

    threads = "threads"
    processes = "processes"
    dask = "dask"
    ray = "ray"


RunnerOpt = Annotated[RunnerName, typer.Option(help="Where batches run.")]
DaskAddressOpt = Annotated[
    str | None, typer.Option(help="Dask scheduler for --runner dask (tcp://host:8786); default local.")
]
RayAddressOpt = Annotated[
    str | None, typer.Option(help="Ray cluster for --runner ray (host:6379); default RAY_ADDRESS or local.")
]
CronOpt = Annotated[
    str,
    typer.Option(envvar="ROLLOUT_CAPTURE_CRON", show_envvar=True, help="When the scheduled enrichment runs."),
]
CaptureDirForRunsOpt = Annotated[str | None, typer.Option(help="One capture root for all runs.")]
MaxWorkersOpt = Annotated[int, typer.Option(min=1, help="Batches at once, per run.")]
MaxParallelRunsOpt = Annotated[int, typer.Option(min=1, help="Runs enriched at once.")]

Command = Callable[..., None]


def runner_available(
    runner: RunnerName, dask_address: str | None = None, ray_address: str | None = None
) -> None:
    """The runner's extra is installed, and a cluster address goes with its runner."""
    if runner is RunnerName.dask and importlib.util.find_spec("prefect_dask") is None:
        raise InputError("--runner dask needs prefect-dask: pip install 'rollout-capture[dask]'")
    if runner is RunnerName.ray and importlib.util.find_spec("prefect_ray") is None:
        raise InputError("--runner ray needs prefect-ray: pip install 'rollout-capture[ray]'")
    addresses_match(runner, dask_address, ray_address)


def addresses_match(runner: RunnerName, dask_address: str | None, ray_address: str | None) -> None:
    """A cluster address given for another runner than the chosen one is a mix-up: refused."""
    for option, address, needs in (
        ("--dask-address", dask_address, RunnerName.dask),
        ("--ray-address", ray_address, RunnerName.ray),
    ):
        if address and runner is not needs:
            raise InputError(f"{option} is for --runner {needs.value}; the runner is {runner.value}")


PREFECT_BANNED = "/%&><"
"""Characters Prefect refuses in the names it stores (``prefect.types.names.BANNED_CHARACTERS``)."""


def prefect_name(option: str, value: str | None, *, block: bool = False) -> None:
    """A name Prefect will store (a deployment, a work pool, a block): refused here, exit 2, before
    any server is asked, rather than as an ``InvalidURL`` from the request that carries it.

    Printable text without ``/ % & > <`` and without spaces at its ends; a block's name is
    lowercase letters, digits and dashes, as Prefect's blocks are named.
    """
    if value is None:
        return
    from rollout_capture.printable import printable

    shown = printable(value)
    if not value.strip():
        raise InputError(f"{option} is empty: give a name")
    printable_input(option, value, "a name")
    if banned := sorted({c for c in value if c in PREFECT_BANNED}):
        raise InputError(
            f"{option} '{shown}' holds {' '.join(banned)}: "
            f"Prefect refuses {' '.join(PREFECT_BANNED)} in names"
        )
    if value != value.strip():
        raise InputError(f"{option} '{shown}' starts or ends with a space")
    if block and not all(c.islower() or c.isdigit() or c == "-" for c in value):
        raise InputError(f"{option} '{shown}': a block's name is lowercase letters, digits and dashes")


def printable_input(option: str, value: str | None, what: str) -> None:
    """Refuse (exit 2) a value a server will store and show (a name, a deployment's runs root)
    holding a control character: an escape acts on every terminal it reaches, a line break forges
    log lines. Shown escaped."""
    if value is not None and not value.isprintable():
        from rollout_capture.printable import printable

        raise InputError(f"{option} '{printable(value)}' holds a control character: {what} is printable text")


def deploy_name(value: str) -> None:
    """``deploy --name``: a name Prefect stores, and none of serve's (``NAME-served``): a deploy that
    took one over would move a running serve's deployment onto a work pool behind its back."""
    from rollout_capture.deployments.names import SERVED_SUFFIX, is_served_name

    prefect_name("--name", value)
    if is_served_name(value):
        raise InputError(
            f"--name {value!r} ends with {SERVED_SUFFIX}: names ending so are `rollout-capture serve`'s "
            f"(serve --name X registers X{SERVED_SUFFIX}); deploy under another name"
        )


def parse_storage_options(text: str | None) -> dict[str, Any] | None:
    """``--storage-options`` as the JSON object it must be."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"--storage-options is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InputError("--storage-options must be a JSON object")
    return value


@dataclass(frozen=True)
class Storage:
    """How one command's URLs are read: ``--storage-options``, ``--credentials-block`` as typed, and
    (for the commands over one capture root) ``--capture-dir`` and ``--allow-empty``."""

    options: str | None = None
    block: str | None = None
    capture_dir: str = ""
    allow_empty: bool = False

    def at(self, url: str) -> Location:
        """``url`` as the flows will read it: the JSON parsed, secrets refused, the URL's shape checked."""
        from rollout_capture.location import Location

        return Location.of(url, parse_storage_options(self.options), self.block)

    def captures(self) -> Location:
        """The ``--capture-dir`` location."""
        return self.at(self.capture_dir)

    def must_exist(self, captures: Location) -> list[Location]:
        """The capture roots the pre-flight check requires of ``captures`` (this ``--capture-dir``,
        validated once): none with ``--allow-empty``."""
        return [] if self.allow_empty else [captures]


def _keyword_only(command: Command, without: str) -> tuple[Any, list[Parameter]]:
    """A command's signature and its parameters as keywords, less the one a decorator hands it."""
    declared = signature(command, eval_str=True)
    kept = [p.replace(kind=Parameter.KEYWORD_ONLY) for p in declared.parameters.values()]
    return declared, [p for p in kept if p.name != without]


def _before_json(kept: list[Parameter], added: Sequence[Parameter]) -> None:
    """Options a decorator adds go before ``--json`` in a command's help."""
    at = next((i for i, p in enumerate(kept) if p.name == "as_json"), len(kept))
    kept[at:at] = added


def storage_options(*, block: bool = True, captures: bool = True) -> Callable[[Command], Command]:
    """Give a command its storage options as one ``storage`` argument, declared once, here.

    ``--storage-options`` (and ``--credentials-block``) land before ``--json`` in the help; with
    ``captures``, also ``--capture-dir`` (after the command's arguments) and ``--allow-empty``.
    """

    def decorate(command: Command) -> Command:
        declared, kept = _keyword_only(command, "storage")
        option = functools.partial(Parameter, kind=Parameter.KEYWORD_ONLY, default=None)
        added = [option("storage_options", annotation=OptionsOpt)]
        if block:
            added.append(option("credentials_block", annotation=BlockOpt))
        if captures:
            added.insert(0, option("allow_empty", annotation=AllowEmptyOpt, default=False))
        _before_json(kept, added)
        if captures:
            first = next((i for i, p in enumerate(kept) if p.default is not Parameter.empty), len(kept))
            kept.insert(first, option("capture_dir", annotation=CaptureDirOpt, default=Parameter.empty))

        @functools.wraps(command)
        def run(
            storage_options: str | None = None, credentials_block: str | None = None, **given: Any
        ) -> None:
            # Without ``captures``, a command's own --capture-dir / --allow-empty stay its own.
            root = (
                (given.pop("capture_dir", ""), given.pop("allow_empty", False)) if captures else ("", False)
            )
            storage = Storage(storage_options, credentials_block, *root)
            command(storage=storage, **given)

        run.__signature__ = declared.replace(parameters=kept)  # type: ignore[attr-defined]
        return run

    return decorate


@dataclass(frozen=True)
class Scheduled:
    """The scheduled flow's options ``deploy`` and ``serve`` share, as typed."""

    cron: str
    capture_dir: str | None
    runner: RunnerName
    dask_address: str | None
    ray_address: str | None
    max_workers: int
    max_parallel_runs: int


SCHEDULED_OPTIONS: dict[str, tuple[Any, Any]] = {
    "cron": (CronOpt, "*/15 * * * *"),
    "capture_dir": (CaptureDirForRunsOpt, None),
    "runner": (RunnerOpt, RunnerName.threads),
    "dask_address": (DaskAddressOpt, None),
    "ray_address": (RayAddressOpt, None),
    "max_workers": (MaxWorkersOpt, 8),
    "max_parallel_runs": (MaxParallelRunsOpt, 4),
}
"""The fields of :class:`Scheduled` as options: (annotation, default), declared once for both commands."""


def _grouped_options(
    command: Command, argument: str, options: dict[str, tuple[Any, Any]], group: Callable[..., Any]
) -> Command:
    """Give ``command`` the ``options`` (name: (annotation, default)), before ``--json``, handed to
    it as one ``argument``: ``group`` made of them (a dataclass whose fields are their names)."""
    declared, kept = _keyword_only(command, argument)
    added = [
        Parameter(name, Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
        for name, (annotation, default) in options.items()
    ]
    _before_json(kept, added)

    @functools.wraps(command)
    def run(**given: Any) -> None:
        grouped = group(**{name: given.pop(name) for name in options})
        command(**{argument: grouped}, **given)

    run.__signature__ = declared.replace(parameters=kept)  # type: ignore[attr-defined]
    return run


def scheduled_options(command: Command) -> Command:
    """Give a command the scheduled flow's options as one ``scheduled`` argument (before ``--json``)."""
    return _grouped_options(command, "scheduled", SCHEDULED_OPTIONS, Scheduled)


@dataclass(frozen=True)
class FlowTraces:
    """The flows' trace options as typed (``--otlp``, ``--otlp-headers-block``, ``--otlp-project``,
    ``--otlp-run-name``): declared once for ``enrich``, ``enrich-runs``, ``deploy`` and ``serve``."""

    otlp: str | None = None
    otlp_headers_block: str | None = None
    otlp_project: str | None = None
    otlp_run_name: str | None = None

    def parameters(self) -> dict[str, Any]:
        """The flows' trace parameters, only those given (a flow's call is otherwise as before);
        checked here, before a flow or a deployment records them: the URL (credentials in it
        refused), the names, the options that need ``--otlp``."""
        if not self.otlp:
            if self.otlp_headers_block or self.otlp_project or self.otlp_run_name:
                raise InputError(
                    "--otlp-headers-block, --otlp-project and --otlp-run-name go with --otlp URL"
                )
            return {}
        from rollout_capture.traces.exporter import traces_url
        from rollout_capture.traces.runs import check_name

        try:
            traces_url(self.otlp)
            check_name(self.otlp_project, "--otlp-project")
            check_name(self.otlp_run_name, "--otlp-run-name")
        except ValueError as exc:
            raise InputError(str(exc)) from None
        given = {
            "otlp_endpoint": self.otlp,
            "otlp_headers_block": self.otlp_headers_block,
            "otlp_project": self.otlp_project,
            "otlp_run_name": self.otlp_run_name,
        }
        return {key: value for key, value in given.items() if value}

    def check_block(self) -> None:
        """The headers block is on the server and holds headers (its values never shown): a
        deployment naming a missing one would fail every tick. Needs Prefect's API."""
        if not self.otlp_headers_block:
            return
        from rollout_capture.otlp_headers import HeaderError
        from rollout_capture.tasks.traces import headers_from_block

        try:
            headers_from_block(self.otlp_headers_block)
        except HeaderError as exc:
            raise InputError(str(exc)) from None

    def probe(self, *, prefect_started: bool) -> None:
        """The endpoint takes an empty export (with the block's headers): else bad input, one line.

        Without a headers block it is asked before Prefect starts (call with
        ``prefect_started=False``); a block lives in Prefect's API, so then only once it is up.
        """
        if not self.otlp or bool(self.otlp_headers_block) != prefect_started:
            return
        from rollout_capture.otlp_headers import HeaderError
        from rollout_capture.traces.exporter import OtlpEndpointError

        try:
            if self.otlp_headers_block:
                from rollout_capture.tasks.traces import headers_from_block

                headers = headers_from_block(self.otlp_headers_block)
            else:
                from rollout_capture.traces.exporter import OtlpHeaders

                headers = OtlpHeaders()
            from rollout_capture.traces.exporter import check_endpoint

            check_endpoint(self.otlp, headers)
        except (OtlpEndpointError, HeaderError) as exc:
            raise InputError(str(exc)) from None


TRACES_OPTIONS: dict[str, tuple[Any, Any]] = {
    "otlp": (OtlpFlowOpt, None),
    "otlp_headers_block": (OtlpHeadersBlockOpt, None),
    "otlp_project": (OtlpProjectOpt, None),
    "otlp_run_name": (OtlpRunNameOpt, None),
}
"""The fields of :class:`FlowTraces` as options: (annotation, default), declared once for every command."""


def traces_options(command: Command) -> Command:
    """Give a command the flows' trace options as one ``traces`` argument (before ``--json``)."""
    return _grouped_options(command, "traces", TRACES_OPTIONS, FlowTraces)


def _bounds(field: str, metadata: Sequence[Any]) -> dict[str, Any]:
    """A field's numeric bounds (pydantic's ``ge``/``gt``/``le``) as the option's range and check."""
    found: dict[str, Any] = {}
    for item in metadata:
        for name, key in (("ge", "min"), ("gt", "min"), ("le", "max")):
            if getattr(item, name, None) is not None:
                found[key] = getattr(item, name)
        if getattr(item, "gt", None) is not None:
            found["callback"] = _above(field, item.gt)
    return found


def _above(field: str, low: float) -> Callable[[float | None], float | None]:
    """A check for a strict lower bound (Click's ranges here are closed)."""

    def check(value: float | None) -> float | None:
        if value is not None and value <= low:
            raise typer.BadParameter(f"{value} is not above {low} ({field} > {low})")
        return value

    return check


def _choice(field: str, choices: Sequence[str]) -> Any:
    """An enum of a ``Literal`` field's values: Click lists them in ``--help`` and refuses others."""
    return StrEnum(field, {choice: choice for choice in choices})


def _settings_option(
    model: type[Any], field: str, names: tuple[str, ...], env_names: dict[str, str]
) -> Parameter:
    """One command-line option made from a settings field: its type, default, bounds, help, env var."""
    info = model.model_fields[field]
    kind = info.annotation
    choices = [str(a) for a in typing.get_args(kind) if a is not type(None)]
    option: dict[str, Any] = {"help": info.description, "envvar": env_names.get(field)}
    annotation: Any = str | None
    if kind in (bool, int, float):
        annotation = kind
        option.update(_bounds(field, info.metadata))
    elif typing.get_origin(kind) is typing.Literal:
        annotation = _choice(field, choices)
    if info.is_required():
        default: Any = Parameter.empty
    elif info.default_factory is not None:
        default = None  # a mapping, given as JSON
    else:
        default = info.default
    return Parameter(
        field,
        Parameter.KEYWORD_ONLY,
        annotation=Annotated[annotation, typer.Option(*names, **option)],
        default=default,
    )


def settings_options(
    model: type[Any], options: dict[str, tuple[str, ...]], env_names: dict[str, str]
) -> Callable[[Command], Command]:
    """Give a command one option per settings field, handed to it as one ``settings`` mapping.

    Each default, bound and description lives once, on the settings model; ``--help`` shows them;
    ``env_names`` maps a field to the environment variable that sets it.
    """

    def decorate(command: Command) -> Command:
        declared, kept = _keyword_only(command, "settings")
        generated = [_settings_option(model, field, names, env_names) for field, names in options.items()]

        @functools.wraps(command)
        def run(**given: Any) -> None:
            values = {field: given.pop(field) for field in options}
            values = {k: v.value if isinstance(v, StrEnum) else v for k, v in values.items() if v is not None}
            command(settings=values, **given)

        run.__signature__ = declared.replace(parameters=[*generated, *kept])  # type: ignore[attr-defined]
        return run

    return decorate
