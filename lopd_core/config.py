"""Every hyperparameter of the method in one visible place, with the paper's defaults (app. A.1, §3.3, §4.1).

    cfg = LOPDConfig()                              # paper defaults
    cfg = LOPDConfig.from_yaml("configs/cpu.yaml")  # YAML overrides; unknown or bad fields are errors
    cfg = LOPDConfig(top_m=10)                      # keyword overrides

Where the paper is silent, the value is ours and the field's comment says so.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.json_schema import SkipJsonSchema

ModelT = TypeVar("ModelT", bound=BaseModel)


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


MethodName = Literal[
    "lopd", "opsd", "sdft", "sdpo", "skill_sd", "grpo", "diffgate", "diffgate_latent", "scope"
]  # registry: lopd_core.methods.METHODS, rules: lopd_core.method_rules


def load_model(
    cls: type[ModelT],
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    what: str | None = None,
    missing_hint: str = "",
    updates: dict[str, Any] | None = None,
) -> ModelT:
    """`cls` from a YAML/JSON mapping file (optional) plus `key=value` overrides: the one loader of configs and
    specs. A missing file, a non-mapping or a bad field is a ValueError/FileNotFoundError naming the file and field."""
    what = what or cls.__name__
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{what} file {path} does not exist{missing_hint}")
        loaded = yaml.safe_load(path.read_text()) or {}  # YAML is a superset of JSON
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of field: value, got {type(loaded).__name__}")
        data = loaded
    data.update(updates or {})  # top-level values given as Python objects
    apply_overrides(data, overrides or [])
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        where = f" ({path})" if path else ""
        raise ValueError(f"invalid {what}{where}:\n{explain(exc, cls)}") from None


def explain(exc: ValidationError, model: type[BaseModel]) -> str:
    """A pydantic error as one line per field (`lopd.top_m: Input should be ...`), without pydantic's URLs, and
    with "did you mean" for an unknown field that is close to a real one (`train.schedule.stepz` -> steps)."""
    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        msg = err["msg"].removeprefix("Value error, ")  # our validators' messages stand on their own
        line = f"  {'.'.join(loc) or '(root)'}: {msg}"
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


def form_schema(schema: dict[str, Any]) -> None:
    """A model's JSON schema as a form (Prefect's run form) shows it best: fields keep their order (`position`; a
    JSONB store reorders keys), and a scalar field that defaults to null is shown as its type, not as tabs
    "int | None" whose None tab reads "Property is type None" (left empty, it is null again)."""
    for i, prop in enumerate(schema.get("properties", {}).values()):
        prop.setdefault("position", i)
        rest = [b for b in prop.get("anyOf", []) if b != {"type": "null"}]
        if "default" in prop and prop["default"] is None and len(rest) == 1 and rest[0].get("type") in _SCALARS:
            del prop["anyOf"], prop["default"]
            prop.update(rest[0])


_SCALARS = ("string", "integer", "number", "boolean")


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=form_schema)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> Any:
        """Load from a YAML mapping (a missing file or a bad field is an error naming it)."""
        return load_model(cls, path, what="config", updates=overrides)

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
    """A LoRA adapter: rank, scale, dropout and the modules it wraps."""

    r: int = Field(16, ge=1, description="LoRA rank (ours: the paper does not state it).")
    alpha: float = Field(32.0, gt=0, description="LoRA scale alpha (the update is scaled by alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    target_modules: tuple[str, ...] = Field(
        LLAMA_LORA_TARGETS, description="Linear layers wrapped with LoRA (the Llama attention and MLP projections)."
    )


class OPDOptions(StrictModel):
    """The OPD family's options (docs/methods.md), for every distillation method; the defaults are the paper's."""

    divergence: Literal["reverse_kl", "forward_kl", "jsd", "mix"] = Field(
        "reverse_kl",
        description="The distillation divergence on the top-M + tail buckets of every distillation method: "
        "reverse_kl = KL(student || teacher), the paper's (eq. 10); forward_kl = KL(teacher || student); jsd = GKD's "
        "generalised Jensen-Shannon with beta = divergence_coef; mix = divergence_coef * forward + (1 - "
        "divergence_coef) * reverse (lopd_core.losses.bucket_divergence).",
    )
    distill_form: Literal["divergence", "policy_gradient", "vopd", "sign"] = Field(
        "divergence",
        description="How every distillation method distils: divergence = the bucket divergence's gradient "
        "(eq. 10, `divergence`); policy_gradient = OPD as REINFORCE with per-token reward r = log pT(a) - log pS(a); "
        "vopd = the same less vOPD's baseline b = -KL(pS || pT) on the top-M buckets, the position's value E[r] "
        "(needs divergence=reverse_kl); sign = KL-free OPD, sign(r) only. The last three train the student only, "
        "and their expected gradient is reverse KL's only for rollouts sampled from the student itself "
        "(temperature 1, top_p 1; lopd_core.losses).",
    )
    divergence_coef: float = Field(
        0.5,
        ge=0,
        le=1,
        description="jsd: beta, the teacher's weight in the mixture, in (0, 1); mix: lambda, the forward KL's "
        "weight, in [0, 1]; unused by reverse_kl and forward_kl.",
    )
    reward_aligned: bool = Field(
        False,
        description="RA-OPD (seed 004): a record whose distillation return (the sum of its tokens' delta) "
        "disagrees with its verdict (positive on a failure, negative on a success) weighs misaligned_weight in the "
        "distillation term; the mean stays over all the batch's tokens (ours: no extra exchange between ranks; "
        "RA-OPD's mean over the kept tokens differs by the kept share). Logged: ra_misaligned, the share of such "
        "records.",
    )
    misaligned_weight: float = Field(
        0.0, ge=0, le=1, description="reward_aligned: the weight of a misaligned record (0 = RA-OPD's drop)."
    )
    guidance_coef: float = Field(
        1.0,
        ge=0,
        description="The hybrids (diffgate, diffgate_latent, scope): gamma, the weight of the teacher's divergence "
        "on failed rollouts beside the RL term (GRPO's policy gradient; SCOPE: the weighted likelihood of "
        "successes). Ours: the abstracts do not state it.",
    )
    guidance_bound: float = Field(
        1.0,
        ge=0,
        description="diffgate, diffgate_latent: each token's divergence d enters as b * tanh(d / b) with b this "
        "bound (nats; DiffGate's smooth bound, the form is ours); 0 = unbounded.",
    )

    @model_validator(mode="after")
    def _vopd_needs_the_reverse_kl(self) -> OPDOptions:
        if self.distill_form == "vopd" and self.divergence != "reverse_kl":
            raise ValueError(
                f"distill_form: vopd's baseline is the position's reverse KL, but divergence is {self.divergence!r}; "
                "set divergence: reverse_kl or distill_form: policy_gradient"
            )
        return self

    @model_validator(mode="after")
    def _jsd_needs_an_open_beta(self) -> OPDOptions:
        if self.divergence == "jsd" and not 0 < self.divergence_coef < 1:
            raise ValueError(
                f"divergence_coef: jsd's beta must lie strictly between 0 and 1, got {self.divergence_coef} "
                "(its ends are divergence=forward_kl and reverse_kl)"
            )
        return self


class BaselineConfig(StrictModel):
    """Knobs of the baselines (lopd_core.methods); LOPD ignores them."""

    clip_eps: float = Field(0.2, gt=0, description="GRPO's clipped ratio epsilon (PPO).")
    kl_coef: float = Field(
        0.0, ge=0, description="GRPO's k3 KL to the reference policy (DeepSeekMath used 0.04); 0 = none."
    )
    ppo_epochs: int = Field(1, ge=1, description="GRPO updates per batch (the clip is active from the second).")
    policy_temperature: float | None = Field(
        None,
        gt=0,
        description="GRPO's log-probs (ratio, policy gradient, KL) from logits / this temperature, so that the "
        "gradient is the sampling policy's (as TRL and verl do); null = the training rollouts' temperature (1.0 when "
        "they are greedy); 1.0 = the raw logits.",
    )
    teacher_sync: Literal["default", "frozen", "ema"] = Field(
        "default", description="Self-distillation teacher: default = the method's own (lopd_core.methods), frozen, ema."
    )
    teacher_ema_rate: float = Field(
        0.01, gt=0, le=1, description="EMA teacher rate a: teacher = (1 - a) teacher + a student."
    )
    shuffle_rewards: bool = Field(
        False,
        description="A control, not a method (ours): the rewards the objective sees are permuted across the step's "
        "batch (seeded by the step), so they carry no information about the rollouts; the logged rewards and curves "
        "stay the true ones. `lopd study --controls` adds GRPO with it: a gain counts only against this arm.",
    )


class ScheduleConfig(StrictModel):
    """The outer loop of Algorithm 1. Reference config: 100 steps of 32 tasks (smaller presets for CPU)."""

    steps: int = Field(100, ge=1, description="Training steps (outer iterations of Algorithm 1).")
    tasks_per_step: int = Field(32, ge=1, description="Training tasks per step (the batch of Algorithm 1).")
    samples_per_task: int = Field(1, ge=1, description="Rollouts per task per step: GRPO's group G, SDPO's siblings.")
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints (a resume starts from the last).")


class ColdStartConfig(StrictModel):
    """Composer cold-start (app. A.2): NLL of successful trajectories, backbone frozen, latents in the input.

    The paper sets data size and steps per domain without stating them; the clip values are the reference
    config's (QFormer 30.0, LoRA 3.0; the paper states one value, 3.0).
    """

    steps: int = Field(200, ge=0, description="Cold-start steps (ours; 0 = none).")
    batch_size: int = Field(8, ge=1, description="Trajectories per cold-start step (ours).")
    lr: float = Field(1e-4, gt=0, description="Learning rate of the composer (ours: the paper does not state it).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip_lora: float = Field(3.0, gt=0, description="Gradient-norm clip of the encoder LoRA (app. A.2: 3.0).")
    grad_clip_qformer: float = Field(30.0, gt=0, description="Gradient-norm clip of the QFormer (reference config).")
    relabel_codes: Literal["none", "alternatives", "pool"] = Field(
        "none",
        description="Ours, for suites with house rules (DESIGN.md §11): at every step each record's code, in its "
        "calls and in its retrieved experiences alike, is rewritten to one drawn at random from its environment's "
        "alternatives or from every code (pool), so only the latents predict it and the cold start cannot learn "
        "'environment -> code' from the prompt; none = the records as collected.",
    )
    token_selection: Literal["all", "surprising", "rule"] = Field(
        "all",
        description="Which action tokens the cold start's NLL trains on: all (the paper's); surprising (ours): those "
        "the plain backbone, reading no context, predicts with an NLL above surprisal_threshold: what a context could "
        "explain, found without knowing the suite; rule (ours): the tokens that realise a rule of the suite "
        "(toolworld-rules' codes). DESIGN.md §11: with every token, the 1M testbed's composer never learns to read.",
    )
    surprisal_threshold: float = Field(
        0.3, ge=0, description="token_selection=surprising: the context-free NLL (nats) above which a token counts."
    )
    unselected_weight: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Ours: the weight of the tokens that token_selection leaves out in the cold start's NLL (0: left "
        "out; 1: every token, as with all). Left out, the teacher's reader drifts on them: the reading teacher of the "
        "study of 2026-12-07 was worse than its student on every non-code token (privilege_other -0.31); a small "
        "weight holds the reader to the data there while the selected tokens still dominate.",
    )
    probe_tasks: int = Field(
        48,
        ge=0,
        description="Ours, for suites with house rules: validation tasks (training tasks without a validation "
        "slice; never held-out ones) the latent-dependence probe scores after the cold start (lopd_core."
        "latent_probe; 0 = no probe).",
    )
    probe_every: int = Field(0, ge=0, description="Also probe every this many steps: the probe's curve (0: the end).")


class SFTConfig(StrictModel):
    """The warm start (sft stage): next-token NLL of verified demonstrations, every weight trained.

    Not in the paper (its students start from instruction-tuned models); here it turns a from-scratch student
    into one whose held-out success leaves room to improve in both directions. Values: ours, chosen on the
    validation slice of the training split (configs/study-cpu.yaml says how).
    """

    steps: int = Field(600, ge=0, description="Warm-start steps.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per step.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay to lr x min_lr_ratio after a linear warmup.")
    warmup_steps: int = Field(30, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    n_demonstrations: int | None = Field(
        None, ge=1, description="A seeded sample of the training tasks as demonstrations; null = all."
    )
    pool_per_level: int = Field(0, ge=0, description="toolworld: extra generator scenarios per environment and level.")
    answer: str = Field("Done.", description="The final assistant turn that closes a demonstration.")
    copy_pretrain_steps: int = Field(
        0, ge=0, description="From-scratch students: synthetic copying steps first (lopd_core.sft)."
    )
    copy_batch_size: int = Field(0, ge=0, description="Synthetic copying sequences added to every sft step (0 = none).")
    copy_span: int = Field(16, ge=1, description="Tokens repeated in a copying sequence.")
    privileged_fraction: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Ours: this share of the demonstrations is added again with its own solution "
        "in front of the task, as the text-context teachers (OPSD) read it, so a teacher with context has seen one.",
    )
    privileged_codes: Literal["own", "pool"] = Field(
        "own",
        description="Ours, a suite with house rules: the code a privileged copy (privileged_fraction) shows in its "
        "solution and writes in its calls: its demonstration's own (one of the environment's k alternatives, so "
        "copying it is worth ln k nats), or one drawn per copy from every environment's codes (24), so that reading "
        "the solution is the only way to predict it: a small student then learns to read a code from its context, "
        "which OPSD's teacher needs (docs/study.md). Neither shows which alternative holds.",
    )
    house_codes: Literal["uniform", "correct"] = Field(
        "uniform",
        description="A suite with house rules (toolworld-rules): each demonstration, once verified, writes the code "
        "of an alternative drawn uniformly at random (the warm start learns the rule's form, not its value), or the "
        "correct code (the oracle warm start: the ceiling's calibration row). Other suites: ignored.",
    )
    data_parallel: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="Several ranks (torchrun): ddp = a full replica on every rank; fsdp = FSDP2 (fully_shard), each "
        "decoder layer one unit, weights, gradients and AdamW state sharded over the ranks; auto = fsdp (sft trains "
        "every weight).",
    )
    seed: int = Field(0, description="Seed of the demonstration sample and the data order.")

    @model_validator(mode="after")
    def _pool_needs_copies(self) -> SFTConfig:
        if self.privileged_codes == "pool" and self.privileged_fraction <= 0:
            raise ValueError("sft.privileged_codes: pool recodes the privileged copies, and there are none: set "
                             "sft.privileged_fraction > 0 (e.g. 0.5)")  # fmt: skip
        return self


class LOPDConfig(StrictModel):
    """The method and its hyperparameters (LOPD's, and the baselines' in `baseline`), with the paper's defaults."""

    method: MethodName = Field(
        "lopd",
        description="lopd, or a baseline: opsd, sdft, sdpo, skill_sd, grpo, or a hybrid: diffgate, diffgate_latent, "
        "scope (lopd_core.methods).",
    )
    # ---- composer (§3.2, app. A.1)
    n_retrieved: int = Field(3, ge=1, description="J: experiences retrieved from the bank per task (§3.2).")
    retrieval_scope: Literal["bank", "environment"] = Field(
        "bank",
        description="Where the J experiences come from: the whole bank by similarity (the paper), or, ours, only the "
        "task's own environment (suites whose knowledge is per environment, e.g. toolworld-rules' house codes).",
    )
    min_bank_size: int | None = Field(
        None,
        ge=0,
        description="Ours: the train stage refuses LOPD on a bank with fewer entries (null: J, the fewest that can "
        "fill a retrieval's J slots); 0 allows an empty bank, whose teacher then reads only the composer's "
        '"no past trajectory" placeholder items (counted per step as n_placeholder_experiences).',
    )
    n_queries: int = Field(32, ge=1, description="K: latent tokens (QFormer queries) per retrieved experience.")
    qformer_layers: int = Field(8, ge=1, description="QFormer depth: one block, weights shared across depth.")
    qformer_ff_mult: int = Field(4, ge=1, description="QFormer feed-forward width multiplier.")
    encoder_max_tokens: int = Field(1024, ge=16, description="Ours: longer framed experiences are cut (and counted).")
    latent_values: Literal["states", "tokens"] = Field(
        "states",
        description="What a latent is: states = the QFormer's output projection of its queries (the paper); tokens = "
        "a learned pointer's mixture of the experience's own input token embeddings, the space the teacher reads "
        "(ours: the 1M testbed's composer only learns to carry a code this way, DESIGN.md §11).",
    )
    encoder_layer: int = Field(
        -1,
        ge=-1,
        description="Which of the encoder's hidden states the QFormer reads: -1 = the last layer's, after the final "
        "norm (the paper's and the reference code's); k = 0, 1, ... = the output of decoder layer k (0: the input "
        "embeddings), which keeps more of each token's identity than the last layer, whose states are the next "
        "token's prediction (ours, DESIGN.md §11).",
    )
    encoder_lora: LoraSpec = Field(LoraSpec(), description="LoRA of the experience encoder (the composer's).")
    # ---- student
    student_mode: Literal["lora", "full"] = Field(
        "lora",
        description="lora: the student is a LoRA on the backbone; full: every weight, with a frozen teacher copy.",
    )
    student_lora: LoraSpec = Field(LoraSpec(), description="LoRA of the student (student_mode=lora).")
    # ---- objective (eq. 9-13)
    top_m: int = Field(
        20, ge=1, description="M: top-M teacher tokens kept, plus one tail bucket, in the distillation KL (eq. 9-10)."
    )
    kl_support: Literal["teacher", "student"] = Field(
        "teacher", description="Whose top-M ids form the support S (eq. 9)."
    )
    tail_floor: float | None = Field(
        None, lt=0, description="null: the exact tail (eq. 9); -1e-7: the reference code's clamp."
    )
    margin_target: float = Field(
        0.05,
        description="m: margin target of the privileged-margin constraint: the batch margin Delta (eq. 12) "
        "is kept at least m (eq. 13).",
    )
    anchor_weight: float = Field(
        0.2,
        ge=0,
        description="lambda: weight of the anchor, the squared distance of the latents to their "
        "cold-start value (eq. 13).",
    )
    anchor_reduction: Literal["sum", "mean"] = Field(
        "sum", description="Anchor reduction: sum = the paper's squared L2; mean = the reference code."
    )
    freeze_composer: bool = Field(
        False, description="Keep the cold-start composer fixed (fig. 3's frozen-composer ablation)."
    )
    teacher_reader: bool = Field(
        False,
        description="Ours, not the paper: the cold start also trains a LoRA 'reader' on the teacher's backbone "
        "(encoder_lora's shape), frozen in training, so that the teacher has learnt to read the latents; false = "
        "the paper's teacher, the frozen base model.",
    )
    dual_lr: float = Field(
        0.5, ge=0, description="eta_beta: dual step size, beta = max(0, beta + eta_beta (m - Delta)) (eq. 13)."
    )
    beta_init: float = Field(0.0, ge=0, description="beta_0: initial value of the dual variable beta (eq. 13).")
    margin_advantage: Literal["verdict", "centered", "balanced"] = Field(
        "verdict",
        description="The A in Delta: verdict A = 2r - 1 (§3.3); centered subtracts the batch mean of A (ours, an "
        "option: with mostly failures a teacher uniformly worse than the student satisfies the verdict margin); "
        "balanced is the order-consistent margin (after Uni-OPD): 1/2 the mean over successful records of their "
        "mean delta minus 1/2 that over failed ones, which no uniform shift of the teacher meets; a batch with no "
        "success or no failure leaves it undefined, and beta is held (lopd_core.losses.balanced_margin).",
    )
    loss_normalization: Literal["token", "record", "reference"] = Field(
        "token",
        description="token: every term token-weighted over the batch (eq. 10, 12); record: the mean over records "
        "of per-record means; reference: as bingreeky/LOPD's code, the student side token-weighted and the composer "
        "side (KL and Delta as the composer sees them) per-record means. The dual step always uses eq. 12's "
        "token-weighted Delta.",
    )
    # ---- optimisation: one AdamW step over two parameter groups (Algorithm 1)
    student_lr: float = Field(1e-5, gt=0, description="Student learning rate (ours: the paper does not state it).")
    composer_lr: float = Field(1e-5, gt=0, description="lr_phi: composer learning rate (Algorithm 1).")
    weight_decay: float = Field(
        0.01, ge=0, description="AdamW weight decay (PyTorch's default, as in the reference code)."
    )
    # gradient clipping: the paper is silent for training; the reference code clips the student at
    # training.grad_clip = 1.0 and the composer (QFormer + encoder LoRA) jointly at the same 1.0
    grad_clip_student: float = Field(
        1.0, gt=0, description="Student gradient-norm clip (the paper is silent; the reference code: 1.0)."
    )
    composer_clip: Literal["joint", "per_group"] = Field(
        "joint", description="Composer clipping: joint (one norm, the reference code) or per_group (LoRA, QFormer)."
    )
    grad_clip_composer: float = Field(1.0, gt=0, description="joint: one norm over every composer parameter.")
    grad_clip_lora: float = Field(
        3.0, gt=0, description="per_group: the encoder LoRA (the reference's cold-start value)."
    )
    grad_clip_qformer: float = Field(
        30.0, gt=0, description="per_group: the QFormer (the reference's cold-start value)."
    )
    # ---- sequences and compute
    max_seq_len: int = Field(
        40_960, ge=64, description="Longest training view; longer ones are counted and left out of the loss."
    )
    fail_on_overlength: bool = Field(False, description="Raise instead of skipping over-length sequences.")
    gradient_checkpointing: Literal["auto", True, False] = Field(  # one choice of three in a form, not two tabs
        "auto",
        description="Recompute each decoder layer's activations in backward (student, teacher and encoder passes; "
        "the adapter a layer ran with is replayed): auto = on for a step whose longest view has at least "
        "gradient_checkpointing_min_len tokens; true/false = always/never.",
    )
    gradient_checkpointing_min_len: int = Field(
        2048, ge=1, description="Ours: the view length from which saved activations start to dominate memory."
    )
    data_parallel: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="Several ranks (torchrun): ddp = a full replica of the trained weights on every rank, gradients "
        "all-reduced; fsdp = FSDP2 (fully_shard): the trained model's decoder layers each one unit, weights, "
        "gradients and AdamW state sharded over the ranks; auto = fsdp for full fine-tuning, ddp for LoRA.",
    )
    head_chunk_size: int = Field(1024, ge=1, description="Positions per chunk of the fused loss head.")
    length_grouping: float | None = Field(
        1.25,
        ge=1.0,
        description="Ours: the student and teacher passes run on groups of records of similar length, "
        "each padded to its own longest, a group growing while its padded tokens stay within this factor of its "
        "real ones; null = one pass over the whole batch padded to its longest record. Same loss, up to float "
        "rounding (a study's trajectories range from ~100 to ~600 tokens: one padded pass computes 4x the tokens).",
    )
    seed: int = Field(0, description="Training seed.")
    baseline: BaselineConfig = Field(BaselineConfig(), description="Knobs of the baselines; LOPD ignores them.")
    opd: OPDOptions = Field(
        OPDOptions(),
        description="The OPD family's options for every distillation method (divergence, distill_form, "
        "reward_aligned; docs/methods.md).",
    )

    @model_validator(mode="after")
    def _sharding_needs_full_student(self) -> LOPDConfig:
        if self.data_parallel == "fsdp" and self.student_mode != "full":
            raise ValueError(
                "data_parallel=fsdp needs student_mode=full: a LoRA student is the backbone that the teacher and the "
                "composer also run, a different number of times on each rank, so its layers cannot be sharded; use "
                "data_parallel=ddp (or auto) for LoRA, whose trainable weights are small"
            )
        return self

    @model_validator(mode="after")
    def _balanced_margin_is_per_record(self) -> LOPDConfig:
        if self.margin_advantage == "balanced" and self.loss_normalization == "reference":
            raise ValueError(
                "margin_advantage: balanced is a mean over records already, and loss_normalization: reference "
                "rescales the composer's side per record a second time; use loss_normalization: token or record"
            )
        return self

    @property
    def sharded(self) -> bool:
        """Whether data-parallel training shards the student with FSDP2 (`data_parallel`)."""
        return self.data_parallel == "fsdp" or (self.data_parallel == "auto" and self.student_mode == "full")

    @property
    def n_latents(self) -> int:
        """J*K: the length of the teacher's placeholder span."""
        return self.n_retrieved * self.n_queries


class RolloutConfig(BaseModel):
    """Generation settings of rollouts: the one type behind every stage's `rollout` field (collect, train and
    evaluate specs, the pipeline form) and the engines. `seed` and `progress` are set by the stage that runs the
    engine (`seeded`), so they are kept out of forms and dumps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy; 1.0: the policy's own).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1.0 = off).")
    max_turns: int = Field(8, ge=1, description="Assistant turns per episode.")
    max_new_tokens: int = Field(256, ge=1, description="Tokens per assistant turn.")
    max_total_tokens: int = Field(4096, ge=1, description="Tokens per episode (prompt, turns, observations).")
    batch_size: int = Field(8, ge=1, description="Episodes generated together.")
    reuse_cache: bool = Field(
        True, description="Keep each episode's keys/values between turns and share system-prompt prefixes (hf)."
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="hf: batched Hugging Face forward passes; vllm: a vLLM worker process (make venv-vllm)."
    )
    vllm_compile: bool = Field(
        False, description="vLLM: torch.compile (minutes to start, cached under the cache dir) instead of eager."
    )
    vllm_kv_cache_mb: int = Field(512, ge=16, description="vLLM: KV-cache memory of the worker, in MiB.")
    seed: SkipJsonSchema[int] = Field(0, exclude=True, description="Sampling seed (set by the stage).")
    progress: SkipJsonSchema[bool] = Field(True, exclude=True, description="A progress bar over episodes.")

    def seeded(self, seed: int, progress: bool = True) -> RolloutConfig:
        """These settings with the stage's seed and progress choice."""
        return self.model_copy(update={"seed": seed, "progress": progress})
