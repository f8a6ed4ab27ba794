"""The models of one run: student, teacher and composer around one backbone (two in full fine-tuning).

LoRA student (default): one backbone in memory carrying three adapters. "student" is the policy, "encoder"
the composer's encoder, "anchor" the frozen cold-start copy of the encoder. The teacher is that backbone
with every adapter disabled: the frozen base model, reading the latents spliced into its input embeddings
(with `teacher_reader`, ours: a fourth adapter, "reader", that the cold start trains and the teacher keeps on).

Full fine-tuning: the student is a separate trainable copy; the frozen backbone (teacher + composer
adapters) stays as it was loaded.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lopd_core.adapters import AdapterSwitch, adapter_parameters, add_lora
from lopd_core.composer import Composer, attach_composer_adapters
from lopd_core.config import LOPDConfig
from lopd_core.serialization import TokenBatch, length_groups


def latent_teacher_adapter(cfg: LOPDConfig) -> str | None:
    """The latent teacher's adapter: the cold start's reader (`teacher_reader`), else none (the base model)."""
    return "reader" if cfg.teacher_reader else None


def splice_latents(embeds: torch.Tensor, latents: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Replace each row's placeholder span [start, start + n) of input embeddings by its latents (torch.cat)."""
    n = latents.shape[1]
    rows = []
    for b, start in enumerate(starts.tolist()):
        if start < 0 or start + n > embeds.shape[1]:
            raise ValueError(f"row {b}: latent span [{start}, {start + n}) outside the sequence of {embeds.shape[1]}")
        rows.append(torch.cat([embeds[b, :start], latents[b].to(embeds.dtype), embeds[b, start + n :]]))
    return torch.stack(rows)


@dataclass
class LOPDModels:
    backbone: PreTrainedModel  # frozen base weights; carries the adapters
    student: PreTrainedModel  # the backbone itself (LoRA) or a trainable copy (full)
    tokenizer: PreTrainedTokenizerBase
    switch: AdapterSwitch  # adapter state of the backbone
    student_switch: AdapterSwitch  # the same object in LoRA mode
    composer: Composer
    cfg: LOPDConfig
    ema_teacher: bool = False  # full fine-tuning with an EMA teacher: the backbone's base weights follow the student

    @property
    def student_adapter(self) -> str | None:
        return "student" if self.cfg.student_mode == "lora" else None

    @property
    def teacher_adapter(self) -> str | None:
        return latent_teacher_adapter(self.cfg)

    def student_parameters(self) -> list[nn.Parameter]:
        if self.cfg.student_mode == "lora":
            return [p for n, p in self.backbone.named_parameters() if ".student." in n and "lora_" in n]
        return [p for p in self.student.parameters() if p.requires_grad]

    def teacher_student_pairs(self) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """Full fine-tuning: (name, the backbone's base weight, the student's weight of the same place) for every
        base weight; the backbone is the teacher (adapters off), the student a copy of it."""
        if self.student is self.backbone:
            raise ValueError("teacher_student_pairs: a LoRA student shares the backbone's weights")
        student = dict(self.student.named_parameters())
        return [(n, p, student[n.replace(".base_layer", "")])
                for n, p in self.backbone.named_parameters() if "lora_" not in n]  # fmt: skip

    def reader_parameters(self) -> list[nn.Parameter]:
        """The teacher's "reader" LoRA (`teacher_reader`, trained by the cold start only); none without it."""
        return adapter_parameters(self.backbone, "reader") if self.cfg.teacher_reader else []

    def composer_parameters(self) -> list[nn.Parameter]:
        """The composer's trainable parameters (none with `freeze_composer`)."""
        if self.cfg.freeze_composer:
            return []
        return self.composer.encoder_parameters() + list(self.composer.qformer.parameters())

    @contextlib.contextmanager
    def acting_student(self) -> Iterator[PreTrainedModel]:
        """The student as a plain causal LM (e.g. for rollouts): its adapter live, the others off."""
        with self.student_switch.use(self.student_adapter):
            yield self.student

    def student_hidden(self, batch: TokenBatch) -> torch.Tensor:
        device = self.student.device
        with self.student_switch.use(self.student_adapter):
            out = self.student.model(
                input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device), use_cache=False
            )
        return out.last_hidden_state

    def teacher_hidden(
        self, batch: TokenBatch, latents: torch.Tensor | None, adapter: str | None = None
    ) -> torch.Tensor:
        """The teacher: the frozen backbone (`adapter=None`: every adapter off) reading the spliced latents."""
        device = self.backbone.device
        ids = batch.input_ids.to(device)
        embeds = self.backbone.get_input_embeddings()(ids)
        if latents is not None:
            if latents.shape[1] != batch.latent_len:
                raise ValueError(f"{latents.shape[1]} latents for a placeholder span of {batch.latent_len}")
            embeds = splice_latents(embeds, latents, batch.latent_start)
        elif batch.latent_len:
            raise ValueError("the teacher views have a placeholder span but no latents were given")
        with self.switch.use(adapter):
            out = self.backbone.model(
                inputs_embeds=embeds, attention_mask=batch.attention_mask.to(device), use_cache=False
            )
        return out.last_hidden_state

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(student lm-head weight, teacher lm-head weight)."""
        return self.student.get_output_embeddings().weight, self.backbone.get_output_embeddings().weight

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        for switch in {id(self.switch): self.switch, id(self.student_switch): self.student_switch}.values():
            switch.enable_checkpointing() if enabled else switch.disable_checkpointing()

    def train(self) -> None:
        self.backbone.train()
        self.student.train()
        self.composer.train()

    def eval(self) -> None:
        self.backbone.eval()
        self.student.eval()
        self.composer.eval()


def build_models(backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cfg: LOPDConfig) -> LOPDModels:
    """Freeze the backbone, attach the adapters for `cfg.student_mode`, and build the composer."""
    backbone.requires_grad_(False)
    if cfg.student_mode == "full":
        student = copy.deepcopy(backbone).requires_grad_(True)
    attach_composer_adapters(backbone, cfg)
    if cfg.student_mode == "lora":
        add_lora(backbone, "student", cfg.student_lora)
        student = backbone
    if cfg.teacher_reader:  # trained by the cold start only (lopd_core.cold_start), frozen after
        add_lora(backbone, "reader", cfg.encoder_lora)
        for p in adapter_parameters(backbone, "reader"):
            p.requires_grad_(False)
    switch = AdapterSwitch(backbone)
    student_switch = switch if student is backbone else AdapterSwitch(student)
    composer = Composer(backbone, tokenizer, switch, cfg).to(backbone.device)
    models = LOPDModels(backbone, student, tokenizer, switch, student_switch, composer, cfg)
    for p in models.student_parameters() + models.composer_parameters():
        p.requires_grad_(True)
    if cfg.freeze_composer:
        models.composer.qformer.requires_grad_(False)
        for p in models.composer.encoder_parameters():
            p.requires_grad_(False)
    models.set_gradient_checkpointing(cfg.gradient_checkpointing is True)  # "auto": the step decides per batch
    return models


def hidden_at(
    batch: TokenBatch,
    rows: torch.Tensor,
    pos: torch.Tensor,
    run: Callable[[TokenBatch, torch.Tensor | None], torch.Tensor],
    padding: float | None,
) -> torch.Tensor:
    """The hidden states at (rows, pos), [N, d] in that order, from `run(sub_batch, record_index)` ([b, t, d]) on
    groups of records of similar length (`lopd.length_grouping`: `padding`), so that no pass pads a short record
    to the batch's longest; `record_index` is None when the whole batch is one group. The same values as one
    padded pass, up to float rounding."""
    groups = length_groups(batch.lengths, padding)
    if len(groups) == 1:
        return run(batch, None)[rows, pos]
    parts, where = [], []
    for group in groups:
        idx = torch.tensor(group, device=rows.device)
        mask = torch.isin(rows, idx)
        local = torch.searchsorted(idx, rows[mask])
        parts.append(run(batch.select(group), idx)[local, pos[mask]])
        where.append(mask.nonzero().squeeze(1))
    return torch.cat(parts)[torch.argsort(torch.cat(where))]
