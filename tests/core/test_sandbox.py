"""The sandbox runs untrusted Python in a limited worker: results, limits, forbidden operations, recovery."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from lopd_core.sandbox import Sandbox, SandboxLimits, call_function, run_code

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


def test_write_outside_the_directory_is_refused_and_reported_even_if_caught(box, tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"try:\n    open({str(target)!r}, 'w').write('x')\nexcept OSError as e:\n    caught = str(e)\n"
    result = box.exec(code)
    assert result.ok and not result.clean  # the code swallowed the error, the sandbox still reports it
    assert any("write outside the sandbox directory" in v for v in result.violations)
    assert not target.exists()
    assert box.exec("import os\nos.remove('/etc/hostname')").violations
    inside = box.exec("open('notes.txt', 'w').write('hi')\nprint(open('notes.txt').read())")
    assert inside.clean and inside.stdout == "hi\n"
    assert Path(box.info.workdir, "notes.txt").read_text() == "hi"


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
    assert box.info.network in ("netns", "userns+netns", "audit-hook")


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
    assert Path(info.workdir).is_dir()
    if os.geteuid() == 0:  # root drops to a fresh unprivileged uid with a process limit of one
        assert info.uid >= 1_700_000_000 and info.nproc_limit == 1
        threads = box.exec("import threading\nt = threading.Thread(target=print)\nt.start()")
        assert not threads.ok
    big = box.exec("open('big.bin', 'wb').write(b'0' * (40 << 20))")  # over the 16 MiB file-size limit
    assert not big.ok
    workdir = info.workdir
    box.close()
    assert not Path(workdir).exists()


def test_one_shot_helpers():
    assert run_code("assert sorted([3, 1, 2]) == [1, 2, 3]", LIMITS).ok
    failed = run_code("assert 1 == 2", LIMITS)
    assert failed.error_type == "exception" and failed.error.startswith("AssertionError")
    assert run_code("while True: pass", LIMITS, timeout=0.5).error_type == "timeout"
    assert call_function("def f(a, b=1):\n    return a - b", "f", 10, b=3, limits=LIMITS).value == 7
