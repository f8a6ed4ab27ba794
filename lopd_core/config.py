"""Every hyperparameter of the method in one visible place, with the paper's defaults (app. A.1, §3.3, §4.1).

    cfg = LOPDConfig()                              # paper defaults
    cfg = LOPDConfig.from_yaml("configs/cpu.yaml")  # YAML overrides; unknown or bad fields are errors
    cfg = LOPDConfig(top_m=10)                      # keyword overrides

Where the paper is silent, the value is ours and the field's comment says so.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """`data["a"]["b"] = value` for `dotted="a.b"`, creating mappings on the way (a null one included)."""
    keys = dotted.split(".")
    node = data
    for i, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ValueError(f"override {dotted!r}: {'.'.join(keys[: i + 1])} is {child!r}, not a mapping")
        node = child
    node[keys[-1]] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.path=value` overrides onto a mapping, in place. Values are YAML: numbers, booleans, lists, mappings,
    null (also an empty value), strings. The one parser of every CLI (`lopd`, `python -m components.<stage>`)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not key=value (e.g. train.schedule.steps=3)")
        set_dotted(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return data


MethodName = Literal["lopd", "opsd", "sdft", "sdpo", "skill_sd", "grpo"]  # registry: lopd_core.methods.METHODS


def explain(exc: ValidationError, model: type[BaseModel]) -> str:
    """A pydantic error as one line per field (`lopd.top_m: Input should be ...`), without pydantic's URLs, and
    with "did you mean" for an unknown field that is close to a real one (`train.schedule.stepz` -> steps)."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        line = f"  {'.'.join(loc) or '(root)'}: {err['msg']}"
        if err["type"] == "extra_forbidden":
            fields = _fields_at(model, loc[:-1])
            close = difflib.get_close_matches(loc[-1], fields, n=1, cutoff=0.6)
            if close:
                line += f" (did you mean {'.'.join([*loc[:-1], close[0]])!r}?)"
        lines.append(line)
    return "\n".join(lines)


def _fields_at(model: type[BaseModel], path: list[str]) -> list[str]:
    """Field names of the (nested) model at `path`; [] where the path leaves the models."""
    current: Any = model
    for part in path:
        info = getattr(current, "model_fields", {}).get(part)
        annotation = getattr(info, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        current = annotation
    return list(getattr(current, "model_fields", {}))


LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> Any:
        """Load from a YAML mapping (a missing file or a bad field is an error naming it)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of field: value, got {type(data).__name__}")
        data.update(overrides)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"{path}: invalid {cls.__name__}:\n{explain(exc, cls)}") from None

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self, prefix: str = "") -> dict[str, Any]:
        """Flattened `a.b: value` dict (for experiment trackers)."""
        out: dict[str, Any] = {}
        for key, value in self.model_dump(mode="json").items():
            _flatten(out, f"{prefix}{key}", value)
        return out


def _flatten(out: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(out, f"{key}.{k}", v)
    else:
        out[key] = value


class LoraSpec(StrictModel):
    r: int = Field(16, ge=1)  # ours: the paper does not state the LoRA rank
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = LLAMA_LORA_TARGETS


class BaselineConfig(StrictModel):
    """Knobs of the baselines (lopd_core.methods); LOPD ignores them."""

    clip_eps: float = Field(0.2, gt=0)  # GRPO's clipped ratio (PPO)
    kl_coef: float = Field(0.0, ge=0)  # GRPO's k3 KL to the reference policy (DeepSeekMath used 0.04)
    ppo_epochs: int = Field(1, ge=1)  # GRPO updates per batch (the clip is active from the second)
    teacher_sync: Literal["default", "frozen", "ema"] = "default"  # default: the method's own (methods.py)
    teacher_ema_rate: float = Field(0.01, gt=0, le=1)  # EMA teacher <- (1 - a) teacher + a student


class ScheduleConfig(StrictModel):
    """The outer loop of Algorithm 1. Reference config: 100 steps of 32 tasks (smaller presets for CPU)."""

    steps: int = Field(100, ge=1)
    tasks_per_step: int = Field(32, ge=1)
    samples_per_task: int = Field(1, ge=1)  # rollouts per task per step: GRPO's group G, SDPO's siblings
    checkpoint_every: int = Field(10, ge=1)


class ColdStartConfig(StrictModel):
    """Composer cold-start (app. A.2): NLL of successful trajectories, backbone frozen, latents in the input.

    The paper sets data size and steps per domain without stating them; the clip values are the reference
    config's (QFormer 30.0, LoRA 3.0; the paper states one value, 3.0).
    """

    steps: int = Field(200, ge=0)  # ours
    batch_size: int = Field(8, ge=1)  # ours
    lr: float = Field(1e-4, gt=0)  # ours: the paper does not state it
    weight_decay: float = Field(0.01, ge=0)
    grad_clip_lora: float = Field(3.0, gt=0)
    grad_clip_qformer: float = Field(30.0, gt=0)


class SFTConfig(StrictModel):
    """The warm start (sft stage): next-token NLL of verified demonstrations, every weight trained.

    Not in the paper (its students start from instruction-tuned models); here it turns a from-scratch student
    into one whose held-out success leaves room to improve in both directions. Values: ours, chosen on the
    validation slice of the training split (configs/study-cpu.yaml says how).
    """

    steps: int = Field(600, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # cosine decay to lr * min_lr_ratio after a linear warmup
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    n_demonstrations: int | None = Field(None, ge=1)  # a seeded sample of the training tasks; None = all
    pool_per_level: int = Field(0, ge=0)  # toolworld: extra generator scenarios per environment and level
    answer: str = "Done."  # the final assistant turn that closes a demonstration
    copy_pretrain_steps: int = Field(0, ge=0)  # from-scratch students: synthetic copying first (lopd_core.sft)
    copy_batch_size: int = Field(0, ge=0)  # synthetic copying sequences added to every sft step (0 = none)
    copy_span: int = Field(16, ge=1)  # tokens repeated in a copying sequence
    seed: int = 0


class LOPDConfig(StrictModel):
    method: MethodName = "lopd"
    # ---- composer (§3.2, app. A.1)
    n_retrieved: int = Field(3, ge=1)  # J
    # ours: the train stage refuses LOPD on a bank with fewer entries (None: n_retrieved, J, the fewest that can
    # fill a retrieval's J slots); 0 allows an empty bank, whose teacher then reads only the composer's
    # "no past trajectory" placeholder items (counted per step as n_placeholder_experiences)
    min_bank_size: int | None = Field(None, ge=0)
    n_queries: int = Field(32, ge=1)  # K latent tokens per retrieved experience
    qformer_layers: int = Field(8, ge=1)  # one block, weights shared across depth
    qformer_ff_mult: int = Field(4, ge=1)
    encoder_max_tokens: int = Field(1024, ge=16)  # ours: longer framed experiences are cut and counted
    encoder_lora: LoraSpec = LoraSpec()
    # ---- student
    student_mode: Literal["lora", "full"] = "lora"  # full: a separate frozen teacher copy is kept
    student_lora: LoraSpec = LoraSpec()
    # ---- objective (eq. 9-13)
    top_m: int = Field(20, ge=1)  # M
    kl_support: Literal["teacher", "student"] = "teacher"  # whose top-M ids form the support S
    tail_floor: float | None = Field(None, lt=0)  # None: exact tail (eq. 9); -1e-7: the reference code's clamp
    margin_target: float = 0.05  # m
    anchor_weight: float = Field(0.2, ge=0)  # lambda
    anchor_reduction: Literal["sum", "mean"] = "sum"  # sum = paper's squared L2; mean = reference code
    freeze_composer: bool = False  # keep the cold-start composer fixed (fig. 3's "frozen composer" ablation)
    dual_lr: float = Field(0.5, ge=0)  # eta_beta
    beta_init: float = Field(0.0, ge=0)  # beta_0
    # the A in Delta: "verdict" A = 2r - 1 (§3.3); "centered" subtracts the batch mean of A (ours, an option):
    # with mostly failures a teacher that is uniformly worse than the student satisfies the verdict margin
    margin_advantage: Literal["verdict", "centered"] = "verdict"
    # token: every term token-weighted over the batch (eq. 10, 12); record: the mean over records of per-record
    # means; reference: as bingreeky/LOPD's code, the student side token-weighted and the composer side (KL and
    # Delta as the composer sees them) per-record means. The dual step always uses eq. 12's token-weighted Delta.
    loss_normalization: Literal["token", "record", "reference"] = "token"
    # ---- optimisation: one AdamW step over two parameter groups (Algorithm 1)
    student_lr: float = Field(1e-5, gt=0)  # ours: the paper does not state it
    composer_lr: float = Field(1e-5, gt=0)  # lr_phi
    weight_decay: float = Field(0.01, ge=0)  # PyTorch's AdamW default, as in the reference code
    # gradient clipping: the paper is silent for training; the reference code clips the student at
    # training.grad_clip = 1.0 and the composer (QFormer + encoder LoRA) jointly at the same 1.0
    grad_clip_student: float = Field(1.0, gt=0)
    composer_clip: Literal["joint", "per_group"] = "joint"
    grad_clip_composer: float = Field(1.0, gt=0)  # joint: one norm over every composer parameter
    grad_clip_lora: float = Field(3.0, gt=0)  # per_group: the encoder LoRA (the reference's cold-start value)
    grad_clip_qformer: float = Field(30.0, gt=0)  # per_group: the QFormer (the reference's cold-start value)
    # ---- sequences and compute
    max_seq_len: int = Field(40_960, ge=64)  # longer views are counted and left out of the loss
    fail_on_overlength: bool = False  # raise instead of skipping over-length sequences
    # activation checkpointing of every decoder layer (student, teacher and encoder passes; the adapter a layer ran
    # with is replayed, lopd_core.adapters): "auto" turns it on for a step whose longest view has at least
    # gradient_checkpointing_min_len tokens (the paper's lengths), off for shorter ones; true/false: always/never
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    gradient_checkpointing_min_len: int = Field(2048, ge=1)  # ours: where the saved activations start to dominate
    head_chunk_size: int = Field(1024, ge=1)  # positions per chunk of the fused loss head
    seed: int = 0
    baseline: BaselineConfig = BaselineConfig()

    @property
    def n_latents(self) -> int:
        """J*K: the length of the teacher's placeholder span."""
        return self.n_retrieved * self.n_queries
