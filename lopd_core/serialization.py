"""Token views of a conversation: the student's, the teacher's (with its privileged context), and their alignment.

The chat template is applied per message *segment*: the template's scaffolding (role headers, end-of-turn
markers) and each message's content are tokenised separately and concatenated. Two consequences:

* the assistant action tokens are identical in every view, so student and teacher align by a known offset
  (the number of positions the teacher's context inserts), never by truncating to the shorter sequence;
* the rollout prompt (`prompt_ids`) is the exact prefix of the training view, so training scores precisely
  the tokens the policy sampled (assistant messages carry their sampled ids).

The teacher's context goes at the start of the first user message: fixed framing text around a contiguous
placeholder span of exactly J*K positions whose input embeddings the latents replace (LOPD), or plain text
(text-context baselines). Supervised positions (mask = 1) are assistant content tokens plus the end-of-turn
token when it was sampled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from lopd_core.conversation import Message, Trajectory

# Fixed framing around the latent span in the teacher's first user message (same at train and test time).
LATENT_FRAMING = ("Compressed memory of past successful trajectories: ", "\n\n")
_SENTINEL = "\x1e{}\x1f"
_SENTINEL_RE = re.compile("\x1e(\\d+)\x1f")


@dataclass(frozen=True)
class LatentSpan:
    """A contiguous run of placeholder positions whose input embeddings are replaced by latent vectors."""

    length: int


@dataclass(frozen=True)
class TeacherContext:
    """What the teacher reads in front of the first user message's content: text and/or one latent span."""

    pieces: tuple[str | LatentSpan, ...]

    @staticmethod
    def latent(n_latents: int, framing: tuple[str, str] = LATENT_FRAMING) -> TeacherContext:
        if n_latents <= 0:
            raise ValueError(f"latent span length must be positive, got {n_latents}")
        return TeacherContext((framing[0], LatentSpan(n_latents), framing[1]))

    @staticmethod
    def text(text: str) -> TeacherContext:
        return TeacherContext((text,))

    @property
    def n_latents(self) -> int:
        return sum(p.length for p in self.pieces if isinstance(p, LatentSpan))


@dataclass
class TokenView:
    input_ids: list[int]
    action_mask: list[int]
    insert_pos: int  # index where the teacher's context goes (start of the first user content)
    offset: int = 0  # positions inserted by the teacher's context (0 for the student view)
    latent_start: int = -1  # first placeholder position, -1 if none
    latent_len: int = 0
    assistant_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each assistant content

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_action_tokens(self) -> int:
        return sum(self.action_mask)


@dataclass
class TokenBatch:
    """Right-padded tensors for a list of views."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    action_mask: torch.Tensor  # [B, T] float 0/1
    offsets: torch.Tensor  # [B] long
    insert_pos: torch.Tensor  # [B] long
    latent_start: torch.Tensor  # [B] long, -1 when the view has no span
    latent_len: int = 0
    lengths: list[int] = field(default_factory=list)

    def select(self, index: Sequence[int]) -> TokenBatch:
        """The records `index` (in that order), cut to the longest of them."""
        idx = torch.as_tensor(list(index), dtype=torch.long)
        lengths = [self.lengths[i] for i in index]
        width = max(lengths)
        return TokenBatch(
            input_ids=self.input_ids[idx, :width],
            attention_mask=self.attention_mask[idx, :width],
            action_mask=self.action_mask[idx, :width],
            offsets=self.offsets[idx],
            insert_pos=self.insert_pos[idx],
            latent_start=self.latent_start[idx],
            latent_len=self.latent_len,
            lengths=lengths,
        )


def length_groups(lengths: Sequence[int], padding: float | None) -> list[list[int]]:
    """Records grouped by length for the backbone's passes, so that short records are not padded to the longest:
    sorted by length, a group grows while its padded size (records x its longest) stays within `padding` times
    its real tokens. `padding` None: one group, the whole batch (padded to its longest record)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if padding is None or not order:
        return [list(range(len(lengths)))]
    groups: list[list[int]] = [[]]
    real = 0
    for i in order:
        group = groups[-1]
        if group and (len(group) + 1) * lengths[i] > padding * (real + lengths[i]):
            groups.append([])
            group, real = groups[-1], 0
        group.append(i)
        real += lengths[i]
    return [sorted(g) for g in groups]


class ChatSerializer:
    """Per-segment tokenisation of conversations with a tokenizer's chat template."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_seq_len: int = 40_960,
        placeholder_id: int | None = None,
    ) -> None:
        self.tok = tokenizer
        self.max_seq_len = max_seq_len
        if placeholder_id is None:
            placeholder_id = next(
                t for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None
            )
        self.placeholder_id = int(placeholder_id)
        probe = [Message("system", "s"), Message("user", "u")]
        sample = [Message("system", "System text."), Message("user", "Some task?"), Message("assistant", "An answer.")]
        scaffolds = self._scaffolds(sample)
        joined = "".join(s + m.content for s, m in zip(scaffolds, sample, strict=False)) + scaffolds[-1]
        if joined != self._render(sample):
            raise ValueError("chat template rewrites message contents (e.g. strips or escapes them); not supported")
        plain = self._render(probe)
        with_prompt = self._render(probe, add_generation_prompt=True)
        if not with_prompt.startswith(plain):
            raise ValueError("chat template is not prefix-stable: the generation prompt rewrites earlier text")
        self.generation_header = with_prompt[len(plain) :]
        after_assistant = self._scaffolds([*probe, Message("assistant", "a")])[3]
        ids = self._encode(after_assistant)
        if not ids or ids[0] not in set(tokenizer.all_special_ids):
            raise ValueError(
                f"chat template: expected a special end-of-turn token after assistant content, got {after_assistant!r}"
            )
        self.end_of_turn_id = ids[0]

    # ------------------------------------------------------------------------------------ rendering

    def _render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        dicts = [{"role": m.role, "content": m.content} for m in messages]
        return self.tok.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _scaffolds(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> list[str]:
        """Template text around the contents: scaffolds[i] precedes message i, scaffolds[-1] ends the text."""
        marked = [Message(m.role, _SENTINEL.format(i)) for i, m in enumerate(messages)]
        text = self._render(marked, add_generation_prompt)
        parts = _SENTINEL_RE.split(text)
        scaffolds, order = parts[0::2], [int(x) for x in parts[1::2]]
        if order != list(range(len(messages))):
            raise ValueError("chat template reorders, drops or duplicates message contents; it is not supported")
        return scaffolds

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] if text else []

    # ---------------------------------------------------------------------------------------- views

    def view(self, messages: Sequence[Message], context: TeacherContext | None = None) -> TokenView:
        """The token view of a whole conversation; with `context`, the teacher's view."""
        messages = list(messages)
        scaffolds = self._scaffolds(messages)
        first_user = next((i for i, m in enumerate(messages) if m.role == "user"), None)
        if first_user is None:
            raise ValueError("a conversation needs a user message (the task)")
        ids: list[int] = []
        mask: list[int] = []
        view = TokenView(ids, mask, insert_pos=-1)
        supervise_next = False

        def add(piece: list[int], supervised: bool = False) -> None:
            ids.extend(piece)
            mask.extend([int(supervised)] * len(piece))

        for i, msg in enumerate(messages):
            scaffold = scaffolds[i]
            if msg.role == "assistant":
                if not scaffold.endswith(self.generation_header):
                    raise ValueError("chat template: the assistant header differs from the generation prompt")
                head = scaffold[: len(scaffold) - len(self.generation_header)]
                self._add_scaffold(add, head, supervise_next)
                add(self._encode(self.generation_header))
            else:
                self._add_scaffold(add, scaffold, supervise_next)
            if i == first_user:
                view.insert_pos = len(ids)
                if context is not None:
                    self._add_context(view, add, context)
            if msg.role == "assistant":
                content = msg.token_ids if msg.token_ids is not None else self._encode(msg.content)
                view.assistant_spans.append((len(ids), len(ids) + len(content)))
                add(list(content), supervised=True)
                supervise_next = not msg.truncated
            else:
                add(self._encode(msg.content))
                supervise_next = False
        self._add_scaffold(add, scaffolds[-1], supervise_next)
        return view  # longer than max_seq_len (the latent span included): is_overlength, the caller decides

    def _add_scaffold(self, add, text: str, supervise_first: bool) -> None:  # type: ignore[no-untyped-def]
        piece = self._encode(text)
        if supervise_first and piece:
            if piece[0] != self.end_of_turn_id:
                raise ValueError("chat template: assistant content is not followed by the end-of-turn token")
            add(piece[:1], supervised=True)
            piece = piece[1:]
        add(piece)

    def _add_context(self, view: TokenView, add, context: TeacherContext) -> None:  # type: ignore[no-untyped-def]
        start = len(view.input_ids)
        for piece in context.pieces:
            if isinstance(piece, LatentSpan):
                if view.latent_start >= 0:
                    raise ValueError("a teacher context may hold one latent span")
                view.latent_start, view.latent_len = len(view.input_ids), piece.length
                add([self.placeholder_id] * piece.length)
            else:
                add(self._encode(piece))
        view.offset = len(view.input_ids) - start

    def student_view(self, trajectory: Trajectory | Sequence[Message]) -> TokenView:
        messages = trajectory.messages if isinstance(trajectory, Trajectory) else trajectory
        return self.view(messages)

    def teacher_view(self, trajectory: Trajectory | Sequence[Message], context: TeacherContext) -> TokenView:
        messages = trajectory.messages if isinstance(trajectory, Trajectory) else trajectory
        return self.view(messages, context)

    def prompt_ids(self, messages: Sequence[Message], context: TeacherContext | None = None) -> list[int]:
        """Token ids to generate the next assistant turn from: the view of `messages` + the assistant header."""
        if messages and messages[-1].role == "assistant":
            raise ValueError("prompt_ids: the last message is already an assistant turn")
        return self.view(messages, context).input_ids + self._encode(self.generation_header)

    def is_overlength(self, view: TokenView) -> bool:
        """Whether the view is longer than max_seq_len: any part of it, the latent span included."""
        return len(view) > self.max_seq_len

    # ------------------------------------------------------------------------------------- batching

    def collate(self, views: Sequence[TokenView]) -> TokenBatch:
        if not views:
            raise ValueError("collate needs at least one view")
        latent_lens = {v.latent_len for v in views}
        if len(latent_lens) > 1:
            raise ValueError(f"views disagree on the latent span length: {sorted(latent_lens)}")
        T = max(len(v) for v in views)
        B = len(views)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.placeholder_id
        input_ids = torch.full((B, T), pad, dtype=torch.long)
        attention = torch.zeros(B, T, dtype=torch.long)
        action = torch.zeros(B, T)
        for b, v in enumerate(views):
            n = len(v)
            input_ids[b, :n] = torch.tensor(v.input_ids)
            attention[b, :n] = 1
            action[b, :n] = torch.tensor(v.action_mask, dtype=torch.float)
        return TokenBatch(
            input_ids=input_ids,
            attention_mask=attention,
            action_mask=action,
            offsets=torch.tensor([v.offset for v in views]),
            insert_pos=torch.tensor([v.insert_pos for v in views]),
            latent_start=torch.tensor([v.latent_start for v in views]),
            latent_len=latent_lens.pop(),
            lengths=[len(v) for v in views],
        )


def aligned_action_positions(
    student: TokenBatch, teacher: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index every supervised student token and the positions that predict it in both views.

    Returns (rows, student_pos, teacher_pos, targets), each [N]: `student_pos` and `teacher_pos` index the
    hidden states whose next-token distribution scores `targets` (the position just before the token), so
    `hidden_s[rows, student_pos]` and `hidden_t[rows, teacher_pos]` are the aligned pair for token n.
    """
    rows, cols = student.action_mask.nonzero(as_tuple=True)
    if (cols == 0).any():
        raise ValueError("a supervised token at position 0 has no predicting position")
    if (cols < student.insert_pos[rows]).any():
        raise ValueError("a supervised token precedes the teacher's context insertion point")
    teacher_cols = cols + teacher.offsets[rows] - student.offsets[rows]
    targets = student.input_ids[rows, cols]
    if not torch.equal(teacher.input_ids[rows, teacher_cols], targets):
        raise ValueError("student and teacher views disagree on action tokens at the aligned positions")
    return rows, cols - 1, teacher_cols - 1, targets
