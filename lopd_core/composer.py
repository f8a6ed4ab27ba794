"""The composer Phi_phi (§3.2): retrieved experiences -> J*K latent vectors the teacher reads.

Each retrieved item m_j is framed with the current task ("Task to solve: ... / Reference past trajectory:
...", app. A.5), encoded by the backbone with the encoder LoRA live (eq. 5), and compressed by a QFormer into
K vectors (eq. 6); the J results are concatenated into J*K latents (eq. 7).

The QFormer follows app. A.1 and the reference code: K learned queries (init randn / sqrt(d)), one block
whose weights are shared across 8 layers, feed-forward multiplier 4, hidden size and heads from the
backbone, attention keys/values over [queries; encoder states], linear input and output projections and a
final LayerNorm. Ours, where neither says: pre-LayerNorm residual block, GELU, and an output projection
initialised so the latents start at the scale of the backbone's input embeddings. Ours, an option
(`lopd.latent_values: tokens`, DESIGN.md §11): each latent is a learned pointer's mixture of the experience's own
input token embeddings, the space the teacher reads (`QFormer`).
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lopd_core.adapters import AdapterSwitch, add_lora, copy_adapter
from lopd_core.config import LOPDConfig

MISSING_EXPERIENCE = "(no past trajectory retrieved)"


def frame_experience(task: str, experience: str) -> str:
    """The encoder's fixed input format (app. A.5); the same text at cold-start, training and evaluation."""
    return f"Task to solve: {task}\nReference past trajectory: {experience}"


class QFormerBlock(nn.Module):
    def __init__(self, d: int, n_heads: int, ff_mult: int) -> None:
        super().__init__()
        self.norm_q = nn.LayerNorm(d)
        self.norm_kv = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, n_heads, batch_first=True)
        self.norm_ff = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff_mult * d), nn.GELU(), nn.Linear(ff_mult * d, d))

    def forward(self, x: torch.Tensor, states: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(x)
        kv = torch.cat([q, self.norm_kv(states)], dim=1)  # keys/values = [queries; encoder states]
        kv_pad = torch.cat([pad.new_zeros(pad.shape[0], x.shape[1]), pad], dim=1)  # queries are never padding
        x = x + self.attn(q, kv, kv, key_padding_mask=kv_pad, need_weights=False)[0]
        return x + self.ff(self.norm_ff(x))


class QFormer(nn.Module):
    """K learned queries read the encoder states through one shared block applied `n_layers` times.

    values="states" (the paper's): the latents are the queries after the last layer, LayerNorm and an output
    projection: vectors in a space of their own, which the teacher must learn to read.
    values="tokens" (ours, DESIGN.md §11): latent k points into the experience: the softmax_i(q_k . W_k h_i / sqrt(d))
    weighted mixture of the experience's input token embeddings e_i (h_i its encoder states), with the pointer
    q_k = p_k + the same output projection of the query (which starts small: the pointers start as learned
    constants; content-dependent pointers from the start kept the 1M testbed's composer from learning to find a
    code). A latent lives where the teacher's own input embeddings live, so a teacher that copies a token it reads in
    its context can read one the composer points at.
    """

    def __init__(
        self,
        d: int,
        n_heads: int,
        n_queries: int = 32,
        n_layers: int = 8,
        ff_mult: int = 4,
        out_std: float = 0.02,
        values: str = "states",
    ) -> None:
        super().__init__()
        if values not in ("states", "tokens"):
            raise ValueError(f"QFormer values must be 'states' or 'tokens', got {values!r}")
        self.values = values
        self.queries = nn.Parameter(torch.randn(n_queries, d) / math.sqrt(d))
        self.in_proj = nn.Linear(d, d)
        self.block = QFormerBlock(d, n_heads, ff_mult)  # one block, applied n_layers times
        self.n_layers = n_layers
        self.norm = nn.LayerNorm(d)
        self.out_proj = nn.Linear(d, d)
        nn.init.normal_(self.out_proj.weight, std=out_std / math.sqrt(d))
        nn.init.zeros_(self.out_proj.bias)
        if values == "tokens":
            self.pointer_queries = nn.Parameter(torch.randn(n_queries, d) / math.sqrt(d))
            self.pointer_keys = nn.Linear(d, d)

    def forward(
        self, states: torch.Tensor, attention_mask: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """states [N, L, d], attention_mask [N, L] (1 = token), tokens [N, L, d] (the experience's input token
        embeddings; values="tokens" only) -> [N, K, d]."""
        x_states = self.in_proj(states)
        pad = attention_mask == 0
        x = self.queries.unsqueeze(0).expand(states.shape[0], -1, -1)
        for _ in range(self.n_layers):
            x = self.block(x, x_states, pad)
        out = self.out_proj(self.norm(x))
        if self.values == "states":
            return out
        if tokens is None:
            raise ValueError("a QFormer with values='tokens' needs the experience's token embeddings")
        query = self.pointer_queries + out  # learned pointers, moved by what the queries read (small at first)
        logits = query @ self.pointer_keys(states).transpose(1, 2) / math.sqrt(x.shape[-1])
        weights = logits.masked_fill(pad.unsqueeze(1), float("-inf")).softmax(-1)  # [N, K, L]
        return weights @ tokens.to(weights.dtype)


class Composer(nn.Module):
    """Encoder LoRA ("encoder" adapter on the shared backbone) + QFormer, plus the frozen cold-start copy.

    The frozen copy ("anchor" adapter + `anchor_qformer`) gives the anchor target c_phi0 for any retrieved
    set, cached by content digest, so the anchor needs no forward pass once a set has been seen.
    """

    def __init__(
        self, backbone: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, switch: AdapterSwitch, cfg: LOPDConfig
    ) -> None:
        super().__init__()
        d = backbone.config.hidden_size
        embed_std = backbone.get_input_embeddings().weight.detach().float().std().item()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.switch = switch
        self._backbone = [backbone]  # a list keeps the shared backbone out of this module's parameters
        self.qformer = QFormer(
            d, backbone.config.num_attention_heads, cfg.n_queries, cfg.qformer_layers, cfg.qformer_ff_mult, embed_std,
            cfg.latent_values,
        ).to(backbone.dtype)  # fmt: skip
        self.anchor_qformer = copy.deepcopy(self.qformer).requires_grad_(False)
        self.anchor_cache = LatentCache()
        self.n_truncated = 0

    @property
    def backbone(self) -> PreTrainedModel:
        return self._backbone[0]

    def encoder_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.backbone.named_parameters() if ".encoder." in n and "lora_" in n]

    def frame(self, tasks: Sequence[str], retrieved: Sequence[Sequence[str]]) -> list[str]:
        """J framed texts per task; fewer than J retrieved items are filled with a fixed 'none' item."""
        J = self.cfg.n_retrieved
        texts = []
        for task, items in zip(tasks, retrieved, strict=True):
            items = list(items)[:J] + [MISSING_EXPERIENCE] * max(0, J - len(items))
            texts.extend(frame_experience(task, item) for item in items)
        return texts

    def _compress(self, texts: list[str], adapter: str, qformer: QFormer) -> torch.Tensor:
        limit = self.cfg.encoder_max_tokens
        encoded = self.tokenizer(texts, add_special_tokens=True)["input_ids"]
        self.n_truncated += sum(len(ids) > limit for ids in encoded)
        encoded = [ids[:limit] for ids in encoded]
        width = max(len(ids) for ids in encoded)
        pad = self.tokenizer.pad_token_id
        device = next(qformer.parameters()).device
        ids = torch.tensor([x + [pad] * (width - len(x)) for x in encoded], device=device)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in encoded], device=device)
        layer = self.cfg.encoder_layer
        with self.switch.use(adapter):
            out = self.backbone.model(
                input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=layer >= 0
            )
        states = out.last_hidden_state if layer < 0 else out.hidden_states[layer]  # [0]: the input embeddings
        tokens = self.backbone.get_input_embeddings()(ids).detach() if qformer.values == "tokens" else None
        return qformer(states, mask, tokens)

    def forward(self, tasks: Sequence[str], retrieved: Sequence[Sequence[str]]) -> torch.Tensor:
        """Latent context c_phi for each task: [B, J*K, d], with gradient to the encoder LoRA and QFormer."""
        latents = self._compress(self.frame(tasks, retrieved), "encoder", self.qformer)
        return latents.reshape(len(tasks), self.cfg.n_latents, -1)

    @torch.no_grad()
    def anchor_latents(self, tasks: Sequence[str], retrieved: Sequence[Sequence[str]]) -> torch.Tensor:
        """c_phi0 from the frozen cold-start composer, computed once per distinct (task, retrieved set)."""
        keys = [latent_key(t, r) for t, r in zip(tasks, retrieved, strict=True)]
        missing = [i for i, k in enumerate(keys) if k not in self.anchor_cache]
        if missing:
            fresh = self._compress(
                self.frame([tasks[i] for i in missing], [retrieved[i] for i in missing]), "anchor", self.anchor_qformer
            ).reshape(len(missing), self.cfg.n_latents, -1)
            for i, lat in zip(missing, fresh, strict=True):
                self.anchor_cache.put(keys[i], lat)
        return torch.stack([self.anchor_cache.get(k) for k in keys])

    def freeze_anchor(self) -> None:
        """Make the current composer the anchor phi_0 (call after cold-start); clears the latent cache."""
        copy_adapter(self.backbone, "encoder", "anchor")
        self.anchor_qformer.load_state_dict(self.qformer.state_dict())
        self.anchor_cache.clear()


def latent_key(task: str, retrieved: Sequence[str]) -> str:
    h = hashlib.sha256(task.encode())
    for item in retrieved:
        h.update(b"\0" + item.encode())
    return h.hexdigest()


class LatentCache:
    """Cold-start latents c_phi0 by content digest; saved/loaded as one safetensors file."""

    def __init__(self) -> None:
        self._data: dict[str, torch.Tensor] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> torch.Tensor:
        return self._data[key]

    def put(self, key: str, latents: torch.Tensor) -> None:
        self._data[key] = latents.detach().clone()

    def clear(self) -> None:
        self._data.clear()

    def save(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self._data.items()}, str(path))

    def load(self, path: str | Path) -> None:
        self._data.update(load_file(str(path)))


def attach_composer_adapters(backbone: PreTrainedModel, cfg: LOPDConfig) -> None:
    """Inject the "encoder" adapter (trainable) and the "anchor" adapter (its frozen cold-start copy)."""
    add_lora(backbone, "encoder", cfg.encoder_lora)
    add_lora(backbone, "anchor", cfg.encoder_lora)
    copy_adapter(backbone, "encoder", "anchor")
    for n, p in backbone.named_parameters():
        if ".anchor." in n and "lora_" in n:
            p.requires_grad_(False)
