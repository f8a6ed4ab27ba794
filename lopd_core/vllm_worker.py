"""The vLLM worker process: one `vllm.LLM` serving token-id requests for `lopd_core.vllm_engine` over a socket.

It runs in vLLM's own virtual environment (`.venv-vllm`, built by `make venv-vllm`), whose transformers pin
differs from the project's, so it imports nothing from `lopd_core`: only the standard library, torch,
safetensors and vllm. It is started as a script (`python -P vllm_worker.py FD`), FD being one end of a socket
pair; messages are pickled dicts (`multiprocessing.connection`), between two processes of the same user.

Operations: "init" (build the engine from a Hugging Face folder), "generate" (token ids in, token ids and
sampled-token logprobs out), "load" (new weights from a safetensors file, in place: no restart), "logprobs"
(prompt logprobs of fixed sequences, for the sync check) and "close". vLLM's engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so closing the socket or killing this process ends all of it.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _reload(worker: Any, path: str) -> float:
    """Load the tensors in `path` into the running model in place (vLLM's layer-wise reload, which redoes
    the CPU kernels' weight packing), then re-pack tied embedding/LM-head GEMMs, which the reload skips."""
    import torch
    from safetensors.torch import load_file

    t0 = time.perf_counter()
    tensors = load_file(path)
    worker.reload_weights(weights_iterator=iter(tensors.items()))
    model = worker.model_runner.get_model()
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            for module in model.modules():
                if isinstance(module, VocabParallelEmbedding) and hasattr(module, "cpu_linear"):
                    weight = getattr(module, "weight", None)
                    if isinstance(weight, torch.Tensor) and weight.numel():
                        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    except ImportError:
        pass
    return time.perf_counter() - t0


class Worker:
    def __init__(self) -> None:
        self.llm: Any = None

    def init(self, msg: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        from vllm import LLM

        kwargs = dict(
            model=msg["model"],
            dtype=msg.get("dtype", "float32"),
            seed=int(msg.get("seed", 0)),
            enforce_eager=bool(msg.get("enforce_eager", True)),
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            max_model_len=int(msg["max_model_len"]),
            kv_cache_memory_bytes=int(msg["kv_cache_bytes"]),
        )
        kwargs.update(msg.get("extra", {}))
        self.llm = LLM(**kwargs)
        # One token through the model: kernels that reject the model (e.g. a head size the CPU attention has
        # no kernel for) fail here, at start, rather than in the first rollout.
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        probe = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], probe, use_tqdm=False)
        import vllm

        return {"seconds": time.perf_counter() - t0, "version": vllm.__version__}

    def generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in msg["prompts"]]
        params = [
            SamplingParams(
                max_tokens=int(p["max_tokens"]),
                temperature=float(p["temperature"]),
                top_p=float(p["top_p"]),
                seed=p.get("seed"),
                stop_token_ids=list(p["stop_token_ids"]),
                ignore_eos=True,  # stops come from stop_token_ids only (the tokenizer is not loaded here)
                logprobs=0,  # the sampled token's logprob, from the raw (untempered) logits
                detokenize=False,
            )
            for p in msg["params"]
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=False)]
            results.append({"token_ids": ids, "logprobs": lps, "finish_reason": c.finish_reason})
        return {"outputs": results}

    def load(self, msg: dict[str, Any]) -> dict[str, Any]:
        seconds = self.llm.collective_rpc(_reload, args=(msg["path"],))
        self.llm.reset_prefix_cache()  # cached keys/values belong to the old weights
        return {"seconds": max(seconds)}

    def logprobs(self, msg: dict[str, Any]) -> dict[str, Any]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in msg["sequences"]], sp, use_tqdm=False)
        result = []
        for seq, out in zip(msg["sequences"], outs, strict=True):
            result.append([float(d[seq[i]].logprob) for i, d in enumerate(out.prompt_logprobs) if d is not None])
        return {"logprobs": result}


def main(fd: int) -> int:
    import socket

    conn = Connection(socket.socket(fileno=fd).detach())
    worker = Worker()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        op = msg.get("op")
        if op == "close":
            conn.send({"ok": True})
            return 0
        try:
            reply = getattr(worker, op)(msg)
            reply["ok"] = True
        except BaseException as exc:  # every failure goes back to the caller, with its traceback
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        conn.send(reply)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
