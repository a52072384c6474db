"""A private PostgreSQL 16 + pgvector server for ``ragstream up`` and the test suite.

Runs the binaries bundled in the ``pgserver`` wheel (initdb, pg_ctl, postgres, psql)
directly, not pgserver's Python API: run as root, that creates users and chmods parent
folders. PostgreSQL refuses to run as root, so as root the server runs as an
unprivileged account through ``setpriv``, from a copy of the binaries that account can
read (a virtualenv under /root is not readable).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

__all__ = ["EmbeddedPostgres", "EmbeddedPostgresError"]

# As root: world-readable copies of the binaries, one per pgserver version.
_SHARED_INSTALL = Path("/var/tmp/ragstream-pginstall")
# As root: clusters whose requested data dir the server account cannot reach.
_RELOCATED = Path("/var/lib/ragstream/clusters")
# As root: the first of these accounts that exists runs the server.
_RUN_AS = ("ragstream", "nobody")
# Included by postgresql.conf, rewritten on each start (port, socket path may change).
_CONF = "ragstream.conf"
_SUPERUSER = "postgres"
_INITDB_OPTIONS = ["--auth=trust", f"--username={_SUPERUSER}", "--encoding=UTF8"]
_INITDB_OPTIONS += ["--locale=C", "--no-instructions"]


class EmbeddedPostgresError(RuntimeError):
    """The server could not be set up, started or stopped (the message has the log)."""


class EmbeddedPostgres:
    """One cluster in ``data_dir`` on 127.0.0.1, trust auth: made once, then reused."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        # Resolved: a running server is recognised by this path in its command line.
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self._running_port: int | None = None
        self._account = _unprivileged_account() if os.geteuid() == 0 else None
        if self._account:
            self.data_dir = _reachable_cluster_dir(self.data_dir)
        self._log = self.data_dir / "postgres.log"
        self._setpriv: list[str] = []
        if self._account:
            user, group = self._account
            ids = [f"--reuid={user}", f"--regid={group}"]
            self._setpriv = ["setpriv", *ids, "--clear-groups"]
        # setpriv keeps the environment; PGPORT, PGHOST... would redirect psql.
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        self._env["LC_ALL"] = "C"

    @property
    def dsn(self) -> str:
        """The asyncpg/libpq URL of the running server."""
        if self._running_port is None:
            raise EmbeddedPostgresError("EmbeddedPostgres is not started")
        return f"postgresql://{_SUPERUSER}@127.0.0.1:{self._running_port}/postgres"

    def start(self) -> str:
        """Create the cluster if needed, start it, ensure pgvector; return the DSN."""
        if self._running_port is not None:
            return self.dsn
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._account:
            self._check_reachable()
            _chown_tree(self.data_dir, *self._account)
        if not (self.data_dir / "PG_VERSION").exists():
            if any(self.data_dir.iterdir()):
                raise EmbeddedPostgresError(f"{self.data_dir}: not empty, no cluster")
            self._run("initdb", "-D", str(self.data_dir), *_INITDB_OPTIONS)
            with (self.data_dir / "postgresql.conf").open("a") as conf:
                conf.write(f"\ninclude_if_exists = '{_CONF}'\n")
        self._shutdown()  # a server left running by a process that died
        # After a crash (kill -9) the lock files name a dead, zombie or reused pid.
        pid_file = self.data_dir / "postmaster.pid"
        for lock in [pid_file, *self.data_dir.glob(".s.PGSQL.*")]:
            lock.unlink(missing_ok=True)
        port = self.port or _free_port(self._configured_port())
        socket_dir = str(self.data_dir).replace("'", "''")
        (self.data_dir / _CONF).write_text(
            f"port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{socket_dir}'\nfsync = on\n"
        )
        self._run("pg_ctl", "start", "-D", str(self.data_dir), "-l", str(self._log), "-w")
        self._running_port = port
        where = ["-h", "127.0.0.1", "-p", str(port), "-U", _SUPERUSER, "-d", "postgres"]
        sql = "CREATE EXTENSION IF NOT EXISTS vector"
        self._run("psql", "-Xq", "-v", "ON_ERROR_STOP=1", *where, "-c", sql)
        return self.dsn

    def stop(self) -> None:
        """Fast shutdown (open transactions roll back); a no-op when not started."""
        if self._running_port is None:
            return
        self._running_port = None
        self._shutdown()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _shutdown(self, timeout: float = 60) -> None:
        """Fast shutdown of a live server, waiting until it exits.

        Not ``pg_ctl stop``: after a kill -9 it waits for the pid to vanish, which a
        zombie that is not reaped yet never does.
        """
        if (pid := self._postmaster_pid()) is None:
            return
        os.kill(pid, signal.SIGINT)  # fast mode: roll back open transactions
        deadline = time.monotonic() + timeout
        while self._postmaster_pid() is not None:
            if time.monotonic() > deadline:
                raise self._error(f"postgres (pid {pid}) runs after {timeout:.0f}s")
            time.sleep(0.05)

    def _run(self, program: str, *args: str) -> None:
        """Run a bundled binary (unprivileged when we are root); raise with the log."""
        binary = str(_readable_install() / "bin" / program)
        done = subprocess.run(
            [*self._setpriv, binary, *args],
            cwd="/",  # the server account may not be able to read ours
            env=self._env,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode:
            error = f"{program} failed (exit {done.returncode}): {done.stderr.strip()}"
            raise self._error(error)

    def _error(self, message: str) -> EmbeddedPostgresError:
        log = self._log.read_text(errors="replace") if self._log.exists() else ""
        tail = "\n".join(log.splitlines()[-30:]) or "(empty)"
        return EmbeddedPostgresError(f"{message}\n--- tail of {self._log} ---\n{tail}")

    def _postmaster_pid(self) -> int | None:
        """The pid in postmaster.pid if it is a live postgres serving this data dir."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split()[0])
            process = Path(f"/proc/{pid}")
            state = (process / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = (process / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            return None
        ours = b"postgres" in cmdline and str(self.data_dir).encode() in cmdline
        return pid if ours and state not in "ZX" else None

    def _configured_port(self) -> int:
        """The last run's port: the DSN stays stable across restarts if still free."""
        conf = self.data_dir / _CONF
        text = conf.read_text() if conf.exists() else ""
        found = re.search(r"^port = (\d+)$", text, re.MULTILINE)
        return int(found[1]) if found else 0

    def _check_reachable(self) -> None:
        """Fail early and clearly when the server account cannot reach the data dir."""
        if blocked := _unsearchable_parent(self.data_dir):
            raise EmbeddedPostgresError(
                f"{blocked} is not searchable by others, so the server account "
                f"cannot reach {self.data_dir}: use a folder under e.g. /var/tmp"
            )


def _unsearchable_parent(path: Path) -> Path | None:
    existing = [parent for parent in path.parents if parent.exists()]
    return next((parent for parent in existing if not parent.stat().st_mode & stat.S_IXOTH), None)


def _reachable_cluster_dir(data_dir: Path) -> Path:
    """As root, a data dir under a private folder (``/root/...``) cannot be reached by the server
    account; the cluster then lives under ``/var/lib/ragstream/clusters``, one folder per requested
    data dir, instead of loosening the permissions of the user's folders."""
    if _unsearchable_parent(data_dir) is None:
        return data_dir
    key = hashlib.sha256(str(data_dir).encode()).hexdigest()[:16]
    _RELOCATED.mkdir(parents=True, exist_ok=True)
    _RELOCATED.chmod(0o755)
    return _RELOCATED / key


def _unprivileged_account() -> tuple[int, int]:
    for name in _RUN_AS:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return entry.pw_uid, entry.pw_gid
    raise EmbeddedPostgresError("as root, an unprivileged account is needed: useradd --system ragstream")


@functools.cache
def _readable_install() -> Path:
    """pgserver's ``pginstall``; as root, a world-readable copy of it."""
    spec = importlib.util.find_spec("pgserver")  # importing it has side effects
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError("the pgserver package is not installed")
    package = Path(spec.origin).parent
    if os.geteuid() != 0:
        return package / "pginstall"
    target = _SHARED_INSTALL / importlib.metadata.version("pgserver")
    if not target.exists():
        _SHARED_INSTALL.mkdir(mode=0o755, parents=True, exist_ok=True)
        if _SHARED_INSTALL.stat().st_uid != 0:  # others could have planted binaries
            raise EmbeddedPostgresError(f"{_SHARED_INSTALL} is not owned by root")
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_SHARED_INSTALL))
        pginstall = staging / "pgserver" / "pginstall"
        shutil.copytree(package / "pginstall", pginstall, symlinks=True)
        # The binaries find libpq via RPATH $ORIGIN/../../../pgserver.libs: same layout.
        shutil.copytree(package.parent / "pgserver.libs", staging / "pgserver.libs")
        for path in [staging, *staging.rglob("*")]:
            if not path.is_symlink():
                extra = 0o555 if path.is_dir() else 0o444
                path.chmod(path.stat().st_mode | extra)
        try:
            staging.rename(target)
        except OSError:  # a concurrent start won the race
            shutil.rmtree(staging)
    return target / "pgserver" / "pginstall"


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    if root.stat().st_uid != uid:
        for path in [root, *root.rglob("*")]:
            os.chown(path, uid, gid, follow_symlinks=False)


def _free_port(preferred: int = 0) -> int:
    """``preferred`` if it can be bound on 127.0.0.1, else one the kernel picks."""
    with socket.socket() as sock:
        # Like postgres itself: a recent connection's TIME_WAIT must not block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", preferred))
        except OSError:
            sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
