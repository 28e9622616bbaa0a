"""The sandbox security battery: hostile snippets are contained, reported, and the host carries on.

Each snippet runs twice: with every layer this host allows, and without namespaces (a host that forbids
``unshare``), where the remaining layers must hold on their own."""

import os
import uuid

import pytest

from reflow.envs.sandbox import Sandbox, SandboxLimits, namespace_prefix

LIMITS = SandboxLimits(wall_s=4.0, cpu_s=2.0, memory_mb=512, file_size_mb=4, output_bytes=2048)
MARKER = f"/tmp/reflow-sandbox-escape-{uuid.uuid4().hex}"
SECRET = f"REFLOW_TEST_SECRET_{uuid.uuid4().hex}"

# name -> (code, the statuses that count as contained, a text the reported message must contain)
HOSTILE = {
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\nprint('connected')",
                {"refused", "error"}, ""),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  {"refused", "cpu_limit", "timeout"}, ""),
    "write outside": (f"open({MARKER!r}, 'w').write('escaped')", {"refused", "error"}, ""),
    "read /etc/shadow": ("print(open('/etc/shadow').read())", {"refused", "error"}, ""),
    "parent environment": ("import os\nprint(sorted(os.environ))\nprint(open(f'/proc/{os.getppid()}/environ').read())",
                           {"refused", "error"}, "HOME"),
    "infinite loop": ("while True:\n    pass", {"cpu_limit"}, "time limit exceeded (CPU)"),
    "memory bomb": ("blocks = [bytearray(1 << 28) for _ in range(64)]", {"memory_limit"}, "memory limit exceeded"),
    "huge output": ("while True:\n    print('A' * 4096)", {"output_limit"}, "output limit exceeded"),
    "kill the parent": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('sent')", {"refused"}, "signalling"),
    "sleep past the wall clock": ("import time\ntime.sleep(60)", {"timeout"}, "time limit exceeded (wall clock)"),
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(b'touch " + MARKER + "')", {"refused"}, "ctypes"),
    "another program": ("import subprocess\nsubprocess.run(['sh', '-c', 'touch " + MARKER + "'])", {"refused"}, ""),
    "fork_exec without an audit event": ("import _posixsubprocess", {"refused"}, "_posixsubprocess"),
    "write outside after chdir": (f"import os\nos.chdir('/tmp')\nopen({os.path.basename(MARKER)!r}, 'w')", {"refused"}, "os.chdir"),
    "write through a folder descriptor": (
        f"import os\nfd = os.open('/tmp', os.O_RDONLY)\nos.open({os.path.basename(MARKER)!r}, os.O_CREAT | os.O_WRONLY, dir_fd=fd)",
        {"refused"}, "opening the folder '/tmp'"),
}


@pytest.fixture(scope="module", params=["all layers", "no namespaces"])
def sandbox(request):
    os.environ[SECRET] = "leaked"
    yield Sandbox(LIMITS, use_namespaces=request.param == "all layers")
    os.environ.pop(SECRET, None)


def test_ordinary_code_runs(sandbox):
    result = sandbox.run("import math, json\nname = input()\nprint(json.dumps({'hi': name, 'r': math.isqrt(99)}))", stdin="ann\n")
    assert result.status == "ok", result.stderr
    assert result.stdout == '{"hi": "ann", "r": 9}\n'
    result = sandbox.run("open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())")
    assert (result.status, result.stdout) == ("ok", "kept\n")
    result = sandbox.run("print(1/0)")
    assert result.status == "error" and result.message().endswith("ZeroDivisionError: division by zero")


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_snippet_is_contained(sandbox, name):
    code, contained, says = HOSTILE[name]
    result = sandbox.run(code)
    print(f"{name}: {result.status} in {result.wall_s:.2f}s: {result.message()[-160:]!r} ({', '.join(sandbox.isolation)})")
    assert result.status in contained, (result.status, result.stderr[-500:])
    assert says in result.message()
    assert result.wall_s < LIMITS.wall_s + 2.0
    # the host carries on: nothing was written outside, no secret came back, this process lives, and the
    # next run works
    assert not os.path.exists(MARKER)
    assert SECRET not in result.stdout + result.stderr
    assert "root:" not in result.stdout
    assert "connected" not in result.stdout
    assert len(result.stdout) <= LIMITS.output_bytes
    assert sandbox.run("print('still here')").stdout == "still here\n"


def test_namespaces_are_used_where_the_host_allows_them():
    if not namespace_prefix():
        pytest.skip("this host forbids unshare: the other layers are tested alone above")
    assert "namespaces" in Sandbox(LIMITS).isolation
    # in its own PID space the sandbox sees no process of the host's
    result = Sandbox(LIMITS).run("import os\nprint(os.getpid(), os.getppid())")
    assert result.stdout.split() == ["1", "0"]
