"""A real single-node KRaft Apache Kafka broker for tests, benchmarks and ``make run-distributed`` (no Docker).

The broker jars come from Maven Central (``deploy/local-kafka/pom.xml``), fetched once
with ``mvn dependency:copy-dependencies`` into ``<repo>/.cache/kafka/<version>/libs``
(or ``$RAGSTREAM_KAFKA_LIBS``) and reused. Each start formats fresh storage under
``work_dir`` and runs ``kafka.Kafka`` on free ports of 127.0.0.1.

It needs a source checkout (the pom lives in the repository, not in the wheel).
Run one in the foreground: ``python -m ragstream.local_kafka --work-dir DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Self

from aiokafka.admin import AIOKafkaAdminClient

__all__ = ["KAFKA_VERSION", "KafkaNode", "KafkaNodeError", "kafka_libs"]

KAFKA_VERSION = "4.4.0"
# libs/common/src/ragstream/local_kafka.py: the checkout is four levels up (editable install).
_REPO = Path(__file__).resolve().parents[4]
_POM = _REPO / "deploy" / "local-kafka" / "pom.xml"
# The format tool runs for a second: skip the optimising JIT, halving its run time.
_SHORT_LIVED_JVM = ["-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
_LOG4J2 = """\
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
"""


def _cluster_id() -> str:
    """A random cluster id in Kafka's form (URL-safe base64 of 16 bytes). Like Kafka's own
    ``Uuid.randomUuid``, never one starting with ``-``: the storage tool would read it as an option."""
    while (cluster_id := base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")).startswith("-"):
        pass
    return cluster_id


class KafkaNodeError(RuntimeError):
    """The jars could not be fetched or the broker did not come up (message has logs)."""


def kafka_libs() -> Path:
    """The folder of broker jars, downloaded by Maven on first use and reused after."""
    default = _REPO / ".cache" / "kafka" / KAFKA_VERSION / "libs"
    libs = Path(os.environ.get("RAGSTREAM_KAFKA_LIBS") or default)
    if any(libs.glob("kafka_2.13-*.jar")):
        return libs
    libs.parent.mkdir(parents=True, exist_ok=True)
    # Download beside the target and rename: an interrupted fetch never looks complete.
    staging = Path(tempfile.mkdtemp(prefix=".libs-", dir=libs.parent))
    command = [_tool("mvn"), "-B", "-q", "-f", str(_POM)]
    command += ["dependency:copy-dependencies", f"-DoutputDirectory={staging}"]
    done = subprocess.run(
        [*command, f"-Dkafka.version={KAFKA_VERSION}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        shutil.rmtree(staging, ignore_errors=True)
        raise KafkaNodeError(f"mvn failed:\n{done.stdout}{done.stderr}"[-4000:])
    shutil.rmtree(libs, ignore_errors=True)  # an empty or partial folder
    staging.rename(libs)
    return libs


class KafkaNode:
    """One broker+controller process with empty storage in ``work_dir``."""

    def __init__(self, work_dir: Path, *, startup_timeout: float = 90.0) -> None:
        self.work_dir = Path(work_dir).absolute()
        self.startup_timeout = startup_timeout
        self.log_path = self.work_dir / "kafka.log"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._bootstrap: str | None = None

    @property
    def bootstrap_servers(self) -> str:
        """``127.0.0.1:PORT`` of the running broker."""
        if self._bootstrap is None:
            raise KafkaNodeError("KafkaNode is not started")
        return self._bootstrap

    def start(self) -> str:
        """Format storage, start the broker, wait until it serves metadata."""
        if self._bootstrap is not None:
            return self._bootstrap
        libs, java = kafka_libs(), _tool("java")
        shutil.rmtree(self.work_dir / "data", ignore_errors=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        broker_port, controller_port = _free_ports(2)
        properties = self.work_dir / "server.properties"
        properties.write_text(_server_properties(self.work_dir / "data", broker_port, controller_port))
        (self.work_dir / "log4j2.properties").write_text(_LOG4J2)
        self._log = self.log_path.open("wb")
        cluster_id = _cluster_id()
        formatted = subprocess.run(
            [
                *self._jvm(java),
                *_SHORT_LIVED_JVM,
                "-cp",
                f"{libs}/*",
                "kafka.tools.StorageTool",
                "format",
                "--standalone",
                "--cluster-id",
                cluster_id,
                "--config",
                str(properties),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            check=False,
        )
        if formatted.returncode:
            self.stop()
            raise KafkaNodeError(f"formatting storage failed:\n{self._tail()}")
        return self._launch(f"127.0.0.1:{broker_port}")

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would: no controlled shutdown, no flush. Its storage, ports
        and log stay, for ``restart()``."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def restart(self) -> str:
        """Start the broker again on the same ports and storage (after ``kill()`` or a crash), and
        wait until it serves metadata; the bootstrap address is unchanged."""
        if self._bootstrap is None:
            raise KafkaNodeError("KafkaNode is not started")
        self.kill()
        return self._launch(self._bootstrap)

    def _jvm(self, java: str) -> list[str]:
        return [java, f"-Dlog4j2.configurationFile={self.work_dir / 'log4j2.properties'}"]

    def _launch(self, bootstrap: str) -> str:
        if self._log is None:
            self._log = self.log_path.open("ab")
        properties = self.work_dir / "server.properties"
        self._process = subprocess.Popen(
            [
                *self._jvm(_tool("java")),
                "-Xmx512m",
                "-Xms128m",
                "-cp",
                f"{kafka_libs()}/*",
                "kafka.Kafka",
                str(properties),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C reaches us, we stop it cleanly
        )
        pool = ThreadPoolExecutor(1)  # its own event loop, even if the caller runs one
        try:
            ready = self._wait_ready(self._process, bootstrap)
            pool.submit(asyncio.run, ready).result()
        except BaseException:  # also Ctrl-C: the broker must not outlive us
            self.stop()
            raise
        finally:
            pool.shutdown(wait=False)
        self._bootstrap = bootstrap
        return bootstrap

    def stop(self) -> None:
        """Controlled shutdown (SIGTERM), killed after 30 s; a no-op when not started."""
        process, self._process, self._bootstrap = self._process, None, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if process.poll() is None:  # hung, or a second Ctrl-C: never leave it
                    process.kill()
                    process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._process is not None and self._process.poll() is None

    async def _wait_ready(self, process: subprocess.Popen[bytes], bootstrap: str) -> None:
        """Poll with a real client until the broker lists topics and reports itself."""
        deadline = time.monotonic() + self.startup_timeout
        last_error: Exception | None = None
        while True:
            if process.poll() is not None:
                raise KafkaNodeError(f"kafka exited with {process.returncode}:\n{self._tail()}")
            # A plain TCP probe first keeps aiokafka from logging refused connections.
            if await _accepts_connections(bootstrap):
                admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
                try:
                    await admin.start()
                    await admin.list_topics()
                    if (await admin.describe_cluster())["brokers"]:
                        return
                except Exception as error:
                    last_error = error
                finally:
                    await admin.close()
            if time.monotonic() > deadline:
                raise KafkaNodeError(
                    f"kafka not ready after {self.startup_timeout:.0f}s ({last_error!r}):\n{self._tail()}"
                )
            await asyncio.sleep(0.25)

    def _tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def _server_properties(data: Path, broker_port: int, controller_port: int) -> str:
    return f"""\
process.roles=broker,controller
node.id=1
listeners=PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}
log.dirs={data}
auto.create.topics.enable=true
num.partitions=3
offsets.topic.replication.factor=1
offsets.topic.num.partitions=3
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
"""


async def _accepts_connections(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        _, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        return False
    writer.close()
    await writer.wait_closed()
    return True


def _free_ports(count: int) -> list[int]:
    """Distinct free ports: all sockets stay bound until every port is chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise KafkaNodeError(f"`{name}` not found: run scripts/install-system-deps.sh")
    return found


def main() -> None:
    """Run one broker in the foreground until SIGINT/SIGTERM (for benchmarks)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", type=Path, required=True)
    args = parser.parse_args()
    with KafkaNode(args.work_dir) as node:
        print(node.bootstrap_servers, flush=True)
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # after starting java
        while signal.sigtimedwait(stop_signals, 1.0) is None:
            if not node.running:
                raise SystemExit(f"kafka exited; see {node.log_path}")


if __name__ == "__main__":
    main()
