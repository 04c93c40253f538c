"""Emulate a slow network on one machine and launch one process per emulated host.

Linux only, and building the network needs root: each rank gets a network namespace joined to a
bridge by a veth pair, with a ``tbf`` rate limit on both ends of the pair (upload and download), so
every worker's link to the "switch" runs at ``rate``. ``netem`` delay is not used (it is missing from
some kernels): this emulates bandwidth, not latency.

    with EmulatedNetwork(world=4, rate="1gbit") as net:
        launch([[sys.executable, "train.py"]] * 4, net=net)

:func:`launch` without ``net`` runs the ranks on loopback. Either way each process gets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GLOO_SOCKET_IFNAME``, as torchrun
would set them, and if any rank fails or the launcher is interrupted the others are killed.

:class:`EmulatedNetwork` always removes what it created — on normal exit, on an exception, on Ctrl-C
and on SIGTERM — and names everything after the launcher's PID, so two harnesses do not collide.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Mapping, Optional, Sequence

__all__ = ["parse_rate", "format_rate", "can_emulate", "EmulatedNetwork", "launch", "launch_on", "free_port",
           "stop_ranks", "STOP_GRACE", "NetemError"]

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*$", re.IGNORECASE)


class NetemError(RuntimeError):
    """The emulated network could not be built or a rank failed."""


def parse_rate(rate: str | int | float) -> int:
    """Bits per second from ``"1gbit"``, ``"500mbit"``, ``"2.5gbit"``, ``"100m"`` or a number (bit/s).

    ``tc``'s ``bps`` means BYTES per second; it is accepted and converted (``"125mbps"`` = 1 Gbit/s)."""
    if isinstance(rate, bool):
        raise TypeError("rate must be a string such as '1gbit' or a number of bits per second")
    if isinstance(rate, (int, float)):
        bits = float(rate)
    else:
        m = _RATE.match(str(rate))
        if not m:
            raise ValueError(f"cannot read rate {rate!r}; write e.g. '1gbit', '500mbit', '2.5gbit' or bits/s")
        bits = float(m.group(1)) * _UNITS[m.group(2).lower()] * (8 if (m.group(3) or "").lower() == "bps" else 1)
    if not bits > 0 or bits != bits or bits == float("inf"):
        raise ValueError(f"rate must be positive and finite, got {rate!r}")
    return int(round(bits))


def format_rate(bits_per_s: int) -> str:
    """The ``tc`` spelling of a rate: ``1000000000`` → ``"1gbit"``, ``2500000000`` → ``"2500mbit"``."""
    for unit, f in (("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if bits_per_s % f == 0:
            return f"{bits_per_s // f}{unit}bit"
    return f"{bits_per_s}bit"


def can_emulate() -> tuple[bool, str]:
    """``(True, "")`` when this process can build namespaces, else ``(False, reason)``."""
    if not sys.platform.startswith("linux"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "building network namespaces needs root (run as root, or without --network for loopback)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    return True, ""


def free_port() -> int:
    """A TCP port that was free a moment ago on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetemError(f"{' '.join(cmd)} failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


class EmulatedNetwork:
    """One namespace per host on a bridge, each host's link limited to ``rate`` in both directions.

    Args:
        world: number of ranks, 1..250.
        rate: link rate (``"1gbit"``, ``"500mbit"`` or bits/s).
        burst: ``tbf`` bucket size (default ``"512kb"``, which sustained ≈ 960 Mbit/s at 1 Gbit/s).
        tag: distinguishes concurrent harnesses (default: this process's PID).
        ranks_per_host: ranks sharing one host (default 1). Ranks of one host talk over the namespace's
            loopback, at memory speed, and share the host's link to the others: a node of several GPUs.
    Attributes: ``namespaces``, ``ifnames``, ``addrs`` (one per host), ``master_addr``; :meth:`host_of`.
    """

    def __init__(self, world: int, rate: str | int | float = "1gbit", *, burst: str = "512kb",
                 tag: Optional[int] = None, ranks_per_host: int = 1) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 250:
            raise ValueError(f"world must be an int in 1..250, got {world!r}")
        if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or ranks_per_host < 1 \
                or world % ranks_per_host:
            raise ValueError(f"ranks_per_host must be a positive int dividing world={world}, got {ranks_per_host!r}")
        self.world = world
        self.ranks_per_host = ranks_per_host
        hosts = world // ranks_per_host
        self.rate = parse_rate(rate)
        self.burst = burst
        t = (os.getpid() if tag is None else int(tag)) % 10000
        self.bridge = f"gqb{t}"
        self.namespaces = [f"gq{t}n{i}" for i in range(hosts)]
        self.ifnames = [f"gq{t}v{i}" for i in range(hosts)]      # inside the namespace
        self._peers = [f"gq{t}p{i}" for i in range(hosts)]       # on the bridge
        self.subnet = f"10.{200 + t // 250 % 50}.{t % 250}"
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(hosts)]
        self.master_addr = self.addrs[0]
        self._built = False
        self._old_handlers: dict[int, object] = {}

    # -- context -----------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedNetwork":
        ok, why = can_emulate()
        if not ok:
            raise NetemError(why)
        self._old_handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        for s in self._old_handlers:
            signal.signal(s, _raise_interrupt)
        try:
            self.build()
        except BaseException:
            self.teardown()
            self._restore_signals()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.teardown()
        finally:
            self._restore_signals()

    def _restore_signals(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)  # type: ignore[arg-type]
        self._old_handlers = {}

    # -- building ----------------------------------------------------------------------------------
    def build(self) -> None:
        rate = format_rate(self.rate)
        tbf = ["tbf", "rate", rate, "burst", self.burst, "latency", "50ms"]
        self._built = True
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for ns, v, p, a in zip(self.namespaces, self.ifnames, self._peers, self.addrs):
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", v, "type", "veth", "peer", "name", p])
            _run(["ip", "link", "set", v, "netns", ns])
            _run(["ip", "link", "set", p, "master", self.bridge])
            _run(["ip", "link", "set", p, "up"])
            _run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{a}/24", "dev", v])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", v, "up"])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", v, "root", *tbf])   # upload
            _run(["tc", "qdisc", "add", "dev", p, "root", *tbf])                               # download

    def teardown(self) -> None:
        """Remove every namespace, veth and the bridge (ignores what is already gone)."""
        if not self._built:
            return
        for ns, p in zip(self.namespaces, self._peers):
            _run(["ip", "netns", "pids", ns], check=False)
            _run(["ip", "netns", "del", ns], check=False)
            _run(["ip", "link", "del", p], check=False)
        _run(["ip", "link", "del", self.bridge], check=False)
        self._built = False

    def host_of(self, rank: int) -> int:
        """The host (namespace index) of ``rank``."""
        return rank // self.ranks_per_host

    def prefix(self, rank: int) -> list[str]:
        """The command prefix that runs a program inside rank ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[self.host_of(rank)]]


def _raise_interrupt(signum, frame):  # pragma: no cover - exercised by signals
    raise KeyboardInterrupt(f"signal {signum}")


def launch(cmds: Sequence[Sequence[str]], *, net: Optional[EmulatedNetwork] = None,
           env: Optional[Mapping[str, str]] = None, port: Optional[int] = None,
           timeout: Optional[float] = None, threads: int = 1) -> list[int]:
    """Run ``cmds[i]`` as rank ``i`` of a ``len(cmds)``-process group; returns the exit codes.

    On loopback (``net=None``) or one rank per namespace of ``net``. ``threads`` sets
    ``OMP_NUM_THREADS``/``NUMBA_NUM_THREADS`` per rank (default 1: the ranks share the machine's cores).
    If a rank exits non-zero, the launcher times out, or it is interrupted, the remaining ranks are
    killed and :class:`NetemError` (or the interrupt) is raised.
    """
    world = len(cmds)
    if world < 1:
        raise ValueError("launch needs at least one command")
    if net is not None and net.world != world:
        raise ValueError(f"{world} commands for a network of {net.world} hosts")
    port = free_port() if port is None else int(port)
    procs: list[subprocess.Popen] = []
    base = dict(os.environ if env is None else env)
    try:
        for r, cmd in enumerate(cmds):
            per_host = net.ranks_per_host if net else world
            e = dict(base, RANK=str(r), LOCAL_RANK=str(r % per_host), LOCAL_WORLD_SIZE=str(per_host),
                     WORLD_SIZE=str(world), MASTER_PORT=str(port),
                     OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
                     MASTER_ADDR=net.master_addr if net else "127.0.0.1",
                     GLOO_SOCKET_IFNAME=net.ifnames[net.host_of(r)] if net else "lo")
            procs.append(subprocess.Popen((net.prefix(r) if net else []) + list(cmd), env=e))
        deadline = None if timeout is None else time.monotonic() + timeout
        codes: list[Optional[int]] = [None] * world
        while any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                raise NetemError(f"rank(s) {bad} exited with {[codes[i] for i in bad]}; stopping the others")
            if deadline is not None and time.monotonic() > deadline:
                raise NetemError(f"ranks did not finish within {timeout:.0f} s")
            time.sleep(0.05)
        return [int(c) for c in codes]  # type: ignore[arg-type]
    finally:
        stop_ranks(procs)


#: seconds the ranks left running get, together, to exit after SIGTERM before they are killed
STOP_GRACE = 10.0


def stop_ranks(procs: Sequence[subprocess.Popen], grace: float = STOP_GRACE) -> None:
    """Stop every process of ``procs`` still running: SIGTERM, then SIGKILL for any still there after
    ``grace`` seconds (one deadline for all of them, not ``grace`` each).

    SIGTERM is followed by SIGCONT: a stopped process (SIGSTOP, a debugger's halt, a terminal's
    Ctrl-Z) holds a SIGTERM pending until it runs again, so without it a stalled rank would sit out
    the whole grace."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
            if hasattr(signal, "SIGCONT"):
                os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:  # it ended in between
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch_on(cmds: Sequence[Sequence[str]], rate: Optional[str] = None, *, timeout: Optional[float] = None,
              threads: int = 1, ranks_per_host: int = 1) -> Optional[str]:
    """:func:`launch` on loopback (``rate=None``) or, as root, one rank per namespace on emulated links
    of ``rate`` (set up and torn down around the run). Returns ``None`` once the ranks have finished,
    or, without running anything, why links cannot be emulated here (the benchmarks then say so and
    exit 0)."""
    if not rate:
        launch(cmds, timeout=timeout, threads=threads)
        return None
    ok, why = can_emulate()
    if not ok:
        return why
    with EmulatedNetwork(len(cmds), rate, ranks_per_host=ranks_per_host) as net:
        launch(cmds, net=net, timeout=timeout, threads=threads)
    return None
