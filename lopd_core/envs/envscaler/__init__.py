"""EnvScaler-format suites: environments as Python class source + tool schemas + rules, scenarios with checks.

The same loader reads the built-in `toolworld` suite (shipped data files) and real EnvScaler files:

* environment items (`191_env_metadata.json`): a JSON object keyed by env_id (or a list) of
  `{"env_id", "environment_introduction", "constraints_rules", "env_class_name", "env_class_code", "tools", ...}`;
  `tools` in the OpenAI layout, flat, or as a JSON string;
* scenario items (a JSON list): `{"env_id", "env_class_name", "task_id", "init_config", "task",
  "checklist_with_func": [{"check_item", "check_func"}], ...}`.

An episode follows EnvScaler's non-conversational environment: the initial observation is the task; each
assistant turn calls tools (observations come back as "tool" messages) or answers without a call, which
ends the episode. The reward is computed as EnvScaler does: every check function runs on the initial and
final state, reward = (number of checks returning True) / (number of checks), rounded to 4 places; a check
that raises, returns a non-bool, times out, crashes or tries a forbidden operation counts as failed.

Dataset code never runs in this process: each episode has one sandboxed worker holding the environment
instance and, at the end, a second fresh worker running the checks (`lopd_core.sandbox`). States travel
between them as plain data (JSON values, `lopd_core.sandbox_worker.encode`): a check reads a copy of the
state, never an object the environment's code could have rigged (an `__eq__` that always holds, say). Parse
errors, unknown tools, bad arguments, tool exceptions and tool timeouts become observations and are counted.

Starting a worker costs ~70 ms of CPU (a fresh interpreter that preloads the standard library), twice per
episode. For a suite whose code is trusted (the built-in toolworld suite: our own classes, checked against
their generator), `episodes_per_worker > 1` lets one worker host many episodes, each in its own slot of the
worker's namespace: the trainer stays isolated from the code, episodes are no longer isolated from each other.
Keep the default of 1 for files you did not write.

`prompt="compact"` shows the tools as signatures (`transfer(from_account_id, to_account_id, amount)`) without
descriptions, rules or examples, and the task without the call cue: ~50 tokens instead of ~500, for small
students that learn the format from demonstrations (the study testbed).

The package, one job per module:

* `config`: `EnvScalerConfig`, the suite's knobs;
* `loading`: environment and scenario items from files or loaded JSON, and a seeded train/eval split;
* `prompts`: the system message (full, compact or minimal);
* `workers`: the helpers that run inside a sandbox worker and the pool handing workers to episodes;
* `episode`: `EnvScalerEpisode`, one scenario played through text actions and scored by its checks;
* `suite`: `EnvScalerSuite`, tasks per split and their episodes.
"""

from lopd_core.envs.envscaler.config import PROMPT_STYLES, EnvScalerConfig
from lopd_core.envs.envscaler.episode import ERROR_EVENTS, EnvScalerEpisode
from lopd_core.envs.envscaler.loading import load_env_items, load_scenarios, split_scenarios
from lopd_core.envs.envscaler.prompts import compact_system_prompt, system_prompt
from lopd_core.envs.envscaler.suite import EnvScalerSuite
from lopd_core.envs.envscaler.workers import WorkerPool

__all__ = [
    "ERROR_EVENTS",
    "PROMPT_STYLES",
    "EnvScalerConfig",
    "EnvScalerEpisode",
    "EnvScalerSuite",
    "WorkerPool",
    "compact_system_prompt",
    "load_env_items",
    "load_scenarios",
    "split_scenarios",
    "system_prompt",
]
