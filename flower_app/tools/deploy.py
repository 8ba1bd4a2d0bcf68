"""A real Flower deployment on this machine: one ``flower-superlink``, N ``flower-supernode``
processes on loopback, an experiment submitted with ``flwr run``, then a clean shutdown of
exactly the processes it started and theirs (each in its own process group, so that a signal to
``flrep``'s group reaches ``flrep`` alone). The shutdown also happens when ``flrep`` gets SIGTERM,
SIGINT or SIGHUP (:class:`flower_app.run.stop_signals.Stopped`), or when its parent dies; and on Linux
every started process gets SIGTERM if ``flrep`` itself is killed. ``<work>/processes.json`` lists
the PIDs of what it started.

Insecure by default; with the keys of :func:`flower_app.tools.certs.make_deployment_keys` the
SuperLink serves TLS with SuperNode authentication and every SuperNode's public key is
registered before it starts. Logs go to ``<work>/<process>.log``.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from flower_app.tools.certs import DeploymentKeys
from flower_app.tools.superlink import signal_and_wait
from flower_app.run.config import PROJECT_DIR as APP_DIR
from flower_app.run.console import TAG, Progress, say, verbose_chosen
from flower_app.run.run_dir import write_atomic
from flower_app.run.stop_signals import stopping_on_signals
from strategies.state_store import SIMULATION_ENV
from task.errors import ConfigError

CONNECTION = "flrep-local"
ENV = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}


def tool(name: str) -> str:
    """The Flower command ``name`` of this Python environment (else the one on PATH)."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise ConfigError(f"{name} not found: install the app (pip install -e .) in this environment")
    return found


#: The kernel's range of ports for outgoing connections (Linux's default where it cannot be read).
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on, below the kernel's ephemeral range when
    there is room: a port of that range may be taken by an outgoing connection (a SuperNode's, a
    ClientApp's) between this check and the moment the server binds it."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(10000, low), min(50, max(low - 10000, 0))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the range: any port the kernel gives
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(address: str, seconds: float, what: str, process: subprocess.Popen | None = None,
                  log: Path | None = None) -> None:
    """Wait until ``host:port`` accepts connections; a clear error when it never does."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}{_log_tail(log)}")
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError:
            time.sleep(0.2)
    raise ConfigError(f"{what} at {address} is unreachable after {seconds:g} s{_log_tail(log)}")


#: Seconds between two reads of a followed log.
FOLLOW_EVERY_S = 0.5


def follow(log: Path, process: subprocess.Popen, timeout_s: float | None = None) -> None:
    """Until ``process`` ends: show the lines of ``log`` it writes that a run shows on the console
    (flrep's own, warnings and errors; every line with ``--verbose``). Raises TimeoutExpired
    after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    verbose = verbose_chosen()
    with log.open(errors="replace") as fh:
        while True:
            ended = process.poll() is not None
            for line in fh.readlines():
                if verbose or TAG in line or "WARNING" in line or "ERROR" in line:
                    print(line.rstrip("\n"), file=sys.stderr, flush=True)
            if ended:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(process.args), timeout_s)
            time.sleep(FOLLOW_EVERY_S)


def _log_tail(log: Path | None, lines: int = 8) -> str:
    if log is None or not log.is_file():
        return ""
    return "; its log ends:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def check_files(**paths: Path | None) -> None:
    """Every given file must exist (named by its option in the error)."""
    for option, path in paths.items():
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{option.replace('_', '-')}: {path} does not exist")


def _watch_parent(parent: int, stop: threading.Event) -> None:
    """SIGTERM to this process when its parent dies (it is re-parented), so the deployment stops."""
    while not stop.wait(1.0):
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
            return


try:  # loaded here, not in the forked child: importing there may deadlock
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    """In a started child (Linux): get SIGTERM when the process that started it dies, even by SIGKILL."""
    if _PRCTL is not None:
        _PRCTL(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class LocalDeployment:
    """SuperLink + SuperNodes on loopback; use as a context manager (stops what it started)."""

    def __init__(self, work: Path, keys: DeploymentKeys | None = None) -> None:
        self.work = work.resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.keys = keys
        if keys is not None:
            check_files(ssl_ca_certfile=keys.ca, ssl_certfile=keys.server_cert, ssl_keyfile=keys.server_key)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.node_ports: dict[str, int] = {}  # SuperNode name -> port of its Runtime API
        self.home = self.work / "flwr-home"
        self._write_connection()

    def __enter__(self) -> LocalDeployment:
        self._signals = stopping_on_signals()  # a stop signal raises Stopped here, and __exit__ stops the rest
        self._signals.__enter__()
        self._watching = threading.Event()
        if threading.current_thread() is threading.main_thread():
            threading.Thread(target=_watch_parent, args=(os.getppid(), self._watching), daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            self._watching.set()
            self._signals.__exit__(None, None, None)

    def _env(self) -> dict[str, str]:
        """Flower's processes start more of its commands: they must find this environment's."""
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        env = {**os.environ, **ENV, "FLWR_HOME": str(self.home), "PATH": path}
        env.pop(SIMULATION_ENV, None)  # these are real nodes: each keeps to its own disk
        return env

    def _write_connection(self) -> None:
        """The ``flwr`` CLI's connection to this SuperLink (in a private FLWR_HOME)."""
        self.home.mkdir(parents=True, exist_ok=True)
        security = (f'root-certificates = "{self.keys.ca.resolve()}"' if self.keys is not None else "insecure = true")
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{self.address}"\n{security}\n')

    def _start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        with log.open("w") as fh:
            process = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=self._env(), cwd=APP_DIR,
                                       start_new_session=True, preexec_fn=_die_with_parent)
        self.processes[name] = process
        self._write_pids()
        return process

    def _write_pids(self) -> None:
        """``processes.json``: name -> PID (each the leader of its own process group), replaced
        atomically so that a reader never sees it half written."""
        pids = json.dumps({n: p.pid for n, p in self.processes.items()})
        write_atomic(self.work / "processes.json", lambda tmp: tmp.write_text(pids))

    def start_superlink(self, wait_s: float = 60.0) -> None:
        """Start the SuperLink and wait until its port answers."""
        args = [tool("flower-superlink"), "--port", str(self.port), "--disable-runtime-dependency-installation"]
        if self.keys is None:
            args.append("--insecure")
        else:
            args += ["--ssl-ca-certfile", str(self.keys.ca), "--ssl-certfile", str(self.keys.server_cert),
                     "--ssl-keyfile", str(self.keys.server_key), "--enable-supernode-auth"]
        process = self._start("superlink", args)
        wait_for_port(self.address, wait_s, "the SuperLink", process, self.work / "superlink.log")

    def register(self, public_key: Path) -> int:
        """Register a SuperNode's public key with the SuperLink; its node id."""
        out = subprocess.run([tool("flwr"), "supernode", "register", str(public_key), CONNECTION, "--format", "json"],
                             capture_output=True, text=True, env=self._env(), cwd=APP_DIR, timeout=60)
        try:
            answer = json.loads(out.stdout)
        except json.JSONDecodeError:
            answer = {"success": False, "error-message": out.stdout + out.stderr}
        if not answer.get("success"):
            raise RuntimeError(f"registering {public_key} failed: {answer.get('error-message')}")
        return int(answer["node-id"])

    def start_supernode(self, index: int, node_config: dict[str, object], private_key: Path | None = None,
                        name: str | None = None) -> subprocess.Popen:
        """Start SuperNode ``index`` with ``node_config`` (authenticated with ``private_key`` under TLS)."""
        name = name or f"supernode-{index}"
        self.node_ports[name] = free_port()
        args = [tool("flower-supernode"), "--superlink", self.address, "--port", str(self.node_ports[name]),
                "--node-config", node_config_text(node_config)]
        if self.keys is None:
            args.append("--insecure")
        else:
            args += ["--root-certificates", str(self.keys.ca)]
            if private_key is not None:
                check_files(auth_supernode_private_key=private_key)
                args += ["--auth-supernode-private-key", str(private_key)]
        return self._start(name, args)

    def wait_for_supernodes(self, wait_s: float = 60.0) -> None:
        """Wait until every running SuperNode serves its Runtime API, saying how many are up; one
        that exited (a port taken, a bad flag) is named with its log."""
        running = [(name, port) for name, port in self.node_ports.items() if name in self.processes]
        progress = Progress("SuperNodes up", len(running), unit="node")
        try:
            for done, (name, port) in enumerate(running, 1):
                wait_for_port(f"127.0.0.1:{port}", wait_s, name, self.processes[name], self.work / f"{name}.log")
                progress.advance_to(done)
        finally:
            progress.close()

    def run(self, experiment: str, overrides: list[str], timeout_s: float | None = None) -> None:
        """Once the SuperNodes are up, submit the experiment to the SuperLink and stream its logs
        until it ends."""
        self.wait_for_supernodes()
        config = f"experiment={json.dumps(experiment)} overrides={json.dumps(shlex.join(overrides))}"
        args = [tool("flwr"), "run", str(APP_DIR), CONNECTION, "--run-config", config, "--stream"]
        say(f"SuperLink and {len(self.node_ports)} SuperNodes up; run submitted (its log: {self.work / 'run.log'})")
        process = self._start("run", args)  # logs in run.log; stopped with the rest if flrep is stopped
        try:
            follow(self.work / "run.log", process, timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(process, signal.SIGKILL)
            raise

    def stop(self, name: str | None = None) -> None:
        """Stop one process (by name) or all of them: the SuperNodes and the run together, then the
        SuperLink; SIGTERM, a grace of :data:`STOP_GRACE_S` shared by those stopped together, then SIGKILL
        (a loaded machine stops four processes in 20-40 s, not one after another)."""
        names = [name] if name is not None else list(self.processes)
        for superlink_phase in (False, True):
            _stop_together([self.processes.pop(k) for k in names if (k == "superlink") == superlink_phase])


#: Seconds the processes stopped together get to exit after SIGTERM, and again to be reaped after SIGKILL.
STOP_GRACE_S = 10.0


def _stop_together(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group and to every process it started (Flower's SuperLink starts its
    SuperExec, and the SuperExec its ServerApp, each in a session of their own, out of the group's
    reach), one shared grace, SIGKILL to every group and to those still alive, one more shared grace
    to reap them."""
    started = _descendants(processes)
    for process in processes:
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    _, alive = signal_and_wait(started, "terminate", STOP_GRACE_S)
    _wait_all(processes, deadline - time.monotonic())
    for process in processes:
        _signal_group(process, signal.SIGKILL)
    signal_and_wait(alive, "kill", STOP_GRACE_S)
    _wait_all(processes, STOP_GRACE_S)  # one not reaped by then has had SIGKILL: go on


def _descendants(processes: list[subprocess.Popen]) -> list[psutil.Process]:
    """Every live process that ``processes`` started, however deep (read before any is signalled: a
    process whose parent died is re-parented and no longer found)."""
    found = []
    for process in processes:
        try:
            found += psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_all(processes: list[subprocess.Popen], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def node_config_text(values: dict[str, object]) -> str:
    """``--node-config`` text: strings quoted, numbers bare."""
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in values.items())
