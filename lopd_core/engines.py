"""The one place that turns `rollout.engine` into a rollout engine, above both engines.

    with make_engine(model, tokenizer, config) as engine:   # "hf": RolloutEngine, "vllm": VllmRolloutEngine
        trajectories = engine.run(episodes)
        ...optimizer step...
        engine.sync(model)                                  # HF: nothing to do; vLLM: the new weights, in place

`lopd_core.rollout` (the HF engine) and `lopd_core.vllm_engine` (which builds on it) never import this module,
so the import arrows run one way: engines -> vllm_engine -> rollout. The vLLM modules load only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lopd_core.config import RolloutConfig
from lopd_core.rollout import RolloutEngine
from lopd_core.serialization import ChatSerializer

if TYPE_CHECKING:
    from lopd_core.vllm_engine import VllmServer


def make_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config: RolloutConfig | None = None,
    serializer: ChatSerializer | None = None,
    server: VllmServer | None = None,
) -> RolloutEngine:
    """The engine that `config.engine` names. A vLLM engine starts a worker process (close it, or use the engine
    as a context manager) unless given a shared `server` (`make_server`); an HF engine ignores `server`."""
    config = config or RolloutConfig()
    if config.engine == "vllm":
        from lopd_core.vllm_engine import VllmRolloutEngine

        return VllmRolloutEngine(model, tokenizer, config, serializer, server=server)
    return RolloutEngine(model, tokenizer, config, serializer)


def make_server(model: PreTrainedModel, config: RolloutConfig, max_model_len: int, seed: int) -> Any:
    """A vLLM worker that several engines share (e.g. every benchmark of one evaluation); None for "hf", whose
    engines share nothing. Close it after its last engine."""
    if config.engine != "vllm":
        return None
    from lopd_core.vllm_engine import VllmServer

    return VllmServer(model, max_model_len=max_model_len, seed=seed, enforce_eager=not config.vllm_compile,
                      kv_cache_bytes=config.vllm_kv_cache_mb << 20)  # fmt: skip
