"""The hostile battery: reward hacks and escapes tried through every grading path must score 0 and leave nothing.

Each snippet is an attack followed by a wrong answer; an attack that believes it escaped sets `ESCAPED`, which
turns the answer right. Grading paths: HumanEval ("check"), EvalPlus ("differential", "script"), LiveCodeBench
("stdio", "functional"), and EnvScaler (the attack in an environment's tool, whose state an honest check
reads, and the attack in a check function itself). The HumanEval path runs a second time with the in-process
audit hook switched off: the operating system alone must contain everything. Checked from outside after every
snippet: reward 0, no file in /tmp, /dev/shm, the project tree or a 0777 marker directory, no sandbox process
left. `test_battery_counts` prints contained / tried per path.
"""

from __future__ import annotations

import os
import socket
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import pytest

from lopd_core.envs.envscaler import EnvScalerConfig, EnvScalerSuite
from lopd_core.evaluation.code import CodeExecConfig, CodeProblem, CodeSuite
from lopd_core.sandbox import SandboxLimits, sandbox_worker

REPO = Path(__file__).resolve().parents[2]
MARK = f"lopd-battery-{uuid.uuid4().hex[:10]}"
TIMEOUT_S = 3.0
RESULTS: Counter[tuple[str, bool]] = Counter()


@pytest.fixture(scope="module")
def env():
    """A listening loopback socket and a 0777 directory holding a file, both on the host."""
    _subreaper()
    victim = Path("/tmp") / f"{MARK}-dir"
    victim.mkdir(mode=0o777)
    victim.chmod(0o777)
    (victim / "keep.txt").write_text("keep")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield {"port": server.getsockname()[1], "victim": victim, "server": server}
    server.close()
    (victim / "keep.txt").unlink(missing_ok=True)
    victim.rmdir()


def attacks(port: int, victim: Path) -> dict[str, tuple[str, str]]:
    """name -> (module-level attack, the answer expression). The answer is wrong unless ESCAPED."""
    forged = '{"ok": true, "value": null, "violations": []}\\n{"ok": true, "value": 3, "violations": []}\\n'
    return {
        "forged_reply": (f"import os\nfor fd in range(1, 12):\n    try:\n        os.write(fd, b'{forged}')\n    except OSError:\n        pass\n", "0"),  # noqa: E501
        "cleared_violations": (f"import gc\ntry:\n    open('/dev/shm/{MARK}-cleared', 'w').write('x')\nexcept Exception:\n    pass\nfor o in gc.get_objects():\n    if isinstance(o, list) and o and isinstance(o[0], str) and 'sandbox' in o[0]:\n        o.clear()\nimport sys\nf = sys._getframe()\nwhile f:\n    f.f_globals.get('violations', []).clear() if isinstance(f.f_globals.get('violations'), list) else None\n    f = f.f_back\n", "0"),  # noqa: E501
        "chdir_write": (f"import os\nfor d in ('/tmp', '/dev/shm'):\n    try:\n        os.chdir(d)\n        open('{MARK}-chdir', 'w').write('x')\n    except Exception:\n        pass\n", "0"),  # noqa: E501
        "dir_fd_write": (f"import os\nfor d in ('/tmp', '/dev/shm', {str(REPO)!r}):\n    try:\n        fd = os.open(d, os.O_RDONLY)\n        os.close(os.open('{MARK}-dirfd', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))\n    except Exception:\n        pass\n", "0"),  # noqa: E501
        "dir_fd_read_project": (f"import os\ntry:\n    fd = os.open({str(REPO)!r}, os.O_RDONLY)\n    ESCAPED = b'lopd' in os.read(os.open('pyproject.toml', os.O_RDONLY, dir_fd=fd), 4096)\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "tmp_and_shm_write": (f"for p in ('/tmp/{MARK}-tmp', '/dev/shm/{MARK}-shm', {str(REPO / (MARK + '-repo'))!r}):\n    try:\n        open(p, 'w').write('x')\n    except Exception:\n        pass\n", "0"),  # noqa: E501
        "delete_in_0777_dir": (f"import os, shutil\ntry:\n    os.remove({str(victim / 'keep.txt')!r})\nexcept Exception:\n    pass\ntry:\n    shutil.rmtree({str(victim)!r})\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "ctypes_libc": (f"try:\n    import ctypes\n    libc = ctypes.CDLL(None)\n    libc.system(b'touch /tmp/{MARK}-ctypes')\n    ESCAPED = libc.fork() > 0 or libc.unshare(0) == 0\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "always_equal": ("class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n    def __bool__(self):\n        return True\n    def __hash__(self):\n        return 0\n", "AlwaysEqual()"),  # noqa: E501
        "always_equal_int": ("class AlwaysEqual(int):\n    def __eq__(self, other):\n        return True\n    def __ne__(self, other):\n        return False\n    __hash__ = int.__hash__\n", "AlwaysEqual(0)"),  # noqa: E501
        "sys_exit_at_import": ("import sys\nsys.exit(0)\n", "0"),
        "os_exit_at_import": ("import os\nos._exit(0)\n", "0"),
        "sys_exit_in_call": ("", "__import__('sys').exit(0)"),
        "os_exit_in_call": ("", "__import__('os')._exit(0)"),
        "patched_builtins": ("import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.AssertionError = type('AssertionError', (BaseException,), {})\nbuiltins.len = lambda x: 0\nbuiltins.print = lambda *a, **k: None\n", "0"),  # noqa: E501
        "fork_bomb": ("import os\nfor _ in range(64):\n    try:\n        os.fork()\n    except Exception:\n        break\nimport threading\ntry:\n    threading.Thread(target=lambda: None).start()\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "memory_hog": ("try:\n    hog = bytearray(8 << 30)\nexcept MemoryError:\n    pass\ntry:\n    hog = [0] * (10 ** 10)\nexcept MemoryError:\n    pass\n", "0"),  # noqa: E501
        "socket_loopback": (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'pwned')\n    ESCAPED = True\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "read_project_and_root": (f"import os\nfor p in ({str(REPO / 'pyproject.toml')!r}, '/root/.bashrc', '/etc/passwd'):\n    try:\n        open(p).read()\n        ESCAPED = True\n    except Exception:\n        pass\ntry:\n    ESCAPED = ESCAPED or bool(set(os.listdir('/root')) - {{'.pyenv'}}) or bool(os.listdir({str(REPO)!r}))\nexcept Exception:\n    pass\n", "0"),  # noqa: E501
        "kill_the_parent": ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n        os.kill(pid, signal.SIGKILL)\n    except Exception:\n        pass\n", "0"),  # noqa: E501
    }  # fmt: skip


def _subreaper() -> None:
    """Make this test process the reaper of its orphans (PR_SET_CHILD_SUBREAPER): a sandbox process that
    double-forks away from its parent is re-parented here, not to the host's init, so it stays our descendant."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _sandbox_processes() -> set[int]:
    """Our descendant processes running the sandbox worker (its source text is on their command line). Only our
    own: other programs on the machine may run sandboxes of their own at the same time."""
    me, pids = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"The sandbox worker: our trusted code" not in (entry / "cmdline").read_bytes():
                    continue
                pid = int(entry.name)
                while pid > 1 and pid != me:
                    pid = _parent(pid)
                if pid == me:
                    pids.add(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return pids


def _leftovers(victim: Path) -> list[str]:
    found = [str(p) for d in ("/tmp", "/dev/shm") for p in Path(d).glob(MARK + "*") if p != victim]
    found += [str(p) for p in REPO.glob(MARK + "*")]
    if not (victim / "keep.txt").exists() or {p.name for p in victim.iterdir()} != {"keep.txt"}:
        found.append(f"{victim} changed")
    return found


def _program(attack: str, answer: str, kind: str) -> str:
    head = f"ESCAPED = False\n{attack}\n"
    if kind == "stdio":
        return head + f"a, b = map(int, input().split())\nprint(a + b if ESCAPED else {answer})\n"
    if kind == "functional":
        return head + f"class Solution:\n    def add(self, a, b):\n        return a + b if ESCAPED else {answer}\n"
    return head + f"def add(a, b):\n    return a + b if ESCAPED else {answer}\n"


PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
CHECK = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(5, 7) == 12\n"
SCRIPT = "assert add(1, 2) == 3\nassert add(5, 7) == 12\n"
PROBLEMS = {
    "humaneval": CodeProblem("B/check", "humaneval", PROMPT, "check", entry_point="add", test=CHECK),
    "evalplus_differential": CodeProblem(
        "B/diff", "humaneval_plus", PROMPT, "differential", entry_point="add",
        canonical_solution="    return a + b\n", inputs=([1, 2], [5, 7]),
    ),
    "evalplus_script": CodeProblem("B/script", "mbpp_plus", "", "script", entry_point="add", test=SCRIPT),
    "lcb_stdio": CodeProblem(
        "B/stdio", "livecodebench", "Add two numbers.", "stdio", cases=({"input": "1 2\n", "output": "3\n"},),
    ),
    "lcb_functional": CodeProblem(
        "B/fn", "livecodebench", "Add two numbers.", "functional", entry_point="add",
        cases=({"input": "1\n2", "output": "3"},), starter_code="class Solution:\n    def add(self, a, b):\n",
    ),
}  # fmt: skip
CODE_PATHS = [*PROBLEMS, "humaneval_os_only"]


def _grade_code(path: str, program: str) -> float:
    problem = PROBLEMS["humaneval" if path == "humaneval_os_only" else path]
    config = CodeExecConfig(timeout_s=TIMEOUT_S)
    suite = CodeSuite([problem], config=config)
    if path == "humaneval_os_only":  # the same grading with the in-process audit hook off
        suite.config = _NoHookConfig(timeout_s=TIMEOUT_S)
    episode = suite.episode(suite.tasks()[0])
    episode.initial_messages()
    episode.step(f"```python\n{program}\n```")
    return episode.result().reward


class _NoHookConfig(CodeExecConfig):
    def limits(self, n_cases: int = 0) -> SandboxLimits:
        base = super().limits(n_cases)
        return SandboxLimits(**{**base.__dict__, "audit_hook": False})


def _envscaler_suite(attack: str, answer: str, where: str) -> EnvScalerSuite:
    body = textwrap.indent(f"ESCAPED = False\n{attack}\nself.value = 42 if ESCAPED else {answer}\n", " " * 8)
    code = (
        "class Box:\n    def __init__(self):\n        self.value = 0\n\n    def act(self) -> dict:\n"
        f"        global ESCAPED\n{body}        return {{'success': True}}\n"
    )
    honest = "def check_func(final_state):\n    return final_state.get('value') == 42\n"
    hostile = "def check_func(final_state):\n    global ESCAPED\n" + textwrap.indent(
        f"ESCAPED = False\n{attack}\nreturn bool(ESCAPED) is True and ESCAPED is True\n", "    "
    )
    item = {"env_id": "box", "env_class_name": "Box", "env_class_code": code, "tools": [{"name": "act"}]}
    scenario = {"env_id": "box", "task_id": "box-1", "task": "Act.", "checklist_with_func": [
        {"check_item": "value", "check_func": honest if where == "tool" else hostile},
    ]}  # fmt: skip
    limits = SandboxLimits(timeout_s=TIMEOUT_S, memory_mb=512)
    config = EnvScalerConfig(limits=limits, check_timeout_s=TIMEOUT_S)
    return EnvScalerSuite({"box": item}, {"eval": [scenario]}, config=config)


def _grade_envscaler(where: str, attack: str, answer: str) -> float:
    suite = _envscaler_suite(attack, answer, where)
    try:
        episode = suite.episode(suite.tasks("eval")[0])
        episode.initial_messages()
        episode.step('{"tool": "act"}')
        return episode.result().reward
    finally:
        suite.close()


PATHS = [*CODE_PATHS, "envscaler_tool", "envscaler_check"]
NAMES = sorted(attacks(0, Path("/x")))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("path", PATHS)
def test_hostile_snippet_scores_zero_and_leaves_nothing(env, path: str, name: str) -> None:
    attack, answer = attacks(env["port"], env["victim"])[name]
    before = _sandbox_processes()
    if path.startswith("envscaler"):
        reward = _grade_envscaler(path.split("_")[1], attack, answer)
    else:
        reward = _grade_code(path, _program(attack, answer, PROBLEMS.get(path, PROBLEMS["humaneval"]).test_kind))
    left = _leftovers(env["victim"])
    try:
        conn, _ = env["server"].accept()
        conn.close()
        left.append("a connection reached the host's loopback")
    except BlockingIOError:
        pass
    alive = _sandbox_processes() - before
    contained = reward == 0.0 and not left and not alive
    RESULTS[(path, contained)] += 1
    assert reward == 0.0, f"{name} via {path}: forged verdict, reward {reward}"
    assert not left and not alive, f"{name} via {path}: leftovers {left}, processes {alive}"


def test_honest_programs_still_pass_on_every_path() -> None:
    for path in CODE_PATHS:
        kind = PROBLEMS.get(path, PROBLEMS["humaneval"]).test_kind
        assert _grade_code(path, _program("ESCAPED = True", "0", kind)) == 1.0, path
    for where in ("tool", "check"):
        assert _grade_envscaler(where, "ESCAPED = True", "0") == 1.0, where


def test_battery_counts() -> None:
    """Contained / tried per path (run after the battery; `pytest -s` shows the table)."""
    if not RESULTS:
        pytest.skip("the battery did not run in this session")
    for path in PATHS:
        ok, tried = RESULTS[(path, True)], RESULTS[(path, True)] + RESULTS[(path, False)]
        print(f"{path:24s} contained {ok}/{tried}")
        assert ok == tried
    assert sandbox_worker.__name__  # the worker module is what the processes run
