"""Sandbox workers for EnvScaler episodes: the helpers that run inside a worker (`_ENV_HELPERS`: environment
instances, one slot per episode, states as plain data, the check runner) and `WorkerPool`, which hands workers
to episodes (a fresh one per episode, or one shared by several episodes of trusted code)."""

from __future__ import annotations

from dataclasses import dataclass

from lopd_core.sandbox import Sandbox, SandboxError, SandboxLimits

# The worker-side helpers (trusted code executed inside the sandbox). Environment instances live in `_lopd_envs`,
# one slot per episode. A class is loaded once per worker, as module lopd_env_<digest of its source>. States leave
# the worker as plain data (`_lopd_plain`: attributes that are not plain data become their `vars()` or repr),
# so the checks, in their own sandbox, read a JSON copy of the state and never an object the episode touched.
_ENV_HELPERS = r"""
import copy as _copy, hashlib as _hashlib, json as _json, sys as _sys, types as _types

_lopd_envs = {}
_lopd_modules = {}

def _lopd_load(code, class_name):
    key = _hashlib.sha256(code.encode()).hexdigest()[:16]
    module = _lopd_modules.get(key)
    if module is None:
        module = _types.ModuleType("lopd_env_" + key)
        _sys.modules[module.__name__] = module
        exec(compile(code, "<env_class_code>", "exec"), module.__dict__)
        _lopd_modules[key] = module
    if not hasattr(module, class_name):
        raise ValueError(f"class {class_name!r} not found in env_class_code")
    return getattr(module, class_name)

def _lopd_plain(value, depth=0):
    if depth > 100:
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return value
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_lopd_plain(v, depth + 1) for v in value]
        kind = list if isinstance(value, list) else tuple if isinstance(value, tuple) else type(value)
        try:
            return kind(items) if kind in (list, tuple) else (frozenset if isinstance(value, frozenset) else set)(items)
        except TypeError:
            return items
    if isinstance(value, dict):
        return {_lopd_plain(k, depth + 1): _lopd_plain(v, depth + 1) for k, v in value.items()}
    if hasattr(value, "__dict__"):
        return _lopd_plain(dict(vars(value)), depth + 1)
    return repr(value)

def _lopd_state(obj):
    state = {k: v for k, v in vars(obj).items() if not (k.startswith("__") and k.endswith("__"))}
    return _lopd_plain(state)

def _lopd_init(slot, code, class_name, init_config):
    cls = _lopd_load(code, class_name)
    config = _copy.deepcopy(init_config)
    try:
        env = cls(config if config and isinstance(config, dict) else {})
    except TypeError:
        env = cls()
    for key, value in (init_config or {}).items():
        setattr(env, key, _copy.deepcopy(value))
    _lopd_envs[slot] = env
    return _lopd_state(env)

def _lopd_restore(slot, code, class_name, state):
    cls = _lopd_load(code, class_name)
    env = cls.__new__(cls)
    for key, value in state.items():
        setattr(env, key, value)
    _lopd_envs[slot] = env
    return True

def _lopd_call(slot, name, arguments):
    env = _lopd_envs[slot]
    method = getattr(env, name, None) if not name.startswith("_") else None
    if not callable(method):
        raise AttributeError(f"the environment has no tool {name!r}")
    result = method(**arguments)
    try:
        text = _json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        text = str(result)
    return {"observation": str(text), "state": _lopd_state(env)}

def _lopd_drop(slot):
    _lopd_envs.pop(slot, None)
    return True

def _lopd_check(func_code, initial_state, final_state):
    namespace = {"__builtins__": __builtins__, "initial_state": initial_state}
    exec(compile(func_code, "<check_func>", "exec"), namespace)
    if "check_func" not in namespace:
        return {"result": None, "error": "function 'check_func' not found"}
    result = namespace["check_func"](final_state)
    if type(result) is not bool:
        return {"result": None, "error": f"check_func returned {type(result).__name__}, not bool"}
    return {"result": result, "error": None}
"""


@dataclass
class _Host:
    """A sandbox worker and the episodes it hosts (`users` now, `hosted` over its life)."""

    box: Sandbox
    hosted: int = 0
    users: int = 0
    retired: bool = False
    helpers_pid: int | None = None  # the worker process that has the helpers loaded


class WorkerPool:
    """Sandbox workers handed to episodes: a fresh one per episode (`per_worker=1`), or one shared by up to
    `per_worker` episodes over its life, then replaced (closed once its last episode has let go)."""

    def __init__(self, limits: SandboxLimits, per_worker: int = 1) -> None:
        self.limits = limits
        self.per_worker = per_worker
        self._current: _Host | None = None

    def acquire(self) -> _Host:
        host = self._current
        if host is None or host.hosted >= self.per_worker:
            if host is not None:
                host.retired = True
                self._close_if_idle(host)
            host = self._current = _Host(Sandbox(self.limits))
            host.box.spawn()  # it comes up while the model writes its first turn
        host.hosted += 1
        host.users += 1
        return host

    def release(self, host: _Host) -> None:
        host.users -= 1
        if host.retired or self.per_worker == 1:
            host.retired = True
            self._close_if_idle(host)

    def ready(self, host: _Host) -> int | None:
        """Start the worker if needed and load the helpers once per worker process; its pid, None on failure."""
        try:
            pid = host.box.start().pid
        except SandboxError:
            return None
        if host.helpers_pid != pid:
            setup = host.box.exec(_ENV_HELPERS, filename="<lopd-env-helpers>")
            if not setup.ok:
                return None
            host.helpers_pid = pid
        return pid

    def _close_if_idle(self, host: _Host) -> None:
        if host.users <= 0:
            host.box.close()
            if self._current is host:
                self._current = None

    def close(self) -> None:
        if self._current is not None:
            self._current.box.close()
            self._current = None
