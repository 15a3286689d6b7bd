"""The gateway served from a process of its own, for runs whose agents run in the run's process.

In-process agents hold the run's GIL for most of a collection (their own Python: building clients, parsing,
tools); a gateway served from a thread of that process waits for it on every call, and takes it from them in turn
(benchmarks/README.md, collect_throughput.py). Here it serves from a child
process, on a core and a GIL of its own: the child relays the calls and makes their records (`Gateway`, the same
code as in a thread); this process opens and closes rollouts, routes policies and writes the records to its store,
so the store keeps one writing process and every record is written, exported and counted where it was before.

`IsolatedGateway` has the interface the in-process runtime, its session and `lightning check` use of `Gateway`.
The socket is bound here, before the child starts (its URL goes into the agent's environment at once), and handed
to the child, which alone accepts on it. The two talk over socket pairs: one carries this process's commands, each
answered under its number, and the child's batches of records and its log records, in the order it sent them; the
other the rollouts opened and closed, unanswered (`PairedRollouts` says why the first call finds its rollout open).
The child stops when its end of the pair closes, so a run killed with -9 leaves no gateway behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning_sdk.compat import connection
from lightning_sdk.constraint import ServerGrammar
from lightning_sdk.errors import RunError
from lightning_sdk.gateway.capture import OpenRollouts, RecordOutlet, Rollout
from lightning_sdk.gateway.listen import bind, url_of
from lightning_sdk.tracing.records import CallSink, SpanRecord

log = logging.getLogger("lightning_sdk")

START_S = 60.0  # the child's imports and its server's start, on a loaded machine
ANSWER_S = 30.0  # any other command


@dataclass
class Replicas:
    """The backends' counts as the child last reported them (session.say_replicas)."""

    urls: list[str] = field(default_factory=list)
    served: list[int] = field(default_factory=list)
    out: dict[int, float] = field(default_factory=dict)


class IsolatedGateway:
    """See the module docstring. `IsolatedGateway(...)` binds and starts the child; `start` serves; `stop` ends."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, api_key: str, model_names: Sequence[str] = (),
                 store_text: bool = True):
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.api_key, self.model_names = api_key, tuple(model_names)
        sock = bind(host, port)
        self.url = url_of(sock)
        ours, theirs = socket.socketpair()
        ours_r, theirs_r = socket.socketpair()  # rollouts opened and closed: no answers, nothing else
        try:
            # The key goes over the pair, never on the command line (which any user of the machine can read).
            # The child runs this process's lightning_sdk, wherever it was imported from.
            root = str(Path(__file__).resolve().parents[2])
            path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
            fds = (sock.fileno(), theirs.fileno(), theirs_r.fileno())
            self._proc = subprocess.Popen([sys.executable, "-m", "lightning_sdk.gateway.isolated", *map(str, fds)],
                                          pass_fds=fds, stdin=subprocess.DEVNULL,
                                          env={**os.environ, "PYTHONPATH": path})
        finally:
            sock.close()  # the child's alone: if it dies, callers are refused at once, not left in the backlog
            theirs.close()
            theirs_r.close()
        self._conn = connection(ours.detach())
        self._lock = threading.Lock()  # the pair's sending end, and the commands waiting for their answers
        self._asked = 0
        self._waiting: dict[int, Callable[[str, Any], None]] = {}
        self._gone: str | None = None
        self.capture = Records(self)
        self.rollouts = Rollouts(self, connection(ours_r.detach()))
        self._policy: str | None = None
        self._by_component: dict[str, str] = {}
        self._canary: tuple[str, float] | None = None
        self._started = False
        self._reader = threading.Thread(target=self._read, name="lightning-gateway-records", daemon=True)
        self._reader.start()
        self.call("settings", {"api_key": api_key, "model_names": self.model_names, "store_text": store_text},
                  timeout=START_S)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def pid(self) -> int:
        """The serving process's id."""
        return self._proc.pid

    def rollout_base_url(self, key: str) -> str:
        return f"{self.url}/rollouts/{key}/v1"

    def start(self, backends: Sequence[str], *, backend_key: str | None, grammar: ServerGrammar | None = None) -> None:
        """Serve, forwarding to `backends` (roots: http://host:port) with `backend_key` (`grammar`: Gateway.start's)."""
        self.call("start", (list(backends), backend_key, grammar.to_dict() if grammar else None), timeout=START_S)
        self._started = True

    def is_alive(self) -> bool:
        return self._gone is None and self._proc.poll() is None

    def stop(self) -> None:
        if self.why_stopped() is not None:
            self._proc.kill()  # it would answer nothing: no flush to wait for
        if self._proc.poll() is None:
            try:
                self.call("stop", None, timeout=15)
            except RunError:
                pass  # gone already, or stuck: ended below
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self._reader.join(timeout=5)

    # ------------------------------------------------------------------------------------------ routing

    @property
    def policy(self) -> str | None:
        return self._policy

    @policy.setter
    def policy(self, name: str | None) -> None:
        self._policy = name
        self.call("policy", name)

    @property
    def by_component(self) -> dict[str, str]:
        return dict(self._by_component)

    @property
    def canary(self) -> tuple[str, float] | None:
        return self._canary

    @canary.setter
    def canary(self, value: tuple[str, float] | None) -> None:
        self._canary = value
        self.call("canary", value)

    def route(self, policy: str | None, by_component: dict[str, str]) -> None:
        """As `Gateway.route`."""
        self._policy, self._by_component = policy, dict(by_component)
        self.call("route", (policy, dict(by_component)))

    @property
    def base_served(self) -> dict[str, int]:
        """With by_component: calls of other components, by component (served by the policy)."""
        return self.call("stats", None)["base_served"]

    @property
    def asked(self) -> dict[str, int]:
        """The model names the agent asked for, and how often."""
        return self.call("stats", None)["asked"]

    @property
    def backends(self) -> Replicas | None:
        """The backends' counts now (None before `start`)."""
        if not self._started:
            return None
        stats = self.call("stats", None)
        return Replicas(urls=stats["backends"], served=stats["served"], out=stats["out"])

    # ------------------------------------------------------------------------------------------ the pair

    def call(self, op: str, arg: Any, *, timeout: float = ANSWER_S) -> Any:
        """Send the child one command (`COMMANDS`), and return its answer. RunError if the child is gone, fails the
        command, or does not answer within `timeout`."""
        stopped = self.why_stopped()
        if stopped is not None:  # it would answer nothing until continued
            raise RunError(stopped)
        done = threading.Event()
        out: list[tuple[str, Any]] = []
        ask = self._waiting_for(lambda kind, value: (out.append((kind, value)), done.set()))
        self._send(op, arg, ask)
        if not done.wait(timeout):
            raise self._late(op, ask, timeout)
        return _answer(op, *out[0])

    def _late(self, op: str, ask: int, timeout: float) -> RunError:
        with self._lock:
            self._waiting.pop(ask, None)  # its answer, if it comes, is dropped
        stopped = self.why_stopped()
        return RunError(stopped or f"the gateway's process did not answer {op!r} within {timeout:.0f} s")

    def why_down(self) -> str | None:
        """The line naming why the child serves no call (ended, or stopped), else None."""
        return self.why_gone() if not self.is_alive() else self.why_stopped()

    def why_stopped(self) -> str | None:
        """The line naming a child that is stopped (SIGSTOP, SIGTSTP: it serves nothing until continued), else None.
        Read from /proc; elsewhere None."""
        try:
            stat = Path(f"/proc/{self._proc.pid}/stat").read_text()
        except OSError:
            return None
        if stat.rpartition(")")[2].split()[:1] != ["T"]:
            return None
        return (f"the gateway's process (pid {self._proc.pid}) is stopped (SIGSTOP or SIGTSTP): it serves no call "
                f"until it is continued (kill -CONT {self._proc.pid})")

    def _waiting_for(self, settle: Callable[[str, Any], None]) -> int:
        with self._lock:
            if self._gone is not None:
                raise RunError(self._gone)
            self._asked += 1
            self._waiting[self._asked] = settle
            return self._asked

    def _send(self, op: str, arg: Any, ask: int) -> None:
        with self._lock:
            if self._gone is not None:
                raise RunError(self._gone)
            try:
                self._conn.send((op, arg, ask))
            except OSError:
                pass  # the reader sees the end too, and answers every waiter with why

    def _read(self) -> None:
        """The child's messages, in the order it sent them: records before the answer to a flush that follows."""
        while True:
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError):
                gone = self.why_gone()
                with self._lock:
                    self._gone = gone
                    waiting, self._waiting = self._waiting, {}
                for settle in waiting.values():
                    settle("gone", gone)
                return
            if kind == "records":
                self.capture.write(value)
            elif kind == "log":  # the gateway's own lines say so already; the others are named here
                level, line = value
                log.log(level, "%s", line if line.startswith("gateway: ") else f"gateway: {line}")
            else:  # an answer: (its command's number, the value)
                with self._lock:
                    settle = self._waiting.pop(value[0], None)
                if settle is not None:  # else its caller stopped waiting
                    settle(kind, value[1])

    def why_gone(self) -> str:
        """Why the child is gone: its exit code (None: not ended within 2 s)."""
        if self._gone is not None:
            return self._gone
        try:
            code = self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        return f"the gateway's process ended (exit code {code}); the run's agents have no gateway to call"


def _answer(op: str, kind: str, value: Any) -> Any:
    if kind == "gone":
        raise RunError(value)
    if kind == "error":
        raise RunError(f"the gateway's process failed {op!r}: {value}")
    return value


class Rollouts:
    """`OpenRollouts`' interface, kept by the child, over a pair of their own: an opening is sent, not answered.
    The child takes in what has arrived before it looks a call's rollout up (`PairedRollouts`), and the runtime
    opens a rollout before its agent can call, so the first call finds it open all the same."""

    def __init__(self, gateway: IsolatedGateway, conn: Connection):
        self._gateway, self._conn = gateway, conn
        self._lock = threading.Lock()

    def open(self, key: str, rollout_id: str, attempt: int = 1, phase: str = "train", *,
             seed: int | None = None, secret: str | None = None) -> None:
        self._send(("open", (key, rollout_id, attempt, phase, seed, secret)))

    def close(self, key: str) -> None:
        """Closed; on a gateway that is gone there is nothing to close (a rollout's `finally` must not raise what
        its opening, or the run, says already)."""
        try:
            self._send(("close", key))
        except RunError:
            pass

    def _send(self, message: tuple) -> None:
        with self._lock:
            try:
                self._conn.send(message)
            except OSError:
                raise RunError(self._gateway.why_gone()) from None


class Records(RecordOutlet):
    """`Capture`'s interface on this side: the child makes the records; here they are written to `sink` (the
    run's store) and to the user's tools (`exported`), from the thread that reads the pair."""

    def __init__(self, gateway: IsolatedGateway):
        super().__init__()
        self._gateway = gateway
        self.errors: list[str] = []

    def record_to(self, sink: CallSink | None) -> None:
        self.flush()
        self.sink = sink
        if sink is None and (not self._gateway.is_alive() or self._gateway.why_stopped() is not None):
            return  # a child gone or stopped sends no more records: nothing to turn off
        self._gateway.call("record", sink is not None)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every call the child has ended is written here; False if that took longer than `timeout_s`."""
        if not self._gateway.is_alive() or self._gateway.why_stopped() is not None:
            return False  # what it had not sent is lost (or, stopped, it sends nothing until continued)
        return bool(self._gateway.call("flush", timeout_s, timeout=timeout_s + 5))

    def write(self, records: list[SpanRecord]) -> None:
        try:
            self.hand_on(records)
        except Exception as e:  # noqa: BLE001 - kept, and raised by the runtime after its flush, as Drain's are
            self.errors.append(f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------- the child


class _Forward(logging.Handler):
    def __init__(self, send: Callable[[tuple], None]):
        super().__init__(logging.INFO)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._send(("log", (record.levelno, record.getMessage())))
        except OSError:
            pass  # the run is gone; the child ends with its next command


class PairedRollouts(OpenRollouts):
    """The child's open rollouts, as the run's process opens and closes them over their own pair. A lookup that
    finds no rollout first takes in what has arrived: the run sends a rollout's opening before its agent can call,
    so the opening is in, or on, the pair by the time the call is read. A thread takes them in meanwhile."""

    def __init__(self, conn: Connection):
        super().__init__()
        self._conn = conn
        self._taking = threading.Lock()  # held from a message's read to its applying: a lookup waits for it
        self.ended = False

    def get(self, key: str | None) -> Rollout | None:
        rollout = super().get(key)
        if rollout is None and key:
            self.take_in()
            rollout = super().get(key)
        return rollout

    def take_in(self) -> None:
        with self._taking:
            try:
                while not self.ended and self._conn.poll(0):
                    op, arg = self._conn.recv()
                    if op == "open":
                        key, rollout_id, attempt, phase, seed, secret = arg
                        self.open(key, rollout_id, attempt, phase, seed=seed, secret=secret)
                    else:
                        self.close(arg)
            except (EOFError, OSError):
                self.ended = True

    def follow(self) -> None:
        """Take in each message as it arrives, until the run's end of the pair closes."""
        while not self.ended:
            wait([self._conn])
            self.take_in()


class _Sink:
    """The child's `CallSink`: each batch of records to the run's process."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send

    def write_calls(self, records: Sequence[SpanRecord]) -> None:
        self._send(("records", list(records)))


def serve(listen_fd: int, pair_fd: int, rollouts_fd: int) -> None:
    """The child: serve the bound socket `listen_fd` as the run's process commands over `pair_fd`, with the
    rollouts it opens over `rollouts_fd`."""
    import gc

    from lightning_sdk.gateway.proxy import Gateway

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle: it stops this process itself
    conn = connection(pair_fd)
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    logger = logging.getLogger("lightning_sdk")
    logger.addHandler(_Forward(send))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    gateway: Gateway | None = None
    sink = _Sink(send)
    rollouts = PairedRollouts(connection(rollouts_fd))
    threading.Thread(target=rollouts.follow, name="lightning-gateway-rollouts", daemon=True).start()
    while True:
        try:
            op, arg, ask = conn.recv()  # ask: the number its answer carries
        except (EOFError, OSError):
            break  # the run's process is gone
        try:
            if op == "settings":
                gateway = Gateway(api_key=arg["api_key"], model_names=arg["model_names"], rollouts=rollouts,
                                  store_text=arg["store_text"], sock=socket.socket(fileno=listen_fd))
                value: Any = None
            elif op == "stop":
                send(("answer", (ask, None)))
                break
            else:
                value = COMMANDS[op](gateway, sink, arg)
                if op == "start":
                    gc.collect()
                    gc.freeze()  # what startup made stays: collections walk only what calls make
        except Exception as e:  # noqa: BLE001 - the run's process raises it, with the command's name
            send(("error", (ask, f"{type(e).__name__}: {e}")))
            continue
        send(("answer", (ask, value)))
    if gateway is not None:
        gateway.capture.flush()
        gateway.stop()
    conn.close()


def _stats(gateway: Any) -> dict[str, Any]:
    b = gateway.backends
    return {"asked": dict(gateway.asked), "base_served": dict(gateway.base_served),
            "backends": list(b.urls) if b else [], "served": list(b.served) if b else [],
            "out": dict(b.out) if b else {}}


# The commands after "settings", by name: (gateway, sink, argument) -> answer.
COMMANDS: dict[str, Callable[[Any, _Sink, Any], Any]] = {
    "policy": lambda g, sink, name: setattr(g, "policy", name),
    "canary": lambda g, sink, value: setattr(g, "canary", value),
    "route": lambda g, sink, arg: g.route(*arg),
    "record": lambda g, sink, on: g.capture.record_to(sink if on else None),
    # Its records are sent before this answer, and the pair keeps the order.
    "flush": lambda g, sink, timeout_s: g.capture.flush(timeout_s),
    "start": lambda g, sink, arg: g.start(arg[0], backend_key=arg[1],
                                          grammar=ServerGrammar.from_dict(arg[2]) if arg[2] else None),
    "stats": lambda g, sink, arg: _stats(g),
}


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    os._exit(0)  # daemon threads (the server's, the writer's) end with the process
