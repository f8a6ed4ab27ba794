"""Per-segment views: action tokens identical in student and teacher views, aligned by a known offset."""

from __future__ import annotations

import pytest
import torch

from lopd_core.conversation import Message, Trajectory
from lopd_core.serialization import ChatSerializer, TeacherContext, aligned_action_positions

CONVERSATIONS = [
    [Message("system", "sys"), Message("user", "task one"), Message("assistant", "answer")],
    [
        Message("system", "You are an agent. Tools: ls(path)"),
        Message("user", "List /a then read x"),
        Message("assistant", '{"name": "ls", "arguments": {"path": "/a"}}'),
        Message("tool", '["x", "y"]'),
        Message("assistant", '<tool_call>{"name": "read", "arguments": {"f": "x"}}</tool_call>'),
        Message("tool", "contents of x"),
        Message("assistant", "Done: x holds 'contents of x'."),
    ],
    [  # multi-turn benchmark shape: a second user turn, an empty assistant turn, a truncated turn
        Message("system", "s"),
        Message("user", "first"),
        Message("assistant", ""),
        Message("user", "second turn"),
        Message("assistant", "partial answer that was cut", truncated=True),
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("context", [TeacherContext.latent(12), TeacherContext.text("Past success: ls /a.")])
def test_action_tokens_identical_at_aligned_positions(tiny, messages, context):
    _, tok = tiny
    ser = ChatSerializer(tok)
    student, teacher = ser.student_view(messages), ser.teacher_view(messages, context)
    assert len(teacher) == len(student) + teacher.offset
    # everything after the insertion point is shifted by exactly `offset`
    p = student.insert_pos
    assert teacher.input_ids[:p] == student.input_ids[:p]
    assert teacher.input_ids[p + teacher.offset :] == student.input_ids[p:]
    assert teacher.action_mask[p + teacher.offset :] == student.action_mask[p:]
    _rows, s_pos, t_pos, targets = aligned_action_positions(ser.collate([student]), ser.collate([teacher]))
    assert targets.numel() == student.n_action_tokens > 0
    assert torch.equal(torch.tensor(student.input_ids)[s_pos + 1], torch.tensor(teacher.input_ids)[t_pos + 1])
    if context.n_latents:
        span = teacher.input_ids[teacher.latent_start : teacher.latent_start + teacher.latent_len]
        assert span == [ser.placeholder_id] * 12 and teacher.latent_len == 12


def test_supervised_tokens_are_assistant_content_and_sampled_end_of_turn(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok)
    messages = CONVERSATIONS[2]
    view = ser.student_view(messages)
    supervised = [i for i, m in zip(view.input_ids, view.action_mask, strict=True) if m]
    cut = tok("partial answer that was cut", add_special_tokens=False)["input_ids"]
    # empty turn: only its end-of-turn; truncated turn: content without an end-of-turn
    assert supervised == [ser.end_of_turn_id, *cut]
    text = tok.decode(view.input_ids)
    assert text == tok.apply_chat_template([{"role": m.role, "content": m.content} for m in messages], tokenize=False)


def test_sampled_token_ids_are_used_verbatim(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok)
    odd = tok("ans", add_special_tokens=False)["input_ids"] + tok("wer", add_special_tokens=False)["input_ids"]
    messages = [Message("system", "s"), Message("user", "u"), Message("assistant", "answer", token_ids=odd)]
    view = ser.student_view(messages)
    supervised = [i for i, m in zip(view.input_ids, view.action_mask, strict=True) if m]
    assert supervised == [*odd, ser.end_of_turn_id]


def test_prompt_ids_is_a_prefix_of_the_training_view(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok)
    messages = CONVERSATIONS[1]
    full = ser.student_view(messages).input_ids
    for k, m in enumerate(messages):
        if m.role == "assistant":
            prompt = ser.prompt_ids(messages[:k])
            assert full[: len(prompt)] == prompt
    with pytest.raises(ValueError, match="already an assistant"):
        ser.prompt_ids(messages[:3])


def test_latent_span_past_limit_and_overlength(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok, max_seq_len=64)
    messages = CONVERSATIONS[1]
    view = ser.teacher_view(messages, TeacherContext.latent(96))  # the span runs past the limit: over length
    assert view.latent_start + view.latent_len > 64 and ser.is_overlength(view)
    assert ser.is_overlength(ser.student_view(messages))
    with pytest.raises(ValueError, match="positive"):
        TeacherContext.latent(0)


def test_collate_rejects_mixed_span_sizes(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok)
    a = ser.teacher_view(CONVERSATIONS[0], TeacherContext.latent(4))
    b = ser.teacher_view(CONVERSATIONS[0], TeacherContext.latent(5))
    with pytest.raises(ValueError, match="latent span length"):
        ser.collate([a, b])


def test_alignment_detects_mismatched_views(tiny):
    _, tok = tiny
    ser = ChatSerializer(tok)
    student = ser.student_view(CONVERSATIONS[0])
    other = ser.teacher_view(CONVERSATIONS[1][:3], TeacherContext.latent(4))
    with pytest.raises(ValueError, match="disagree"):
        aligned_action_positions(ser.collate([student]), ser.collate([other]))


def test_trajectory_round_trip_and_validation():
    traj = Trajectory("t1", "env", "task", CONVERSATIONS[1], reward=0.5, metadata={"generations": 1})
    assert Trajectory.from_json(traj.to_json()) == traj
    with pytest.raises(ValueError, match="reward"):
        Trajectory("t1", "env", "task", CONVERSATIONS[0], reward=1.5)
    with pytest.raises(ValueError, match="role"):
        Message("robot", "x")  # type: ignore[arg-type]


def test_template_that_rewrites_content_is_rejected(tiny):
    _, tok = tiny
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ValueError):
        ChatSerializer(tok)
