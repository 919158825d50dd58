"""The ``local`` backend: every command in a fresh bubblewrap (``bwrap``) sandbox over the episode's directories.

What a command sees:

- the host's system, read-only: ``/usr``, ``/bin``, ``/lib``, ``/lib64``, ``/sbin``, and of ``/etc`` only what
  programs need to run (the loader's cache, users and groups, alternatives, certificates, locale and time
  zone); no other directory of the host (not ``/root``, ``/home``, nor another episode's directories);
- its episode's directories, writable: ``/app`` (where commands start), ``/logs`` and ``/tmp``; ``/tests`` and
  ``/solution`` once something was copied there (the verifier's turn, the oracle);
- no network: a network namespace of its own with loopback only; with a ``model_url`` (the episode's endpoint,
  the capture proxy on the host's loopback), that endpoint at ``model_url_inside`` (``127.0.0.1:8000`` and the
  same path, also in ``OPENAI_BASE_URL``), relayed through a Unix socket (``forwarder``; needs the host's
  ``python3``);
- its own PID namespace: whatever a command starts dies when it ends, and ``--die-with-parent`` ends it when
  the client dies.

Limits (``Limits``): a command past its timeout is killed with its process group. Memory and processes go
through a cgroup of the sandbox's own where ``/sys/fs/cgroup`` can be written (v2, else v1's ``memory`` and
``pids`` controllers); without one, memory is bounded as the address space (``RLIMIT_AS``) and processes are
not bounded (``RLIMIT_NPROC`` counts per user, and is not enforced for root): logged once.

Each sandbox's directories live under ``root`` (default: the user's data dir, ``agentjet/sandboxes``) with an
owner file (the client's pid and its start time). The first sandbox a process starts removes those whose
owner is gone (a client killed mid-episode), with their cgroups and any process left in them
(``clean_stale``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import posixpath
import resource
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from agentjet_client.sandbox import forwarder
from agentjet_client.sandbox.base import MAX_OUTPUT, ExecResult, Limits, Sandbox, SandboxError

logger = logging.getLogger(__name__)

SYSTEM = ("/usr", "/bin", "/lib", "/lib64", "/sbin")
ETC = (
    "alternatives",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "passwd",
    "group",
    "nsswitch.conf",
    "hosts",
    "ssl",
    "ca-certificates",
    "localtime",
    "timezone",
    "locale.alias",
    "mime.types",
)
WRITABLE = ("/app", "/logs", "/tmp")  # made at start
ON_COPY = ("/tests", "/solution")  # mounted once something was copied there
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
INSIDE_PORT = 8000  # where the model endpoint listens inside a sandbox
RELAY = "/run/agentjet"  # inside: the forwarder script and the host's socket
# with a model endpoint, a command runs once the forwarder listens ($1: the command, $2: the ready file)
WITH_FORWARDER = (
    f'python3 {RELAY}/forwarder.py {INSIDE_PORT} {RELAY}/model.sock "$2" & '
    'for _ in $(seq 1000); do [ -e "$2" ] && break; sleep 0.01; done; rm -f "$2"; exec bash -c "$1"'
)
_cleaned = False
_warned_cgroups = False


def default_root() -> Path:
    """Where sandboxes live unless told otherwise (XDG data dir)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agentjet" / "sandboxes"


def bwrap() -> str:
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxError(
            "the local sandbox needs bubblewrap (`bwrap`), which is not installed: `apt-get install bubblewrap` "
            "(Debian, Ubuntu), `dnf install bubblewrap` (Fedora)"
        )
    return found


def _started_at(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Cgroup:
    """A cgroup of one sandbox's own with its limits, in v2 or in v1's ``memory`` and ``pids`` hierarchies;
    ``dirs`` is empty where none can be made."""

    BASE = Path("/sys/fs/cgroup")

    def __init__(self, name: str) -> None:
        self.name = name
        if (self.BASE / "cgroup.controllers").exists():
            self.dirs = [self.BASE / name]
        else:
            self.dirs = [self.BASE / kind / name for kind in ("memory", "pids") if (self.BASE / kind).is_dir()]

    def make(self, limits: Limits) -> bool:
        """Create it with ``limits``; False (and nothing left behind) where the host does not allow it."""
        try:
            for directory in self.dirs:
                directory.mkdir(exist_ok=True)
                for knob, value in self._knobs(directory, limits):
                    (directory / knob).write_text(value)
        except OSError:
            self.remove()
            self.dirs = []
        return bool(self.dirs)

    def _knobs(self, directory: Path, limits: Limits) -> list[tuple[str, str]]:
        memory = None if limits.memory_mb is None else str(limits.memory_mb << 20)
        pids = None if limits.max_processes is None else str(limits.max_processes)
        wanted = [
            ("memory.max", memory),
            ("memory.limit_in_bytes", memory),
            ("memory.memsw.limit_in_bytes", memory),  # v1 with swap accounting: no swapping past the limit
            ("memory.swap.max", "0" if memory else None),
            ("pids.max", pids),
        ]
        return [(knob, value) for knob, value in wanted if value is not None and (directory / knob).exists()]

    def join(self) -> None:
        """(in the child, before it runs bwrap) Move the calling process into the cgroup."""
        for directory in self.dirs:
            (directory / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        """Kill what is left in it and remove it."""
        for directory in self.dirs:
            if not directory.is_dir():
                continue
            for _ in range(50):
                try:
                    pids = [int(p) for p in (directory / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    directory.rmdir()
                    break
                except OSError:  # processes still exiting
                    time.sleep(0.02)


def clean_stale(root: Path) -> int:
    """Remove the sandboxes under ``root`` whose client is gone, with their cgroups; how many."""
    removed = 0
    if not root.is_dir():
        return 0
    for directory in root.iterdir():
        owner = directory / "owner"
        try:
            pid, started = owner.read_text().split()
        except (OSError, ValueError):
            if directory.is_dir() and time.time() - directory.stat().st_mtime < 60:
                continue  # being made now, by a sandbox starting in another process
            pid, started = "0", ""
        if pid.isdigit() and _started_at(int(pid)) == started:
            continue
        Cgroup(f"agentjet-{directory.name}").remove()
        shutil.rmtree(directory, ignore_errors=True)
        for relay in Path(tempfile.gettempdir()).glob(f"agentjet-{directory.name}-*"):  # its model socket's
            shutil.rmtree(relay, ignore_errors=True)
        removed += 1
    if removed:
        logger.info("removed %d sandboxes that a killed client left in %s", removed, root)
    return removed


async def _read_capped(stream: asyncio.StreamReader) -> str:
    """The stream's first ``MAX_OUTPUT`` bytes (the rest read and dropped, with a line saying so)."""
    kept, dropped = bytearray(), 0
    while chunk := await stream.read(1 << 16):
        room = MAX_OUTPUT - len(kept)
        kept += chunk[:room]
        dropped += max(0, len(chunk) - room)
    text = kept.decode("utf-8", errors="replace")
    return text + (f"\n[{dropped} more bytes cut]" if dropped else "")


class LocalSandbox(Sandbox):
    """One episode's sandbox on this host under bubblewrap (see the module docstring)."""

    def __init__(self, limits: Limits | None = None, root: Path | None = None, model_url: str | None = None) -> None:
        self.limits = limits or Limits()
        self.id = uuid.uuid4().hex[:12]
        self.root = (root or default_root()) / self.id
        self.model_url = model_url
        self.model_url_inside: str | None = None
        self._cgroup = Cgroup(f"agentjet-{self.id}")
        self._lock = asyncio.Lock()
        self._started = self._stopped = False
        self._relay: asyncio.Server | None = None
        self._relay_dir: Path | None = None

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        global _cleaned
        if self._stopped:
            raise SandboxError(f"sandbox {self.id} was stopped; start a new one")
        if self._started:
            return
        bwrap()
        if not _cleaned:
            _cleaned = True
            await asyncio.to_thread(clean_stale, self.root.parent)
        self.root.mkdir(parents=True)
        for inside in WRITABLE:
            (self.root / inside.lstrip("/")).mkdir()
        (self.root / "owner").write_text(f"{os.getpid()} {_started_at(os.getpid())}")
        if not await asyncio.to_thread(self._cgroup.make, self.limits):
            self._warn_no_cgroups()
        if self.model_url is not None:
            await self._open_relay(self.model_url)
        self._started = True

    async def _open_relay(self, url: str) -> None:
        """Serve the episode's endpoint on a Unix socket for the sandbox's forwarder (see ``forwarder``)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise SandboxError(f"model_url {url!r}: the sandbox relays plain http://host:port/... endpoints")
        if not shutil.which("python3", path=PATH):
            raise SandboxError("a sandbox with a model endpoint runs its forwarder with python3, which the host lacks")
        host, port = parts.hostname, parts.port or 80
        # a short directory of its own: a Unix socket's path is limited to about 100 bytes
        self._relay_dir = Path(tempfile.mkdtemp(prefix=f"agentjet-{self.id}-"))
        shutil.copy2(forwarder.__file__, self._relay_dir / "forwarder.py")
        self._relay = await asyncio.start_unix_server(
            forwarder.relay(lambda: asyncio.open_connection(host, port)), path=str(self._relay_dir / "model.sock")
        )
        self.model_url_inside = f"http://127.0.0.1:{INSIDE_PORT}{parts.path}"

    def _warn_no_cgroups(self) -> None:
        global _warned_cgroups
        if not _warned_cgroups:
            _warned_cgroups = True
            logger.warning(
                "no cgroup can be made here (/sys/fs/cgroup is not writable): a sandbox's memory is bounded as "
                "its address space, and its processes are not bounded"
            )

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        async with self._lock:
            if self._relay is not None:
                self._relay.close()
            await asyncio.to_thread(self._cgroup.remove)
            await asyncio.to_thread(shutil.rmtree, self.root, True)
            if self._relay_dir is not None:
                await asyncio.to_thread(shutil.rmtree, self._relay_dir, True)

    # ------------------------------------------------------------------ commands

    def _arguments(self, command: str, cwd: str, env: dict[str, str]) -> list[str]:
        args = [bwrap(), "--die-with-parent", "--new-session", "--unshare-all", "--hostname", "sandbox"]
        args += ["--clearenv", "--setenv", "PATH", PATH, "--setenv", "HOME", "/app", "--setenv", "LANG", "C.UTF-8"]
        if self.model_url_inside is not None:
            env = {"OPENAI_BASE_URL": self.model_url_inside, "AGENTJET_MODEL_URL": self.model_url_inside, **env}
        for name, value in env.items():
            args += ["--setenv", name, value]
        for system in SYSTEM:
            args += ["--ro-bind-try", system, system]
        for name in ETC:
            args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        args += ["--proc", "/proc", "--dev", "/dev"]
        for inside in WRITABLE + ON_COPY:
            host = self.root / inside.lstrip("/")
            if host.is_dir():
                args += ["--bind", str(host), inside]
        if self._relay_dir is not None:
            args += ["--ro-bind", str(self._relay_dir), RELAY]
        args += ["--remount-ro", "/"]  # the sandbox's own root, where bwrap made the mount points: nothing new there
        if self._relay_dir is None:
            return [*args, "--chdir", cwd, "bash", "-c", command]
        ready = f"/tmp/.agentjet-forwarder-{uuid.uuid4().hex[:8]}"
        return [*args, "--chdir", cwd, "bash", "-c", WITH_FORWARDER, "agentjet", command, ready]

    def _limit(self) -> None:
        """(in the child, before it runs bwrap) Join the cgroup, or bound the address space without one."""
        if self._cgroup.dirs:
            self._cgroup.join()
        elif self.limits.memory_mb is not None:
            size = self.limits.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    async def exec(
        self, command: str, *, timeout: float | None = None, cwd: str = "/app", env: dict[str, str] | None = None
    ) -> ExecResult:
        if not self._started or self._stopped:
            raise SandboxError(f"sandbox {self.id} is not running (start it, or use `async with`)")
        limit = self.limits.timeout_s if timeout is None else timeout
        async with self._lock:
            began = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                *self._arguments(command, cwd, env or {}),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._limit,
            )
            assert process.stdout is not None and process.stderr is not None
            outputs = asyncio.gather(_read_capped(process.stdout), _read_capped(process.stderr))
            timed_out = False
            try:
                await asyncio.wait_for(process.wait(), limit)
            except TimeoutError:
                timed_out = True
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await process.wait()
            stdout, stderr = await outputs
        code = process.returncode if process.returncode is not None else -9
        return ExecResult(code, stdout, stderr, timed_out, time.monotonic() - began)

    # ------------------------------------------------------------------ files

    def _host(self, path: str, *, make: bool = False) -> Path:
        """The host's path of ``path`` inside, refused if it leaves the sandbox's directories (``..``, or a link
        that points out); with ``make``, the mount it is under is made (``/tests``, ``/solution``)."""
        inside = posixpath.normpath("/" + path.lstrip("/")) if path.startswith("/") else None
        mounts = WRITABLE + ON_COPY
        top = next((m for m in mounts if inside is not None and (inside == m or inside.startswith(m + "/"))), None)
        if inside is None or top is None:
            raise SandboxError(f"{path!r} is not in the sandbox's own directories ({', '.join(mounts)})")
        base = self.root / top.lstrip("/")
        if make:
            base.mkdir(exist_ok=True)
        host = base / inside[len(top) :].lstrip("/")
        real_base = base.resolve()
        real = host.resolve() if host.exists() or host.is_symlink() else host.parent.resolve() / host.name
        if real != real_base and real_base not in real.parents:
            raise SandboxError(f"{path!r} leads out of the sandbox (through a link)")
        return real

    async def read_file(self, path: str) -> bytes:
        async with self._lock:
            host = self._host(path)
            try:
                return await asyncio.to_thread(host.read_bytes)
            except OSError as exc:
                raise SandboxError(f"cannot read {path} in the sandbox: {exc.strerror}") from None

    async def write_file(self, path: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else data
        async with self._lock:
            host = self._host(path, make=True)
            host.parent.mkdir(parents=True, exist_ok=True)
            await asyncio.to_thread(host.write_bytes, raw)

    async def copy_in(self, source: Path, path: str) -> None:
        async with self._lock:
            host = self._host(path, make=True)
            if source.is_dir():
                await asyncio.to_thread(shutil.copytree, source, host, symlinks=True, dirs_exist_ok=True)
            else:
                host.parent.mkdir(parents=True, exist_ok=True)
                await asyncio.to_thread(shutil.copy2, source, host)

    async def copy_out(self, path: str, destination: Path) -> None:
        async with self._lock:
            host = self._host(path)
            if host.is_dir():
                await asyncio.to_thread(shutil.copytree, host, destination, symlinks=True, dirs_exist_ok=True)
            elif host.is_file():
                await asyncio.to_thread(shutil.copy2, host, destination)
            else:
                raise SandboxError(f"there is nothing at {path} in the sandbox")
