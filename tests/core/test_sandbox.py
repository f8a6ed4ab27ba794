"""The sandbox runs untrusted Python in a limited worker: results, limits, forbidden operations, recovery."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest

from lopd_core.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxUnavailable,
    call_function,
    check_isolation,
    decode,
    encode,
    run_code,
)
from lopd_core.sandbox import isolation as sandbox_isolation

LIMITS = SandboxLimits(timeout_s=3.0, memory_mb=512)


@pytest.fixture
def box():
    sandbox = Sandbox(LIMITS)
    yield sandbox
    sandbox.close()


def test_exec_and_call_keep_one_namespace_and_return_json_values(box):
    assert box.exec("def area(w, h=2):\n    return {'area': w * h, 'dims': (w, h)}\nprint('defined')").stdout == (
        "defined\n"
    )
    result = box.call("area", 3, h=4)
    assert result.ok and result.clean
    assert result.value == {"area": 12, "dims": [3, 4]}  # tuples come back as JSON lists
    assert box.call("area", 5).value["area"] == 10
    odd = call_function("def f():\n    return {1, 2}", "f", limits=LIMITS)
    assert odd.ok and odd.value == "{1, 2}"  # not JSON: its repr


def test_exceptions_are_results_not_raised(box):
    result = box.exec("raise ValueError('bad input')")
    assert not result.ok and result.error_type == "exception"
    assert result.error == "ValueError: bad input" and "ValueError" in result.traceback
    assert box.call("nothing_here").error_type == "exception"
    assert box.exec("import sys\nsys.exit(3)").error_type == "exception"  # SystemExit is caught too
    assert box.exec("x = 1").ok  # the worker is still usable


def test_infinite_loop_times_out_and_the_next_request_gets_a_fresh_worker(box):
    box.exec("state = 41")
    t0 = time.monotonic()
    result = box.exec("while True:\n    pass", timeout=1.0)
    assert result.error_type == "timeout" and time.monotonic() - t0 < 5
    assert box.restarts == 1
    after = box.exec("print(state)")  # the namespace went with the killed worker
    assert after.error_type == "exception" and "NameError" in after.error
    assert box.call("len", [1, 2]).value == 2


def test_huge_allocation_raises_memory_error_inside_the_worker(box):
    result = box.exec("blob = bytearray(8 * 1024 ** 3)")
    assert not result.ok and result.error_type == "memory"
    assert box.exec("ok = 1").ok and box.restarts == 0


def test_write_outside_the_directory_is_refused_and_reported_even_if_caught(box):
    code = "try:\n    open('/dev/shm/escaped.txt', 'w').write('x')\nexcept OSError as e:\n    caught = str(e)\n"
    result = box.exec(code)
    assert result.ok and not result.clean  # the code swallowed the error, the sandbox still reports it
    assert any("write outside the sandbox directory" in v for v in result.violations)
    assert not Path("/dev/shm/escaped.txt").exists()
    assert box.exec("import os\nos.remove('/etc/hostname')").violations
    inside = box.exec("open('notes.txt', 'w').write('hi')\nprint(open('/tmp/notes.txt').read())")
    assert inside.clean and inside.stdout == "hi\n" and box.info.workdir == "/tmp"


def test_the_worker_sees_only_what_it_needs(box):
    project = Path(__file__).resolve().parents[2]
    seen = box.exec(
        "import os\nprint(sorted(os.listdir('/')), os.getuid(), sorted(os.listdir('/proc/self/fd')))\n"
        f"print(os.path.exists({str(project)!r}), os.path.exists('/etc/passwd'), os.listdir('/root') if "
        "os.path.exists('/root') else None)"
    )
    top, uid, fds = seen.stdout.splitlines()[0].rsplit(" ", 2)[0], 65534, seen.stdout
    assert "'etc'" not in top and "'home'" not in top and "'work'" not in top, seen.stdout
    assert f" {uid} " in seen.stdout and "['0', '1', '2', '3', '4', '5']" in fds  # 3-5: the channel, listdir
    assert seen.stdout.splitlines()[1].startswith("False False")  # no project tree, no /etc
    assert box.exec("open('/usr/lopd-pwned', 'w')").error_type == "exception"  # read-only even past the hook


def test_plain_data_codec_and_remote_calls():
    value = {"t": (1, 2.5, None), "s": {1, 2}, (1, "k"): b"x", "n": float("inf"), "c": 1j, "f": frozenset()}
    assert decode(json.loads(json.dumps(encode(value)))) == value
    with pytest.raises(TypeError):
        encode(object())
    with pytest.raises(ValueError):
        decode({"$evil": 1})
    with Sandbox(LIMITS) as cand, Sandbox(LIMITS) as grader:
        cand.exec("def f(x):\n    if x < 0:\n        raise ValueError('neg')\n    return (x, {x})")
        assert cand.call("f", 2, codec=True).value == (2, {2})

        def serve(name, args):
            res = cand.call(name, *args, codec=True)
            if res.ok:
                return {"ok": True, "value": encode(res.value)}
            return {"ok": False, "exc_type": res.exc_type, "error": res.error}

        code = (
            "f = _lopd_remote('f')\nassert f(3) == (3, {3})\ntry:\n    f(-1)\nexcept ValueError:\n    pass\n"
            "else:\n    raise AssertionError('no error')\n"
        )
        assert grader.exec(code, serve=serve).clean
        cand.exec("class A:\n    def __eq__(self, o):\n        return True\ndef g():\n    return A()")
        odd = cand.call("g", codec=True)
        assert not odd.ok and "not plain data" in odd.error


def test_isolation_is_typed_and_fails_closed(monkeypatch):
    with pytest.raises(ValueError, match=r"SandboxLimits\.isolation"):
        SandboxLimits(isolation="chroot")
    check_isolation.cache_clear()
    monkeypatch.setattr(sandbox_isolation.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        Sandbox(LIMITS).exec("x = 1")
    monkeypatch.undo()
    check_isolation.cache_clear()
    assert run_code("x = 1", SandboxLimits(isolation="none")).ok  # trusted code only


def test_process_creation_is_refused(box):
    forked = box.exec("import os\ntry:\n    os.fork()\nexcept OSError:\n    pass")
    assert forked.violations == ["os.fork is not allowed"]
    assert box.exec("import os\nos.system('true')").violations == ["os.system is not allowed"]
    assert not box.exec("import subprocess").ok  # not importable inside the worker


def test_no_network(box):
    with socket.socket() as server:  # a listening socket on this machine's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = box.exec(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert not result.ok
    assert box.info.isolation == "bwrap"


def test_output_is_captured_and_the_protocol_cannot_be_corrupted(box):
    result = box.exec("import os, sys\nprint('{\"ok\": false}')\nos.write(1, b'garbage\\n')\nsys.stderr.write('err')")
    assert result.ok and result.stdout == '{"ok": false}\nerr'  # fd-level writes go nowhere
    assert box.call("sum", [1, 2, 3]).value == 6


def test_worker_crash_is_reported_and_recovered(box):
    result = box.exec("import os\nos._exit(7)")
    assert result.error_type == "crash" and "code 7" in result.error
    assert box.exec("y = 2").ok and box.restarts == 1


def test_limits_and_privileges(box):
    info = box.start()
    assert info.uid == 65534 and info.isolation == "bwrap"
    threads = box.exec("import threading\nt = threading.Thread(target=print)\nt.start()")
    assert not threads.ok  # the seccomp filter refuses threads and processes
    big = box.exec("open('big.bin', 'wb').write(b'0' * (40 << 20))")  # over the 16 MiB file-size limit
    assert not big.ok
    hostdir = box._hostdir
    box.close()
    assert hostdir and not Path(hostdir).exists()


def test_one_shot_helpers():
    assert run_code("assert sorted([3, 1, 2]) == [1, 2, 3]", LIMITS).ok
    failed = run_code("assert 1 == 2", LIMITS)
    assert failed.error_type == "exception" and failed.error.startswith("AssertionError")
    assert run_code("while True: pass", LIMITS, timeout=0.5).error_type == "timeout"
    assert call_function("def f(a, b=1):\n    return a - b", "f", 10, b=3, limits=LIMITS).value == 7
