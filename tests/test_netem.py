"""gradq.netem: rate parsing, naming, the launcher on loopback, and (with root) a real 2-host network."""

import signal
import subprocess
import sys
import time

import pytest

from gradq.netem import (STOP_GRACE, EmulatedNetwork, NetemError, can_emulate, format_rate, launch, parse_rate,
                         stop_ranks)


def test_parse_rate():
    assert parse_rate("1gbit") == 10**9 and parse_rate("500mbit") == 5 * 10**8
    assert parse_rate("2.5GBit") == 2_500_000_000 and parse_rate("100m") == 10**8
    assert parse_rate("125mbps") == 10**9          # tc's bps = bytes per second
    assert parse_rate(1e6) == 10**6 and parse_rate(" 64 kbit ") == 64_000
    for bad in ("fast", "", "-1gbit", "1 gigabit", "0mbit"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    with pytest.raises(TypeError):
        parse_rate(True)


def test_format_rate_round_trips():
    for r in (10**9, 2_500_000_000, 10**8, 64_000, 1234):
        assert parse_rate(format_rate(r)) == r
    assert format_rate(10**9) == "1gbit" and format_rate(2_500_000_000) == "2500mbit"


def test_names_are_unique_per_tag_and_short():
    a, b = EmulatedNetwork(4, "1gbit", tag=17), EmulatedNetwork(4, "1gbit", tag=18)
    assert set(a.namespaces).isdisjoint(b.namespaces) and a.subnet != b.subnet
    assert all(len(n) <= 15 for n in a.ifnames + a._peers + [a.bridge])  # Linux IFNAMSIZ
    assert a.addrs[0] == a.master_addr and len(set(a.addrs)) == 4
    with pytest.raises(ValueError):
        EmulatedNetwork(0)
    with pytest.raises(ValueError):
        EmulatedNetwork(4, "nonsense")


def test_launch_sets_the_torchrun_environment(tmp_path):
    code = ("import os; open(os.path.join(%r, os.environ['RANK']), 'w').write("
            "' '.join(os.environ[k] for k in ('RANK','WORLD_SIZE','MASTER_ADDR','LOCAL_RANK')))") % str(tmp_path)
    assert launch([[sys.executable, "-c", code]] * 3, timeout=60) == [0, 0, 0]
    for r in range(3):
        assert (tmp_path / str(r)).read_text() == f"{r} 3 127.0.0.1 {r}"


def test_a_failing_rank_stops_the_others():
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(NetemError, match=r"rank\(s\) \[1\]"):
        launch([slow, [sys.executable, "-c", "raise SystemExit(3)"], slow], timeout=120)
    assert time.monotonic() - t0 < 30  # the sleeping ranks were killed, not waited for
    with pytest.raises(NetemError, match="within"):
        launch([slow], timeout=1)
    with pytest.raises(ValueError):
        launch([])


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
def test_a_stopped_rank_is_ended_at_once_not_after_the_grace(tmp_path):
    """A rank stopped by SIGSTOP holds the launcher's SIGTERM pending; the launcher continues it, so it
    ends at once. Bound: the grace (10 s) minus a generous 5 s for process start-up on a loaded host."""
    flag = tmp_path / "ready"
    stopper = [sys.executable, "-c", f"import os, signal, time; open({str(flag)!r}, 'w').close(); "
                                     "os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)"]
    failer = [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\n"
                                    "time.sleep(0.3); raise SystemExit(3)"]
    t0 = time.monotonic()
    with pytest.raises(NetemError, match=r"rank\(s\) \[1\]"):
        launch([stopper, failer], timeout=120)
    assert time.monotonic() - t0 < STOP_GRACE - 5


def test_stop_ranks_kills_what_ignores_sigterm_after_one_shared_grace():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE) for _ in range(3)]
    for p in procs:
        assert p.stdout.readline().strip() == b"1"  # the handler is in place
    t0 = time.monotonic()
    stop_ranks(procs, grace=1.0)
    took = time.monotonic() - t0
    assert all(p.returncode == -signal.SIGKILL for p in procs)
    assert 1.0 <= took < 2.9  # one deadline for all three: a grace each would take at least 3 s
    for p in procs:
        p.stdout.close()


SERVER = """
import os, socket
s = socket.socket(); s.bind((os.environ["MASTER_ADDR"], 29911)); s.listen(1)
c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""
CLIENT = """
import os, socket, time
for _ in range(100):
    try:
        c = socket.create_connection((os.environ["MASTER_ADDR"], 29911), timeout=2); break
    except OSError:
        time.sleep(0.1)
assert c.recv(2) == b"ok"
"""


@pytest.mark.skipif(not can_emulate()[0], reason=f"cannot build namespaces here: {can_emulate()[1]}")
def test_two_emulated_hosts_reach_each_other_and_are_removed():
    net = EmulatedNetwork(2, "100mbit")
    with net:
        assert launch([[sys.executable, "-c", SERVER], [sys.executable, "-c", CLIENT]], net=net, timeout=60) == [0, 0]
        qd = subprocess.run(net.prefix(0) + ["tc", "qdisc", "show", "dev", net.ifnames[0]],
                            capture_output=True, text=True).stdout
    assert "tbf" in qd and "100Mbit" in qd
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in left for ns in net.namespaces)
    assert net.bridge not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_hosts_of_several_ranks():
    net = EmulatedNetwork(4, "1gbit", tag=19, ranks_per_host=2)
    assert len(net.namespaces) == len(net.addrs) == 2 and [net.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert net.prefix(3)[-1] == net.namespaces[1]
    with pytest.raises(ValueError, match="ranks_per_host"):
        EmulatedNetwork(4, ranks_per_host=3)


def test_without_root_it_says_why(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    ok, why = can_emulate()
    assert not ok and "root" in why
    with pytest.raises(NetemError, match="root"):
        with EmulatedNetwork(2):
            pass
