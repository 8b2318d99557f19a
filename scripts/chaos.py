#!/usr/bin/env python3
"""Chaos harness for idem: the payments demo consumed while workers, connections and the database fail.

Each trial produces the demo's payment events into a fresh embedded log (`idem demo-produce`), prepares the
demo's tables in a fresh database (`idem demo-prepare`), and runs 1 to 3 consumer processes of one group
(`idem demo-worker --follow`) while a fault loop, at random times, kills a worker with SIGKILL, terminates the
database's backends, makes the database refuse connections, or cuts the network between the workers and the
database (a TCP proxy owned by this script). On MySQL/MariaDB (--databases mysql) the backends are ended with
`KILL CONNECTION`; MySQL has no per-database switch to refuse connections, so that fault is PostgreSQL's alone. Then the faults stop, the workers are stopped, and one worker
runs alone with no faults until it exits 0 at the end of the log. The ledger is then checked with plain SQL
against what was produced: every event applied exactly once, nothing lost, nothing doubled.

The embedded log gives a starting worker every partition no other worker holds; so that several workers really
run at once, the script holds the locks of some free partitions (the log's own `groups/<group>/<topic>/<p>.lock`
files) while a worker starts, then lets them go for the next one.

With --kafka-bin, some trials run over a Kafka-compatible broker (nisshi) that the script starts on a free port,
and restarts as one more fault.

With --flaky, the workers retry with delayed retries (two immediate attempts, then parked and tried again every
second, 60 times): every fifth credit of a random set of accounts fails retryably for a random while, so the faults also
land on parking, on the credits parked behind their account's failing one, and on releases. The final worker
then follows the log until nothing is parked, and the check adds that every account's credits were applied in
production order (SQLite: by rowid; PostgreSQL: by inserting transaction) and that nothing is left parked.

    scripts/chaos.py --idem target/debug/idem --trials 6 --seed 1
    scripts/chaos.py --idem target/release/idem --trials 1000 --json > chaos.json

Python 3 standard library only; PostgreSQL checks go through `psql`, MySQL's through the `mariadb` client. Exit status 0 only if every trial passed.
"""

import argparse
import fcntl
import json
import math
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

GROUP = "demo-ledger"
TOPIC = "payments"
HELD = "held by other consumers"
PG_FAULTS = ("kill", "terminate_backends", "refuse_connections", "proxy_cut")
SQLITE_FAULTS = ("kill",)
# MySQL/MariaDB: idem's sessions killed (`KILL CONNECTION`) and the network cut; the server has no per-database
# switch that refuses new connections.
MYSQL_FAULTS = ("kill", "terminate_backends", "proxy_cut")
FAULT_KINDS = PG_FAULTS + ("broker_restart",)
SESSION_TIMEOUT_MS = 6000  # Kafka workers' session.timeout.ms: a killed member's partitions move after about this


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: stop the trial in hand, clean up, print what was done."""


def on_signal(signum, _frame):
    # A second Ctrl-C must not cut the clean-up short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signal.Signals(signum).name)


# --------------------------------------------------------------------------------------------------------------
# The TCP proxy between the workers and PostgreSQL.


class Proxy:
    """Forwards 127.0.0.1:<port> to the server; `cut()` closes every connection and refuses new ones."""

    def __init__(self, host, port, latency=0.0):
        self.target = (host, port)
        self.latency = latency  # seconds added to every chunk forwarded, each way
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.pairs = set()
        self.refusing = False
        self.closed = False
        self.accepted = 0
        self.thread = threading.Thread(target=self._accept_loop, name="proxy-accept", daemon=True)
        self.thread.start()

    def _accept_loop(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                if self.closed:
                    client.close()
                    return
                refusing = self.refusing
            if refusing:
                self._reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                self._reset(client)
                continue
            # As the database's clients and servers do: small writes go out at once. Without it, Nagle's algorithm
            # on the proxy meets the client's delayed ACK and a reply of several packets waits 40 ms.
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self.lock:
                if self.refusing or self.closed:
                    self._close_pair_now(pair)
                    continue
                self.pairs.add(pair)
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, pair), daemon=True).start()

    def _pump(self, src, dst, pair):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.latency:
                    time.sleep(self.latency)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self.lock:
                self.pairs.discard(pair)
            self._close_pair_now(pair)

    @staticmethod
    def _reset(sock):
        """Closes with RST rather than FIN: a refused connection, as a dead network path looks to the client."""
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass

    @staticmethod
    def _close_pair_now(pair):
        for sock in pair:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass

    def _drop_all(self, flag):
        """Sets `flag` ("refusing" or "closed") and closes every proxied connection; returns how many."""
        with self.lock:
            setattr(self, flag, True)
            pairs = list(self.pairs)
            self.pairs.clear()
        for pair in pairs:
            self._close_pair_now(pair)
        return len(pairs)

    def cut(self):
        """Closes every proxied connection (both sides) and refuses new ones until `restore()`."""
        return self._drop_all("refusing")

    def restore(self):
        with self.lock:
            self.refusing = False

    def close(self):
        self._drop_all("closed")
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()


# --------------------------------------------------------------------------------------------------------------
# PostgreSQL administration, always from a connection to the `postgres` database (never through the proxy).


class Server:
    def __init__(self, url):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("postgres", "postgresql"):
            raise SystemExit(f"--postgres {url}: expected postgres://user@host:port")
        self.base = f"{parsed.scheme}://{parsed.netloc}"
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 5432
        self.user = parsed.username or "postgres"
        self.netloc = parsed.netloc

    def url(self, database, via_port=None):
        if via_port is None:
            return f"{self.base}/{database}"
        auth = self.netloc.rsplit("@", 1)[0] + "@" if "@" in self.netloc else ""
        return f"postgres://{auth}127.0.0.1:{via_port}/{database}"

    def psql(self, sql, database="postgres", timeout=30):
        """Runs `sql`; returns stdout (unaligned, tuples only). Raises RuntimeError with psql's error."""
        done = subprocess.run(
            ["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-d", self.url(database), "-c", sql],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "PGCONNECT_TIMEOUT": "10"},
        )
        if done.returncode != 0:
            raise RuntimeError(f"psql failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def create(self, name):
        self.psql(f'CREATE DATABASE "{name}"')

    def drop(self, name):
        self.allow(name)
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def allow(self, name):
        self.psql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')

    def refuse(self, name):
        self.psql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        return self.terminate(name)

    def terminate(self, name):
        out = self.psql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = '{name}' AND pid <> pg_backend_pid()"
        )
        return int(out.strip() or 0)


class MysqlServer:
    """MySQL or MariaDB administration through the `mariadb` (or `mysql`) client, never through the proxy."""

    def __init__(self, url):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("mysql", "mariadb"):
            raise SystemExit(f"--mysql {url}: expected mysql://user@host:port")
        self.host = parsed.hostname or "127.0.0.1"
        self.port = parsed.port or 3306
        self.user = urllib.parse.unquote(parsed.username or "root")
        self.password = urllib.parse.unquote(parsed.password or "")
        self.client = shutil.which("mariadb") or shutil.which("mysql") or "mariadb"

    def url(self, database, via_port=None):
        auth = urllib.parse.quote(self.user) + (":" + urllib.parse.quote(self.password) if self.password else "")
        return f"mysql://{auth}@{self.host}:{via_port or self.port}/{database}"

    def sql(self, sql, database="mysql", timeout=30):
        """Runs `sql`; returns stdout (tab-separated, no column names). Raises RuntimeError with the error."""
        done = subprocess.run(
            [self.client, "-h", self.host, "-P", str(self.port), "-u", self.user, "--protocol=tcp",
             "--connect-timeout=10", "-N", "-B", "-e", sql, database],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "MYSQL_PWD": self.password},
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{os.path.basename(self.client)} failed: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def create(self, name):
        self.sql(f"CREATE DATABASE `{name}`")

    def drop(self, name):
        self.terminate(name)
        self.sql(f"DROP DATABASE IF EXISTS `{name}`")

    def allow(self, name):
        pass

    def terminate(self, name):
        """KILL CONNECTION of every session on the database: idem's open transactions roll back."""
        ids = self.sql(
            f"SELECT id FROM information_schema.processlist WHERE db = '{name}' AND id <> CONNECTION_ID()"
        ).split()
        killed = 0
        for session in ids:
            try:
                self.sql(f"KILL CONNECTION {int(session)}")
                killed += 1
            except RuntimeError:
                pass  # it ended in the meantime
        return killed


# --------------------------------------------------------------------------------------------------------------
# The Kafka-compatible broker (nisshi) for --kafka-bin trials: started by this script on a free port.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """The clients reach it through a proxy on a port that never changes (its advertised address), while the
    broker listens on a fresh port at each start: it cannot bind its old port again as long as that port has
    connections in TIME_WAIT."""

    def __init__(self, binary, data_dir):
        self.binary = binary
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        open(os.path.join(data_dir, ".env"), "w").close()  # it reads a .env from its working directory
        self.proxy = Proxy("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.proxy.port}"
        self.listen_port = None
        self.log_path = os.path.join(data_dir, "broker.log")
        self.proc = None
        self.starts = 0

    def start(self):
        self.listen_port = free_port()
        self.proxy.target = ("127.0.0.1", self.listen_port)
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {self.starts} on 127.0.0.1:{self.listen_port}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [self.binary, "broker", "--listener-url", f"tcp://127.0.0.1:{self.listen_port}",
                 "--advertised-listener-url", f"tcp://{self.address}", "--storage-engine", "sqlite://nisshi.db"],
                cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip

    def answering(self):
        try:
            socket.create_connection(("127.0.0.1", self.listen_port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def wait_ready(self, timeout=30):
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the broker exited at start ({self.proc.returncode}); see {self.log_path}")
            if self.answering():
                return
            time.sleep(0.1)
        raise RuntimeError(f"the broker did not answer on {self.address} within {timeout} s; see {self.log_path}")

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace=10):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self):
        self.stop()
        self.proxy.close()


# --------------------------------------------------------------------------------------------------------------
# Worker processes.


class Slot:
    """One of the trial's concurrent consumer processes; restarted whenever it dies."""

    def __init__(self, index, log_path):
        self.index = index
        self.log_path = log_path
        self.proc = None
        self.log = None
        self.out_path = log_path[: -len(".log")] + ".out"  # stdout: one JSON line per commit / assignment
        self.out_pos = 0
        self.out_partial = b""
        self.assigned = None  # Kafka: the partitions the run holds now (empty after a revocation)
        self.last_assigned = None  # and those of its last non-empty assignment
        self.run_started_at = 0
        self.killed = False
        self.restart_at = None
        self.runs = 0


class Trial:
    def __init__(self, harness, number, rng):
        self.h = harness
        self.number = number
        self.rng = rng
        a = harness.args
        self.backend = rng.choice(a.databases)
        self.events = rng.randint(min(100, a.max_events), a.max_events)
        self.partitions = rng.randint(1, 8)
        self.batch = min(300, max(1, round(math.exp(rng.uniform(0, math.log(300))))))  # log-uniform 1..300
        self.workers = rng.randint(1, 3)
        self.duplicates = round(rng.uniform(0, 10), 1)
        self.produce_seed = rng.getrandbits(62)
        self.fault_mean = rng.uniform(0.1, 0.8)  # mean seconds between faults
        # Faults also fire when the acknowledged share of the log passes these points, so that some land while
        # the log is being consumed however fast that goes.
        self.fault_points = sorted(rng.uniform(0.02, 0.95) for _ in range(rng.randint(1, 4)))
        # Network latency through the proxy (PostgreSQL), per forwarded chunk: none in half of the trials.
        self.latency_ms = 0.0 if rng.random() < 0.5 else round(rng.uniform(0.1, 2.0), 2)
        self.chaos_budget = rng.uniform(a.chaos_min, a.chaos_max)  # seconds of faults at most
        # --flaky: accounts some of whose credits fail for a while (from the start of the faults).
        self.flaky_accounts = sorted(rng.sample(range(1, 1001), rng.randint(20, 150))) if a.flaky else []
        self.flaky_for = rng.uniform(0.5, self.chaos_budget + 2) if a.flaky else 0.0
        self.flaky_until_ms = 0
        self.transport = rng.choice(a.transports) if len(a.transports) > 1 else a.transports[0]
        if self.transport == "kafka":
            # Joining the group takes seconds, and a killed member's partitions move only after its session
            # expires: faults come less often, for longer.
            self.chaos_budget += 12
            self.fault_mean *= 6
        self.topic = self.group = f"idem-chaos-{os.getpid()}-{number}"
        self.applied = 0  # processed + dead-lettered, from the workers' commit reports
        self.last_kill_at = None
        self.broker_restart_at = None
        self.partial_finals = 0
        self.stuck_restarts = 0  # broker restarts because the group was stuck in a rebalance (a broker limit)
        self.faults = {kind: 0 for kind in FAULT_KINDS}
        self.worker_exits = 0  # non-zero exits not caused by this script (a database error, say); restarted
        self.held = 0  # workers that found every partition held (benign); restarted
        self.final_runs = 0
        self.concurrent = 0  # most workers seen holding partitions at the same time
        self.under_faults = 0.0  # share of the log's records acknowledged before the faults stopped
        self.chaos_seconds = 0.0
        self.reservation = None  # (slot, lock fds held for it, the partitions meant for it, until when)
        self.lock_ids = {}  # partition -> "maj:min:inode" of its lock file, as /proc/locks shows it
        self.exit_reasons = {}
        self.dir = None
        self.db_name = None
        self.proxy = None
        self.slots = []
        self.refused_until = None
        self.cut_until = None
        self.plan = None
        self.result = None

    # ----- set-up

    def log_dir(self):
        return os.path.join(self.dir, "log")

    def lock_dir(self):
        return os.path.join(self.log_dir(), "groups", GROUP, TOPIC)

    def lock_path(self, p):
        return os.path.join(self.lock_dir(), f"{p}.lock")

    def holders(self):
        """Partition -> pid of the process holding its lock, from /proc/locks (None if it cannot be read)."""
        by_id = {lock_id: p for p, lock_id in self.lock_ids.items()}
        try:
            with open("/proc/locks") as f:
                text = f.read()
        except OSError:
            return None
        held = {}
        for line in text.splitlines():
            fields = line.split()
            # "1: FLOCK  ADVISORY  WRITE 12345 fe:00:10011250 0 EOF"; waiters ("1: -> FLOCK …") hold nothing.
            if len(fields) < 6 or fields[1] != "FLOCK":
                continue
            p = by_id.get(fields[5])
            if p is not None:
                held[p] = int(fields[4])
        return held

    def start_chaos_worker(self, slot, now):
        """Starts a worker meant to take a random share of the free partitions: the script holds the others'
        locks until the worker has claimed its share (or exited, or 5 s passed)."""
        held = self.holders()
        free = [p for p in range(self.partitions) if held is not None and p not in held]
        waiting = sum(1 for s in self.slots if s.proc is None)
        fds = []
        mine = set(free)
        if len(free) > 1 and waiting > 1:
            share = round(self.rng.uniform(0.5, 1.5) * len(free) / waiting)
            mine = set(self.rng.sample(free, max(1, min(len(free) - 1, share))))
            for p in free:
                if p in mine:
                    continue
                fd = os.open(self.lock_path(p), os.O_WRONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fds.append(fd)
                except OSError:
                    os.close(fd)
        self.start(slot, follow=True)
        if fds:
            self.reservation = (slot, fds, mine, now + 5)

    def watch_reservation(self, now, held):
        if self.reservation is None:
            return
        slot, fds, mine, until = self.reservation
        claimed = slot.proc is not None and held is not None and all(held.get(p) == slot.proc.pid for p in mine)
        if claimed or slot.proc is None or slot.proc.poll() is not None or now >= until:
            self.release_reservation()

    def release_reservation(self):
        if self.reservation is not None:
            for fd in self.reservation[1]:
                os.close(fd)
            self.reservation = None

    @property
    def server(self):
        """The administration of this trial's database server (None on SQLite)."""
        return self.h.mysql if self.backend == "mysql" else self.h.server

    def worker_url(self):
        if self.backend == "sqlite":
            return f"sqlite://{os.path.join(self.dir, 'ledger.db')}"
        return self.server.url(self.db_name, via_port=self.proxy.port)

    def direct_url(self):
        if self.backend == "sqlite":
            return f"sqlite://{os.path.join(self.dir, 'ledger.db')}"
        return self.server.url(self.db_name)

    def idem(self, *args, timeout=120):
        done = subprocess.run(
            [self.h.idem, "--log", "error", *args], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(f"idem {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def setup(self):
        self.dir = tempfile.mkdtemp(prefix=f"idem-chaos-{os.getpid()}-{self.number}-")
        if self.backend != "sqlite":
            self.db_name = f"idem_chaos_{os.getpid()}_{self.number}"
            self.server.create(self.db_name)
            self.h.created.add((self.backend, self.db_name))
            target = (self.server.host, self.server.port)
            self.proxy = Proxy(*target, latency=self.latency_ms / 1000)
        self.idem("demo-prepare", "--database-url", self.direct_url())
        if self.transport == "kafka":
            self.h.ensure_broker()
            target = ["--kafka", self.h.broker.address, "--topic", self.topic]
        else:
            target = ["--log-dir", self.log_dir()]
        out = self.idem(
            "demo-produce",
            *target,
            "--events", str(self.events),
            "--partitions", str(self.partitions),
            "--seed", str(self.produce_seed),
            "--duplicates", str(self.duplicates),
        )  # fmt: skip
        self.plan = json.loads(out.strip().splitlines()[-1])
        if self.transport == "embedded":
            os.makedirs(self.lock_dir(), exist_ok=True)
            for p in range(self.partitions):
                fd = os.open(self.lock_path(p), os.O_WRONLY | os.O_CREAT, 0o644)
                st = os.fstat(fd)
                os.close(fd)
                self.lock_ids[p] = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        self.slots = [Slot(i, os.path.join(self.dir, f"worker-{i}.log")) for i in range(self.workers)]

    # ----- workers

    def start(self, slot, follow=True):
        slot.log = open(slot.log_path, "ab")
        slot.runs += 1
        final = "" if follow else " (final)"
        slot.log.write(f"--- run {slot.runs} at {time.time() - self.t0:.2f} s{final}\n".encode())
        slot.log.flush()
        slot.run_started_at = slot.log.tell()
        if self.transport == "kafka":
            source = ["--kafka", self.h.broker.address, "--topic", self.topic, "--group", self.group,
                      "--kafka-setting", f"session.timeout.ms={SESSION_TIMEOUT_MS}",
                      # also the rebalance timeout: how long a rebalance waits for a member that died in it
                      "--kafka-setting", "max.poll.interval.ms=15000"]  # fmt: skip
        else:
            source = ["--log-dir", self.log_dir()]
        cmd = [
            self.h.idem, "--log", "warn", "demo-worker",
            *source,
            "--database-url", self.worker_url(),
            "--batch-size", str(self.batch),
            "--connections", str(self.partitions + 1),
        ]  # fmt: skip
        if follow:
            cmd.append("--follow")
        if self.flaky_accounts:
            cmd += ["--max-attempts", "2", "--delayed-retries", ",".join(["1s"] * 60),
                    "--flaky-accounts", ",".join(map(str, self.flaky_accounts)),
                    "--flaky-until-ms", str(self.flaky_until_ms)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("IDEM_DATABASE_URL", "IDEM_LOG")}
        env["NO_COLOR"] = "1"
        self.read_reports()
        slot.assigned = slot.last_assigned = None
        with open(slot.out_path, "ab") as out:
            slot.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=slot.log, env=env, start_new_session=True
            )
        self.h.live.add(slot.proc)
        slot.killed = False
        slot.restart_at = None

    def read_reports(self):
        """Reads what the workers printed since the last call: commits (counted) and Kafka assignments."""
        for slot in self.slots:
            try:
                with open(slot.out_path, "rb") as f:
                    f.seek(slot.out_pos)
                    data = f.read()
            except OSError:
                continue
            slot.out_pos += len(data)
            *lines, slot.out_partial = (slot.out_partial + data).split(b"\n")
            for line in lines:
                try:
                    report = json.loads(line)
                except ValueError:
                    continue
                if "assigned" in report:
                    slot.assigned = set(report["assigned"])
                    if slot.assigned:
                        slot.last_assigned = slot.assigned
                elif "processed" in report:
                    self.applied += report.get("processed", 0) + report.get("dead_lettered", 0)

    def progress(self):
        """The share of the log consumed: committed offsets (embedded log) or commit reports (Kafka)."""
        if self.transport == "embedded":
            return self.committed() / max(1, self.plan["records"])
        return self.applied / max(1, self.plan["expected_entries"] + self.plan["poison"])

    def run_stderr(self, slot):
        """What the slot's last run wrote to stderr."""
        try:
            with open(slot.log_path, "rb") as f:
                f.seek(slot.run_started_at)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def reap(self, slot):
        """The exit status of the slot's process if it ended (and it is then forgotten), else None."""
        if slot.proc is None:
            return None
        code = slot.proc.poll()
        if code is None:
            return None
        self.h.live.discard(slot.proc)
        slot.proc = None
        slot.log.close()
        slot.log = None
        return code

    def note_exit(self, slot, code):
        """Classifies an exit the script did not cause."""
        text = self.run_stderr(slot)
        if code != 0 and HELD in text:
            self.held += 1
            return
        self.worker_exits += 1
        lines = [line for line in text.strip().splitlines() if line.strip()]
        reason = (lines[-1] if lines else f"exit status {code}")[:160]
        self.exit_reasons[reason] = self.exit_reasons.get(reason, 0) + 1

    def stop(self, slot, grace):
        """Stops a running worker: SIGTERM, then SIGKILL after `grace` seconds."""
        if slot.proc is None:
            return
        try:
            slot.proc.send_signal(signal.SIGTERM)
            slot.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            slot.proc.kill()
            slot.proc.wait()
        except ProcessLookupError:
            pass
        self.reap(slot)

    def kill_all(self):
        for slot in self.slots:
            if slot.proc is not None:
                try:
                    slot.proc.kill()
                    slot.proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
                self.reap(slot)

    # ----- faults

    def fault_kinds(self):
        kinds = {"postgres": PG_FAULTS, "mysql": MYSQL_FAULTS}.get(self.backend, SQLITE_FAULTS)
        return kinds + (("broker_restart",) if self.transport == "kafka" else ())

    def inject(self):
        kinds = self.fault_kinds()
        running = [s for s in self.slots if s.proc is not None]
        weights = {
            "kill": 3 if running else 0,
            "terminate_backends": 2,
            "refuse_connections": 1,
            "proxy_cut": 2,
            "broker_restart": 1 if self.broker_restart_at is None else 0,
        }
        choices = [k for k in kinds if weights[k] > 0]
        if not choices:
            return
        kind = self.rng.choices(choices, weights=[weights[k] for k in choices])[0]
        now = time.monotonic()
        if kind == "kill":
            slot = self.rng.choice(running)
            try:
                slot.proc.kill()
            except ProcessLookupError:
                pass
            slot.killed = True
            self.last_kill_at = now
        elif kind == "terminate_backends":
            self.server.terminate(self.db_name)
        elif kind == "refuse_connections":
            self.server.refuse(self.db_name)
            self.refused_until = max(self.refused_until or 0, now + self.rng.uniform(0.5, 3.0))
        elif kind == "proxy_cut":
            self.proxy.cut()
            self.cut_until = max(self.cut_until or 0, now + self.rng.uniform(0.5, 3.0))
        elif kind == "broker_restart":
            self.h.broker.proc.terminate()  # it stops in 2–4 s; started again once stopped and the pause is over
            self.broker_restart_at = now + self.rng.uniform(0.5, 3.0)
        self.faults[kind] += 1

    def heal(self, now, everything=False):
        if self.refused_until is not None and (everything or now >= self.refused_until):
            self.server.allow(self.db_name)
            self.refused_until = None
        if self.cut_until is not None and (everything or now >= self.cut_until):
            self.proxy.restore()
            self.cut_until = None
        if self.transport == "kafka" and self.broker_restart_at is None and not self.h.broker.running():
            self.h.broker.start()  # it exited on its own (at a start, say): started again, not counted as a fault
        if self.broker_restart_at is not None:
            broker = self.h.broker
            if everything:
                broker.stop()
            elif broker.proc.poll() is None and now >= self.broker_restart_at + 10:
                broker.proc.kill()  # did not stop on SIGTERM within 10 s
            if broker.proc is None or broker.proc.poll() is not None and now >= self.broker_restart_at:
                broker.start()
                self.broker_restart_at = None
                if everything:
                    broker.wait_ready()

    def committed(self):
        """Sum of the group's committed offsets in the embedded log (read-only look at its offset files)."""
        total = 0
        group_dir = os.path.join(self.log_dir(), "groups", GROUP, TOPIC)
        for p in range(self.partitions):
            try:
                with open(os.path.join(group_dir, f"{p}.offset")) as f:
                    total += int(f.read().strip() or 0)
            except (OSError, ValueError):
                pass
        return total

    # ----- the trial

    def run(self):
        self.t0 = time.time()
        deadline = time.monotonic() + self.h.args.trial_timeout
        try:
            self.setup()
            self.chaos(deadline)
            finished = self.final(deadline)
            self.check(finished)
        except Interrupted:
            self.result = {"ok": False, "interrupted": True, "mismatches": ["interrupted"]}
            raise
        except Exception as e:  # noqa: BLE001 -- a harness error fails the trial, with its reason
            self.result = {"ok": False, "mismatches": [f"harness error: {type(e).__name__}: {e}"]}
        finally:
            self.cleanup_processes()
        self.result["seconds"] = round(time.time() - self.t0, 2)
        return self.result

    def chaos(self, deadline):
        start = time.monotonic()
        self.flaky_until_ms = int((time.time() + self.flaky_for) * 1000)
        end = min(start + self.chaos_budget, deadline)
        for slot in self.slots:
            slot.restart_at = start + self.rng.uniform(0, 0.3)
        next_fault = start + self.rng.uniform(0.02, 0.5)
        points = list(self.fault_points)
        embedded = self.transport == "embedded"
        while True:
            now = time.monotonic()
            if now >= end:
                break
            self.read_reports()
            if now - start > 0.5 and self.progress() >= 1 and sum(self.faults.values()) > 0:
                break  # the log is consumed; the last worker run does the final check
            self.heal(now)
            if embedded:
                held = self.holders()
                if held is not None:
                    pids = {s.proc.pid for s in self.slots if s.proc is not None}
                    self.concurrent = max(self.concurrent, len(pids & set(held.values())))
                self.watch_reservation(now, held)
            else:
                owners = sum(1 for s in self.slots if s.proc is not None and s.assigned)
                self.concurrent = max(self.concurrent, owners)
            for slot in self.slots:
                code = self.reap(slot)
                if code is not None:
                    if not slot.killed:
                        self.note_exit(slot, code)
                    slot.restart_at = now + self.rng.uniform(0.05, 1.0)
                if (
                    slot.proc is None
                    and self.reservation is None
                    and slot.restart_at is not None
                    and now >= slot.restart_at
                ):
                    if embedded:
                        self.start_chaos_worker(slot, now)
                    else:
                        self.start(slot, follow=True)
            if now >= next_fault:
                self.inject()
                next_fault = now + self.rng.expovariate(1.0 / self.fault_mean)
            elif points and self.progress() >= points[0]:
                points.pop(0)
                self.inject()
            time.sleep(0.01)
        self.release_reservation()
        self.heal(time.monotonic(), everything=True)
        self.chaos_seconds = time.monotonic() - start
        self.read_reports()
        self.under_faults = min(1.0, self.progress())
        for slot in self.slots:
            code = self.reap(slot)
            if code is not None and not slot.killed:
                self.note_exit(slot, code)
            self.stop(slot, grace=5)

    def scalars(self, sql):
        """The integers of the one row `sql` returns, on the trial's database."""
        if self.backend == "postgres":
            return [int(v) for v in self.server.psql(sql, database=self.db_name).strip().split("|")]
        if self.backend == "mysql":
            return [int(v) for v in self.server.sql(sql, database=self.db_name).strip().split("\t")]
        db = sqlite3.connect(f"file:{os.path.join(self.dir, 'ledger.db')}?mode=ro", uri=True, timeout=30)
        try:
            return [int(v) for v in db.execute(sql).fetchone()]
        finally:
            db.close()

    def final_following(self, deadline):
        """--flaky: once the accounts clear, one worker follows the log until every credit is applied and nothing is
        parked (parked credits are released by a running consumer, not at the end of the log), then SIGTERM."""
        slot = self.slots[0]
        time.sleep(max(0.0, self.flaky_until_ms / 1000 - time.time()))
        want = self.plan["expected_entries"] + self.plan["poison_with_key"]
        sql = "SELECT (SELECT COUNT(*) FROM idem_demo_parked_messages), (SELECT COUNT(*) FROM idem_demo_processed_events)"
        while time.monotonic() < deadline:
            self.final_runs += 1
            self.start(slot, follow=True)
            # A worker signalled before it installed its handlers dies of the signal: give it time to start.
            time.sleep(1.0)
            while slot.proc.poll() is None and time.monotonic() < deadline:
                parked, markers = self.scalars(sql)
                if parked == 0 and markers >= want:
                    slot.proc.send_signal(signal.SIGTERM)
                    code = slot.proc.wait(timeout=30)
                    self.reap(slot)
                    if code == 0:
                        return True
                    self.note_exit(slot, code)
                    break
                time.sleep(0.2)
            code = self.reap(slot)
            if code is not None and code != 0:
                self.note_exit(slot, code)
                time.sleep(0.5)
        self.kill_all()
        return False

    def final(self, deadline):
        """One worker, no faults, until it exits 0 at the end of the log. False if the deadline passed."""
        if self.flaky_accounts:
            return self.final_following(deadline)
        slot = self.slots[0]
        if self.transport == "kafka" and self.last_kill_at is not None:
            # A killed member stays in the group until its session expires; a worker joining before that would
            # get part of the partitions and stop at their end.
            time.sleep(max(0.0, min(deadline, self.last_kill_at + SESSION_TIMEOUT_MS / 1000 + 3) - time.monotonic()))
        while time.monotonic() < deadline:
            self.final_runs += 1
            self.start(slot, follow=False)
            started = time.monotonic()
            while slot.proc.poll() is None:
                now = time.monotonic()
                if now >= deadline:
                    self.kill_all()
                    return False
                if self.transport == "kafka" and now - started > 20:
                    self.read_reports()
                    if slot.last_assigned is None:
                        # nisshi 0.7.0-pre.2 can leave a group in a rebalance that never completes (every
                        # SyncGroup answered REBALANCE_IN_PROGRESS) after members died in one; a broker
                        # restart clears it. Counted apart: this is the broker, not idem.
                        self.stuck_restarts += 1
                        self.h.broker.stop()
                        self.h.broker.start()
                        self.h.broker.wait_ready()
                        started = time.monotonic()
                time.sleep(0.02)
            code = self.reap(slot)
            self.read_reports()
            if code == 0 and self.transport == "kafka" and slot.last_assigned != set(range(self.partitions)):
                # It stopped at the end of only the partitions it was given: not the end of the log.
                self.partial_finals += 1
                time.sleep(1)
                continue
            if code == 0:
                return True
            self.note_exit(slot, code)
            time.sleep(0.5)
        return False

    def check(self, finished):
        p = self.plan
        res = {"ok": False, "mismatches": [], "lost": 0, "doubled": 0}
        self.result = res
        if not finished:
            res["mismatches"].append(
                f"no fault-free worker run finished the log within {self.h.args.trial_timeout:g} s"
            )
            res["stderr_tail"] = self.stderr_tail()
            return
        integer = "SIGNED" if self.backend == "mysql" else "BIGINT"
        sql = (
            f"SELECT (SELECT CAST(COALESCE(SUM(balance), 0) AS {integer}) FROM idem_demo_accounts),"
            " (SELECT COUNT(*) FROM idem_demo_ledger),"
            " (SELECT COUNT(DISTINCT event_id) FROM idem_demo_ledger),"
            " (SELECT COUNT(*) FROM idem_demo_processed_events),"
            " (SELECT COUNT(*) FROM idem_demo_dead_letters)"
        )
        if self.backend == "postgres":
            out = self.server.psql(sql, database=self.db_name)
            values = [int(v) for v in out.strip().split("|")]
        elif self.backend == "mysql":
            out = self.server.sql(sql, database=self.db_name)
            values = [int(v) for v in out.strip().split("\t")]
        else:
            db = sqlite3.connect(f"file:{os.path.join(self.dir, 'ledger.db')}?mode=ro", uri=True, timeout=30)
            try:
                values = [int(v) for v in db.execute(sql).fetchone()]
            finally:
                db.close()
        total, entries, distinct, markers, dead = values
        res.update(total=total, entries=entries, distinct=distinct, markers=markers, dead_letters=dead)
        res["doubled"] = entries - distinct
        res["lost"] = max(0, p["expected_entries"] - distinct)
        mism = res["mismatches"]
        if total != p["expected_total_cents"]:
            mism.append(f"ledger total {total} != expected {p['expected_total_cents']}")
        if entries != p["expected_entries"]:
            mism.append(f"{entries} ledger rows != expected {p['expected_entries']}")
        if res["doubled"]:
            mism.append(f"{res['doubled']} events applied more than once")
        if res["lost"]:
            mism.append(f"{res['lost']} events lost")
        if distinct > p["expected_entries"]:
            mism.append(f"{distinct} distinct ledger events > expected {p['expected_entries']}")
        want_markers = p["expected_entries"] + p["poison_with_key"]
        if markers != want_markers:
            mism.append(f"{markers} markers != expected {want_markers}")
        if dead != p["poison"]:
            mism.append(f"{dead} dead letters != expected {p['poison']}")
        if self.transport == "embedded":
            acked = self.committed()
            if acked != p["records"]:
                mism.append(f"committed offsets {acked} != log records {p['records']}")
        if self.flaky_accounts:
            # Production order is the payment number (pay-000000042); application order is the row's insertion
            # (SQLite's rowid) or its transaction (PostgreSQL's xmin: credits of one account commit one after the
            # other). MySQL keeps no such order: not checked there.
            order = {
                "sqlite": "a.rowid < b.rowid",
                "postgres": "a.xmin::text::bigint < b.xmin::text::bigint",
            }.get(self.backend)
            left = "(SELECT COUNT(*) FROM idem_demo_parked_messages)"
            if order:
                out_of_order = (
                    "(SELECT COUNT(*) FROM idem_demo_ledger a JOIN idem_demo_ledger b"
                    f" ON a.account = b.account AND {order} AND a.event_id > b.event_id)"
                )
                parked_left, res["out_of_order"] = self.scalars(f"SELECT {left}, {out_of_order}")
            else:
                (parked_left,) = self.scalars(f"SELECT {left}")
            res["parked_left"] = parked_left
            if parked_left:
                mism.append(f"{parked_left} message(s) still parked")
            if res.get("out_of_order"):
                mism.append(f"{res['out_of_order']} pair(s) of an account's credits applied out of production order")
        res["ok"] = not mism

    def stderr_tail(self, lines=8):
        tails = []
        for slot in self.slots:
            try:
                with open(slot.log_path, "rb") as f:
                    text = f.read().decode(errors="replace").strip().splitlines()
            except OSError:
                continue
            if text:
                tails.append(f"worker {slot.index}:\n    " + "\n    ".join(text[-lines:]))
        return "\n  ".join(tails)

    def cleanup_processes(self):
        self.kill_all()
        self.release_reservation()
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        if self.db_name is not None and self.refused_until is not None:
            try:
                self.server.allow(self.db_name)
            except Exception:  # noqa: BLE001
                pass
            self.refused_until = None

    def dispose(self, keep):
        """Drops the database and the directory, unless `keep`."""
        if keep:
            if self.db_name:
                try:
                    self.server.allow(self.db_name)
                except Exception:  # noqa: BLE001
                    pass
            return
        if self.db_name:
            try:
                self.server.drop(self.db_name)
                self.h.created.discard((self.backend, self.db_name))
            except Exception as e:  # noqa: BLE001
                print(f"  warning: could not drop database {self.db_name}: {e}", file=sys.stderr)
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def faults_text(self):
        return " ".join(f"{k}={self.faults[k]}" for k in self.fault_kinds())

    def label(self):
        return self.backend if self.transport == "embedded" else f"{self.backend}+kafka"


# --------------------------------------------------------------------------------------------------------------


class Harness:
    def __init__(self, args):
        self.args = args
        self.server = Server(args.postgres) if "postgres" in args.databases else None
        self.mysql = MysqlServer(args.mysql) if "mysql" in args.databases else None
        self.live = set()
        self.created = set()
        # The binary is copied, so that a rebuild during a long run does not pull it from under the workers.
        self.work_dir = tempfile.mkdtemp(prefix=f"idem-chaos-{os.getpid()}-work-")
        self.idem = os.path.join(self.work_dir, "idem")
        shutil.copy2(args.idem, self.idem)
        self.broker = None
        self.out = sys.stderr if args.json else sys.stdout

    def ensure_broker(self):
        """Starts the Kafka broker (once, on a free port, data under the work directory) if it is not running."""
        if self.broker is None:
            self.broker = Broker(self.args.kafka_bin, os.path.join(self.work_dir, "kafka"))
        if not self.broker.running():
            self.broker.start()
            self.broker.wait_ready()

    def say(self, text):
        print(text, file=self.out, flush=True)

    def reproduce(self, k):
        a = self.args
        parts = [
            "scripts/chaos.py", "--idem", a.idem, "--seed", str(a.seed), "--only-trial", str(k),
            "--databases", ",".join(a.databases), "--max-events", str(a.max_events),
        ]  # fmt: skip
        if self.server:
            parts += ["--postgres", a.postgres]
        if self.mysql:
            parts += ["--mysql", a.mysql]
        if (a.chaos_min, a.chaos_max) != (1.5, 5.0):
            parts += ["--chaos-seconds", f"{a.chaos_min:g},{a.chaos_max:g}"]
        if a.trial_timeout != 120:
            parts += ["--trial-timeout", f"{a.trial_timeout:g}"]
        if a.kafka_bin:
            parts += ["--kafka-bin", a.kafka_bin, "--transports", ",".join(a.transports)]
        return " ".join(parts)

    def main(self):
        a = self.args
        started = time.time()
        trials = [a.only_trial] if a.only_trial else list(range(1, a.trials + 1))
        self.say(
            f"chaos: seed {a.seed}, {len(trials)} trial(s), databases {','.join(a.databases)}, "
            f"transports {','.join(a.transports)}, events up to {a.max_events}, {a.trial_timeout:g} s per trial at most"
        )
        totals = {k: 0 for k in FAULT_KINDS}
        width = 14 if "kafka" in a.transports else 8
        summary = {
            "seed": a.seed,
            "trials": 0,
            "passed": 0,
            "failed": 0,
            "failed_trials": [],
            "faults_total": 0,
            "faults": totals,
            "worker_exits": 0,
            "held_restarts": 0,
            "broker_stuck_restarts": 0,
            "lost": 0,
            "doubled": 0,
            "trial_results": [],
            "interrupted": False,
        }
        try:
            for k in trials:
                trial = Trial(self, k, random.Random(f"idem-chaos:{a.seed}:{k}"))
                try:
                    res = trial.run()
                except Interrupted:
                    self.say(f"trial {k:>4}  {trial.label():<{width}} interrupted; its database and directory removed")
                    trial.dispose(keep=False)
                    raise
                summary["trials"] += 1
                for kind, n in trial.faults.items():
                    totals[kind] += n
                summary["worker_exits"] += trial.worker_exits
                summary["held_restarts"] += trial.held
                summary["broker_stuck_restarts"] += trial.stuck_restarts
                summary["lost"] += res.get("lost", 0)
                summary["doubled"] += res.get("doubled", 0)
                record = {
                    "trial": k,
                    "backend": trial.backend,
                    "transport": trial.transport,
                    "events": trial.events,
                    "records": (trial.plan or {}).get("records"),
                    "partitions": trial.partitions,
                    "batch_size": trial.batch,
                    "workers": trial.workers,
                    "concurrent_workers": trial.concurrent,
                    "fault_phase_seconds": round(trial.chaos_seconds, 2),
                    "consumed_under_faults": round(trial.under_faults, 3),
                    "duplicates_pct": trial.duplicates,
                    "proxy_latency_ms": trial.latency_ms if trial.backend == "postgres" else None,
                    "faults": {k2: trial.faults[k2] for k2 in FAULT_KINDS},
                    "worker_exits": trial.worker_exits,
                    "held_restarts": trial.held,
                    "final_runs": trial.final_runs,
                    "broker_stuck_restarts": trial.stuck_restarts,
                    **{key: res[key] for key in ("ok", "seconds", "lost", "doubled", "mismatches") if key in res},
                }
                line = (
                    f"trial {k:>4}  {trial.label():<{width}} events {trial.events:>5}  partitions {trial.partitions}  "
                    f"batch {trial.batch:>3}  workers {trial.workers} ({trial.concurrent} at once)  "
                    f"faults {trial.faults_text()}  "
                    f"exits {trial.worker_exits} held {trial.held}  under faults {trial.under_faults:4.0%}  "
                    + (f"stuck group {trial.stuck_restarts}  " if trial.stuck_restarts else "")
                    + f"{res['seconds']:5.1f} s  "
                )
                if res["ok"]:
                    summary["passed"] += 1
                    self.say(line + "OK")
                    trial.dispose(keep=a.keep)
                else:
                    summary["failed"] += 1
                    summary["failed_trials"].append(k)
                    self.say(line + "FAIL: " + "; ".join(res["mismatches"]))
                    if trial.transport == "kafka" and self.broker is not None and trial.dir:
                        shutil.copy(self.broker.log_path, os.path.join(trial.dir, "broker.log"))
                    kept = [f"directory {trial.dir}"] if trial.dir else []
                    if trial.db_name:
                        kept.insert(0, f"database {trial.db_name}")
                    record["kept"] = kept
                    if kept:
                        self.say("  kept: " + ", ".join(kept))
                    if trial.exit_reasons:
                        self.say("  worker exits: " + "; ".join(f"{n}× {r}" for r, n in trial.exit_reasons.items()))
                    tail = res.get("stderr_tail") or trial.stderr_tail()
                    if tail:
                        self.say("  stderr tail:\n  " + tail)
                    self.say(f"  reproduce: {self.reproduce(k)}")
                    trial.dispose(keep=True)
                if a.verbose and trial.exit_reasons and res["ok"]:
                    self.say("  worker exits: " + "; ".join(f"{n}× {r}" for r, n in trial.exit_reasons.items()))
                summary["trial_results"].append(record)
        except Interrupted as e:
            summary["interrupted"] = True
            self.say(f"interrupted ({e}): workers killed, connections re-allowed")
        finally:
            self.cleanup()
        summary["faults_total"] = sum(totals.values())
        summary["elapsed_seconds"] = round(time.time() - started, 1)
        summary["ok"] = summary["failed"] == 0 and not summary["interrupted"] and summary["trials"] > 0
        self.print_summary(summary)
        return 0 if summary["ok"] else (130 if summary["interrupted"] else 1)

    def cleanup(self):
        for proc in list(self.live):
            try:
                proc.kill()
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.live.clear()
        if self.broker is not None:
            self.broker.close()
            self.broker = None
        shutil.rmtree(self.work_dir, ignore_errors=True)
        servers = {"postgres": self.server, "mysql": self.mysql}
        for backend, name in list(self.created):
            if servers.get(backend):
                try:
                    servers[backend].allow(name)
                except Exception:  # noqa: BLE001
                    pass

    def print_summary(self, s):
        shown = FAULT_KINDS if "kafka" in self.args.transports else PG_FAULTS
        kinds = ", ".join(f"{k} {s['faults'][k]}" for k in shown)
        self.say("")
        self.say(f"chaos summary (seed {s['seed']})")
        self.say(f"  trials           {s['trials']:>8}  ({s['passed']} passed)")
        self.say(f"  faults injected  {s['faults_total']:>8}  ({kinds})")
        self.say(
            f"  worker exits     {s['worker_exits']:>8}  (non-zero exits after a fault, restarted; "
            f"{s['held_restarts']} more found every partition held)"
        )
        if "kafka" in self.args.transports:
            self.say(
                f"  stuck groups     {s['broker_stuck_restarts']:>8}  (broker restarted because a group's rebalance "
                "never completed; a broker limit)"
            )
        self.say(f"  lost             {s['lost']:>8}")
        self.say(f"  doubled          {s['doubled']:>8}")
        failed = ", ".join(str(k) for k in s["failed_trials"]) or "none"
        self.say(f"  failed trials    {s['failed']:>8}  ({failed})")
        self.say(f"  elapsed          {s['elapsed_seconds']:>8.1f} s")
        if s["ok"]:
            self.say("OK: every event applied exactly once in every trial")
        elif s["interrupted"]:
            self.say("INTERRUPTED")
        else:
            self.say("FAIL")
        if self.args.json:
            print(json.dumps(s), flush=True)


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Chaos harness for idem: the payments demo under worker kills, backend terminations, "
        "refused connections and network cuts; checks every event is applied exactly once.",
    )
    p.add_argument("--idem", required=True, help="the idem binary (e.g. target/debug/idem)")
    p.add_argument("--trials", type=int, default=6, help="number of trials (default 6)")
    p.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: random, printed)")
    p.add_argument("--only-trial", type=int, default=None, metavar="K", help="run only trial K of --seed")
    p.add_argument("--databases", default="postgres,sqlite", help="backends to draw from (default postgres,sqlite)")
    p.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432", help="PostgreSQL server URL")
    p.add_argument("--mysql", default="mysql://root@127.0.0.1:3306", help="MySQL or MariaDB server URL")
    p.add_argument("--max-events", type=int, default=2000, help="events per trial: 100 to this (default 2000)")
    p.add_argument(
        "--chaos-seconds",
        default="1.5,5",
        metavar="MIN,MAX",
        help="how long faults are injected per trial, drawn between MIN and MAX seconds; the fault phase also "
        "ends once the log is consumed (default 1.5,5)",
    )
    p.add_argument("--trial-timeout", type=float, default=120, help="seconds before a trial fails (default 120)")
    p.add_argument("--keep", action="store_true", help="keep the databases and directories of passing trials too")
    p.add_argument("--verbose", action="store_true", help="print why workers exited, for passing trials too")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument(
        "--flaky",
        action="store_true",
        help="workers with delayed retries, some credits of random accounts failing for a random while; checks "
        "each account's order too",
    )
    p.add_argument(
        "--kafka-bin",
        metavar="PATH",
        help="a Kafka-compatible broker (nisshi) to start on a free port: trials then also run over Kafka, "
        "with broker restarts as a fault",
    )
    p.add_argument(
        "--transports",
        default=None,
        help="where the events travel, drawn per trial: embedded and/or kafka (default: embedded, plus kafka "
        "with --kafka-bin)",
    )
    a = p.parse_args(argv)
    a.databases = [d.strip() for d in a.databases.split(",") if d.strip()]
    if a.transports is None:
        a.transports = "embedded,kafka" if a.kafka_bin else "embedded"
    a.transports = [t.strip() for t in a.transports.split(",") if t.strip()]
    for t in a.transports:
        if t not in ("embedded", "kafka"):
            p.error(f"--transports: unknown transport {t!r}; use embedded and/or kafka")
    if not a.transports:
        p.error("--transports: give at least one")
    if "kafka" in a.transports:
        if not a.kafka_bin:
            p.error("--transports kafka needs --kafka-bin")
        a.kafka_bin = os.path.abspath(a.kafka_bin)
        if not os.access(a.kafka_bin, os.X_OK):
            p.error(f"--kafka-bin {a.kafka_bin} is not an executable")
    for d in a.databases:
        if d not in ("postgres", "sqlite", "mysql"):
            p.error(f"--databases: unknown backend {d!r}; use postgres, sqlite and/or mysql")
    if not a.databases:
        p.error("--databases: give at least one backend")
    if a.max_events < 1:
        p.error("--max-events must be at least 1")
    try:
        a.chaos_min, a.chaos_max = (float(x) for x in a.chaos_seconds.split(","))
    except ValueError:
        p.error("--chaos-seconds: give MIN,MAX in seconds")
    if not 0 < a.chaos_min <= a.chaos_max:
        p.error("--chaos-seconds: need 0 < MIN <= MAX")
    if a.trials < 1:
        p.error("--trials must be at least 1")
    if a.only_trial is not None and a.only_trial < 1:
        p.error("--only-trial must be at least 1")
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 2**31)
    a.idem = os.path.abspath(a.idem) if os.sep in a.idem else (shutil.which(a.idem) or a.idem)
    if not os.access(a.idem, os.X_OK):
        p.error(f"--idem {a.idem} is not an executable")
    if "postgres" in a.databases and not shutil.which("psql"):
        p.error("the postgres backend needs `psql` on PATH")
    if "mysql" in a.databases and not (shutil.which("mariadb") or shutil.which("mysql")):
        p.error("the mysql backend needs the `mariadb` (or `mysql`) client on PATH")
    return a


def main(argv):
    args = parse_args(argv)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    harness = Harness(args)
    try:
        return harness.main()
    finally:
        harness.cleanup()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
