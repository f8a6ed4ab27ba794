"""BFCL-v3 multi-turn as a suite: the `nvidia-bfcl` package's tasks, backend classes and checker.

Four subsets of 200 tasks each (the ones the LOPD paper averages):
- `base`: every user turn can be fulfilled with the documented functions;
- `miss_func`: some functions are held out of the system prompt; the turn whose request needs them has no
  ground-truth call, and an extra user turn (empty in BFCL's data) reveals them at the turn BFCL names;
- `miss_param`: a request lacks a value; its turn has no ground-truth call and the next user turn gives it;
- `long_context`: the base requests with the backends loaded in long-context mode (large directories, long
  files and records, long tool outputs).
Every task is split "eval": BFCL tasks must never enter a training bank.

An episode plays the user turns in order. Assistant actions use the shared format (`lopd_core.envs.actions`):
calls are executed against fresh instances of the package's backend classes with the package's own
`execute_multi_turn_func_call`, and their results come back as tool messages; an action without a call ends the
current user turn (the next user turn follows, or the episode is done after the last one). `result()` runs the
package's `multi_turn_checker` over the calls executed per turn: after every turn with ground-truth calls, the
state of every backend instance must equal the ground-truth instance's state (public attributes) and every
ground-truth call's result must appear among the results of the model's calls so far (an unordered
multiset check). Reward is 1.0 when it passes, else 0.0.

BFCL caches backend instances in a module-level dict keyed by model name and task id, so each episode and
each `result()` call uses its own unique model name, deep-copies the instances it creates (long-context
TravelAPI shares module-level dicts between instances) and removes its cache entries when it no longer
needs them.

The package is imported lazily; install it with `pip install --no-deps nvidia-bfcl==26.3 mpmath`.

The package, one job per module:

* `package`: the `bfcl` package's parts the adapter uses, imported lazily, and its backend-instance cache;
* `data`: BFCL's data files (tasks, ground truth, function docs as JSON schemas);
* `calls`: call strings (JSON actions to BFCL calls, the ground truth back to tool calls) and check summaries;
* `episode`: `BFCLEpisode`, one task played turn by turn and checked by BFCL's checker;
* `suite`: `BFCLSuite`, the tasks of the four subsets and their episodes.
"""

from lopd_core.envs.bfcl.episode import MAX_STEPS_PER_TURN, REVEAL_PROMPT, SYSTEM_PROMPT, BFCLEpisode
from lopd_core.envs.bfcl.package import INSTALL_HINT, SUITE_NAME
from lopd_core.envs.bfcl.package import _package as _package
from lopd_core.envs.bfcl.suite import SUBSETS, BFCLSuite

__all__ = [
    "INSTALL_HINT",
    "MAX_STEPS_PER_TURN",
    "REVEAL_PROMPT",
    "SUBSETS",
    "SUITE_NAME",
    "SYSTEM_PROMPT",
    "BFCLEpisode",
    "BFCLSuite",
]
