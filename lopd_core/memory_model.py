"""A memory model of one train step: what a step's peak is made of, from the backbone's shape and the step's.

    shape = StepShape(backbone=backbone_shape("Qwen3-8B"), method="lopd", tokens=16384, action_tokens=4096, ...)
    p = predict_step(shape)     # p.weights, p.step_peak_excluding_weights, p.total, p.parts (bytes)

The parts, for one step (the first: AdamW's moments are allocated at its end):
- weights: the backbone (the teacher and the composer's encoder; the LoRA student's base) and, in full fine-tuning,
  the student's own copy; under FSDP2 the student's layers are 1/W a rank, one layer gathered at a time; the root
  (the backbone) is gathered for the whole step (docs/distributed.md).
- activations kept for backward: floats per token per decoder layer, counted by `layer_activation_floats` on the
  model's own code (saved-tensor hooks on one decoder layer) for what takes a gradient there (every weight, LoRA
  adapters, or only the input: a frozen linear keeps no input), times the layers and the tokens of every pass that
  back-propagates: the student; LOPD's latent teacher (frozen, its gradient reaches the composer's latents) and the
  composer's encoder (LoRA) over J experiences. With gradient checkpointing a layer keeps its input ([T, d]) only.
  A teacher without a gradient (OPSD, SDFT, SDPO, Skill-SD, GRPO's reference) keeps its output hidden states.
- the fused loss head: `HEAD_BUFFERS` fp32 [chunk, V] buffers at its peak (measured by bench/loss_memory.py; more
  when the teacher takes a gradient), plus [N, d] hidden states and gradients.
- with checkpointing, one layer's activations rebuilt in its backward (the largest pass's). The head's backward
  runs before the layers', so the larger of the two counts, not both. (A layer's gradient temporaries stay within
  the model's error: adding half a layer's activations for them made the tiny backbone's 8k and 16k points worse.)
- on CPU, a LoRA student's first step's one-time allocations (`RUNTIME_FRACTION` of the backbone's weight bytes);
  on CUDA the context and the allocator's slack are left to the caller (bench/memory_projection.py keeps 3 GB).
- gradients and AdamW's two moments of the trainable weights (the parameter dtype; 1/W under FSDP2).
The step's peak is the larger of the backward's (kept activations + head or layer backward + gradients) and the
optimizer's (gradients + moments). Validated on CPU against bench/step_memory.py (docs/distributed.md).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

# fp32 [chunk, V] buffers live at the fused head's peak, by its teacher (bench/loss_memory.py at T = 4096, V = 49152,
# chunk 1024: 1.286 / 1.076 / 0.871 GB for lopd / opsd / grpo)
HEAD_BUFFERS = {"latent": 6.4, "frozen": 5.35, "none": 4.35}
# a LoRA student's first step's one-time allocations on CPU, per byte of backbone weights: 307 MiB stay after
# SmolLM2's first step beyond its gradients and AdamW moments, 0.6 of its 513 MiB of weights; a second step adds
# none, and a full student's first step keeps nothing beyond its tensors (cause not found)
RUNTIME_FRACTION = 0.6
MODEL_BUFFERS = 4  # [T, d] tensors per pass outside the decoder layers (embeddings, final norm, last hidden, gather)


@dataclass(frozen=True)
class BackboneShape:
    name: str
    layers: int
    hidden: int  # d
    intermediate: int
    vocab: int  # V
    params: int  # every weight, embeddings included
    # floats a decoder layer saves for backward per token (layer_activation_floats), by what takes a gradient:
    act_full: float  # every weight (a fully fine-tuned student)
    act_lora: float  # LoRA adapters on a frozen base (a LoRA student, the composer's encoder)
    act_frozen: float  # no weight, only the input (the latent teacher: its gradient reaches the composer's latents)

    def act(self, trainable: str) -> float:
        return {"all": self.act_full, "lora": self.act_lora, "none": self.act_frozen}[trainable]


# The published configurations (each model's config.json), for projections without the weights: `backbone_shape`
# counts their parameters on the meta device and their activations on one layer of transformers' code.
CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-4B": {"model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "tie_word_embeddings": True, "max_position_embeddings": 40960},
    "Qwen3-8B": {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                 "tie_word_embeddings": False, "max_position_embeddings": 40960},
    "SmolLM2-135M": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "tie_word_embeddings": True, "max_position_embeddings": 8192},
}  # fmt: skip


def hf_config(raw: dict[str, Any]) -> Any:
    """A transformers config from a config.json-like dict (its `model_type` picks the class)."""
    from transformers import AutoConfig

    raw = dict(raw)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def backbone_shape(name: str) -> BackboneShape:
    """The BackboneShape of a model in CONFIGS, without its weights."""
    if name not in CONFIGS:
        raise ValueError(f"unknown backbone {name!r} (known: {', '.join(CONFIGS)}); shape_of(model) reads a loaded one")
    return _backbone_shape(name)


@functools.cache
def _backbone_shape(name: str) -> BackboneShape:
    from transformers import AutoModelForCausalLM

    config = hf_config(CONFIGS[name])
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    acts = (layer_activation_floats(config.to_dict(), trainable) for trainable in ("all", "lora", "none"))
    return BackboneShape(name, config.num_hidden_layers, config.hidden_size, config.intermediate_size,
                         config.vocab_size, params, *acts)  # fmt: skip


@dataclass(frozen=True)
class StepShape:
    backbone: BackboneShape
    method: str  # lopd (latent teacher with a gradient), grpo (no teacher), any other: a frozen text teacher
    tokens: int  # T: the student's sequence (all records of the step together)
    action_tokens: int  # N: supervised tokens, the loss head's rows
    latent_tokens: int = 96  # J*K, in the latent teacher's sequence
    encoder_tokens: int = 3072  # J x encoder_max_tokens, the composer's encoder pass (LOPD)
    context_tokens: int | None = None  # the teacher's extra tokens over the student's (default: latent_tokens)
    student: str = "lora"  # lora | full
    trainable: int = 0  # the student's trainable parameters (LoRA: the adapter's; full: 0 = every weight)
    composer: int = 0  # the composer's trainable parameters (encoder LoRA + QFormer)
    checkpointing: bool = True
    dtype_bytes: int = 4  # weights and activations: 4 fp32, 2 bf16
    world_size: int = 1  # FSDP2 ranks (full fine-tuning); a LoRA student is replicated (DDP)
    chunk_size: int = 1024  # the fused head's positions per chunk
    device: str = "cpu"  # cpu: a first step's one-time allocations count (RUNTIME_FRACTION); cuda: they do not

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Prediction:
    parts: dict[str, float]  # bytes
    weights: float
    step_peak_excluding_weights: float  # what the step adds to memory at its peak

    @property
    def total(self) -> float:
        return self.weights + self.step_peak_excluding_weights


def _saved(s: StepShape, tokens: int, trainable: str | None) -> float:
    """Bytes one backbone pass over `tokens` keeps until its backward; `trainable` all | lora | none (only the
    input takes a gradient) | None (no gradient at all: only its output hidden states)."""
    b, bb = s.dtype_bytes, s.backbone
    out = MODEL_BUFFERS * tokens * bb.hidden * b
    if trainable is None:
        return out
    per_layer = bb.hidden if s.checkpointing else bb.act(trainable)  # checkpointing: each layer keeps its input
    return out + bb.layers * per_layer * tokens * b


def predict_step(s: StepShape) -> Prediction:
    """The step's memory by part (bytes; see the module docstring)."""
    if s.student not in ("lora", "full"):
        raise ValueError(f"student must be 'lora' or 'full', got {s.student!r}")
    if s.world_size < 1 or (s.world_size > 1 and s.student != "full"):
        raise ValueError("world_size > 1 models FSDP2, which shards a full student; LoRA students are replicated")
    b, bb, w = s.dtype_bytes, s.backbone, s.world_size
    layer_params = (bb.params - bb.vocab * bb.hidden) / bb.layers  # one decoder layer, roughly
    trainable = (s.trainable or (bb.params if s.student == "full" else 0)) / w  # full: every weight by default
    weights = bb.params * b  # the backbone (teacher, encoder; the LoRA student's base), gathered for the step
    if s.student == "full":
        weights += (bb.params / w + (layer_params if w > 1 else 0)) * b  # the student's shard + one gathered layer
    weights += 2 * s.composer * b  # the trainable composer and its frozen cold-start copy (the anchor)
    latent = s.method == "lopd"
    head = "none" if s.method == "grpo" else "latent" if latent else "frozen"
    teacher_tokens = s.tokens + (s.latent_tokens if s.context_tokens is None else s.context_tokens)
    student_mode = "all" if s.student == "full" else "lora"
    passes = [(s.tokens, student_mode)] + ([(teacher_tokens, "none"), (s.encoder_tokens, "lora")] if latent else [])
    parts = {
        "student_activations": _saved(s, s.tokens, student_mode),
        "teacher_activations": 0.0 if s.method == "grpo" else _saved(s, teacher_tokens, "none" if latent else None),
        "encoder_activations": _saved(s, s.encoder_tokens, "lora") if latent else 0.0,
        "loss_head": HEAD_BUFFERS[head] * min(s.chunk_size, s.action_tokens) * bb.vocab * 4
        + 4 * s.action_tokens * bb.hidden * b,
        "layer_rebuild": s.checkpointing * max(bb.act(mode) * n * b for n, mode in passes),
        "gradients": (trainable + s.composer) * b,
        "adamw_moments": 2 * (trainable + s.composer) * b,
        "runtime": RUNTIME_FRACTION * bb.params * b if s.device == "cpu" and s.student == "lora" else 0.0,
    }
    saved = parts["student_activations"] + parts["teacher_activations"] + parts["encoder_activations"]
    # the head's backward runs first, then the layers': their buffers are never alive together
    backward = saved + max(parts["loss_head"], parts["layer_rebuild"]) + parts["gradients"]
    optimizer = parts["gradients"] + parts["adamw_moments"]
    return Prediction(parts, weights, max(backward, optimizer) + parts["runtime"])


def largest_tokens(s: StepShape, budget_bytes: float, action_fraction: float = 0.25) -> int:
    """The longest T (a multiple of 1024) whose predicted total fits `budget_bytes`; 0 when none does."""
    best, t = 0, 1024
    while t <= 1 << 20:
        shape = replace(s, tokens=t, action_tokens=int(t * action_fraction))
        if predict_step(shape).total > budget_bytes:
            break
        best, t = t, t + 1024
    return best


# ------------------------------------------------------------------------------------------ measured inputs


def shape_of(model: torch.nn.Module) -> BackboneShape:
    """The BackboneShape of a loaded Hugging Face causal LM (its activations counted on one of its layers)."""
    c = model.config  # type: ignore[attr-defined]
    return BackboneShape(
        name=getattr(c, "_name_or_path", "") or c.model_type, layers=c.num_hidden_layers, hidden=c.hidden_size,
        intermediate=c.intermediate_size, vocab=c.vocab_size, params=sum(p.numel() for p in model.parameters()),
        **dict(zip(("act_full", "act_lora", "act_frozen"),
                   (layer_activation_floats(c.to_dict(), t) for t in ("all", "lora", "none")), strict=True)),
    )  # fmt: skip


def layer_activation_floats(
    config: dict[str, Any], trainable: str = "all", lengths: tuple[int, int] = (128, 256)
) -> float:
    """Floats per token that one decoder layer saves for backward, counted on transformers' own code: a one-layer
    copy of the model (a 64-token vocabulary) runs forward at two lengths under saved-tensor hooks; the count is the
    slope of the distinct storages' bytes (weights and per-model buffers cancel). `trainable`: all (every weight
    takes a gradient), lora (our LoRA adapters, `LoraSpec()`, on a frozen base) or none (only the input does)."""
    if trainable not in ("all", "lora", "none"):
        raise ValueError(f"trainable must be all, lora or none, got {trainable!r}")
    return _layer_activation_floats(json.dumps(config, sort_keys=True, default=str), trainable, lengths)


@functools.cache
def _layer_activation_floats(config_json: str, trainable: str, lengths: tuple[int, int]) -> float:
    from transformers import AutoModelForCausalLM

    config = hf_config(json.loads(config_json))
    config.num_hidden_layers, config.vocab_size = 1, 64
    config.layer_types = getattr(config, "layer_types", None) and config.layer_types[:1]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if trainable != "all":
        model.requires_grad_(False)
    if trainable == "lora":
        from lopd_core.adapters import add_lora
        from lopd_core.config import LoraSpec

        add_lora(model, "student", LoraSpec())
    counts = []
    for n in lengths:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return t

        embeds = torch.randn(1, n, config.hidden_size, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.model(inputs_embeds=embeds, attention_mask=torch.ones(1, n, dtype=torch.long), use_cache=False)
        counts.append(sum(seen.values()))
    return (counts[1] - counts[0]) / (lengths[1] - lengths[0]) / 4


# ------------------------------------------------------------------------------------------ measuring a peak


class PeakMemory:
    """The peak memory a block adds above what was live when it began, in bytes (`.peak` after the block).

    CUDA: `max_memory_allocated` minus `memory_allocated` at the start. CPU (Linux): the resident high-water mark
    (VmHWM) is reset at the start (`/proc/self/clear_refs`), so the figure is the block's own peak resident set
    minus the resident set at its start, whatever the process held before (ru_maxrss alone would hide a block
    that peaks below an earlier high-water mark, e.g. a model conversion)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device, self.peak = device, 0

    def __enter__(self) -> PeakMemory:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._base = _proc_status("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self.peak = _proc_status("VmHWM") - self._base


def measuring_env() -> dict[str, str]:
    """The environment for a child process that measures with PeakMemory on CPU: glibc serves every allocation
    over 64 KiB by mmap and returns it on free, so the resident high-water mark follows live memory, not heap
    fragmentation (without it the same run's peak varies by ~60 MB)."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}: PeakMemory measures CPU memory on Linux only")
