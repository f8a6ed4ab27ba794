"""The `nvidia-bfcl` package, imported lazily (`_package()`; a clear install hint when it is missing): its data
directory, function-doc files, backend classes, `execute_multi_turn_func_call` and checker, and the handling of
BFCL's module-level cache of backend instances (private deep copies per episode, released by model name)."""

from __future__ import annotations

import copy
import functools
import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

SUITE_NAME = "bfcl-v3"
INSTALL_HINT = "pip install --no-deps nvidia-bfcl==26.3 mpmath"


class _Package:
    """Handles on the parts of `bfcl` the adapter uses."""

    def __init__(self) -> None:
        try:
            import bfcl
            import mpmath  # noqa: F401  (the MathAPI backend needs it)
            from bfcl.constant import MULTI_TURN_FUNC_DOC_FILE_MAPPING
            from bfcl.eval_checker.multi_turn_eval import multi_turn_checker, multi_turn_utils
            from bfcl.model_handler.constant import DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC
        except ImportError as exc:
            raise ImportError(
                f"The {SUITE_NAME} suite needs the nvidia-bfcl package (module `bfcl`) and mpmath: {INSTALL_HINT}"
            ) from exc
        self.data_dir = Path(bfcl.__file__).parent / "data"
        self.func_doc_files: dict[str, str] = dict(MULTI_TURN_FUNC_DOC_FILE_MAPPING)
        self.utils: ModuleType = multi_turn_utils
        self.checker: ModuleType = multi_turn_checker
        self.reveal_sentence: str = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC

    def backend_class(self, class_name: str) -> type:
        module = importlib.import_module(self.utils.CLASS_FILE_PATH_MAPPING[class_name])
        return getattr(module, class_name)

    def execute(self, calls: list[str], entry: dict[str, Any], model_name: str, eval_run: bool) -> list[str]:
        results, _ = self.utils.execute_multi_turn_func_call(
            func_call_list=calls,
            initial_config=entry["initial_config"],
            involved_classes=entry["involved_classes"],
            model_name=model_name,
            test_entry_id=entry["id"],
            long_context=_is_long_context(entry["id"]),
            is_evaL_run=eval_run,
        )
        return results

    def create_isolated(self, entry: dict[str, Any], model_name: str, eval_run: bool) -> None:
        """Create the backend instances BFCL will find under `model_name`, each a private deep copy."""
        self.execute([], entry, model_name, eval_run)
        prefix = f"{model_name}{'_eval' if eval_run else ''}_{entry['id']}_"
        cache = vars(self.utils)  # list(cache) snapshots the keys at once, so other threads' episodes may run
        for key in [k for k in list(cache) if k.startswith(prefix) and k.endswith("_instance")]:
            cache[key] = copy.deepcopy(cache[key])

    def release(self, model_name: str) -> None:
        """Drop every cached backend instance whose model name starts with `model_name`."""
        cache = vars(self.utils)
        for key in [k for k in list(cache) if k.startswith(model_name + "_") and k.endswith("_instance")]:
            cache.pop(key, None)


@functools.cache
def _package() -> _Package:
    return _Package()


def _is_long_context(task_id: str) -> bool:
    category = task_id.rsplit("_", 1)[0]
    return "long_context" in category or "composite" in category  # as in BFCL's handlers and checker
