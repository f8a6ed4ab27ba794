"""The text teacher as a policy (a diagnostic, DESIGN.md §6): the frozen teacher of OPSD, SDFT or Skill-SD acting
with its privileged context, on the same tasks as the student.

    contexts = {task.task_id: TeacherContext.text(privileged_text(solution_text(trace))) for ...}
    trajectories = TextTeacherRollout(teacher_model, tokenizer, RolloutConfig(temperature=0), contexts)(episodes)

Each turn's prompt is the teacher view of the conversation so far (`ChatSerializer.view` with the task's context in
front of the first user message's content), token for token what the teacher reads at training time. A teacher
that loses to its student as a policy cannot teach it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.base import Episode
from lopd_core.rollout import LiveEpisode, RolloutConfig, RolloutEngine
from lopd_core.serialization import ChatSerializer, TeacherContext


class _ContextSerializer(ChatSerializer):
    """Prompts with the context of the conversation's task (found by its first user message) in front of it."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.by_task_text: dict[str, TeacherContext | None] = {}

    def prompt_ids(self, messages: Sequence[Message], context: TeacherContext | None = None) -> list[int]:
        if context is None:
            first = next((m.content for m in messages if m.role == "user"), None)
            context = self.by_task_text.get(first) if first is not None else None
        return super().prompt_ids(messages, context)


class TextTeacherRollout(RolloutEngine):
    """Roll out episodes with `model` reading each task's text context (`contexts`: task id -> context; a task
    without one is played without context and counted in `n_without_context`). Callable as a harness policy."""

    def __init__(
        self, model: Any, tokenizer: Any, config: RolloutConfig, contexts: Mapping[str, TeacherContext | None]
    ) -> None:
        self._serializer = _ContextSerializer(tokenizer)
        super().__init__(model, tokenizer, config, self._serializer)
        self.contexts = contexts
        self.n_without_context = 0

    def _open(self, index: int, episode: Episode) -> LiveEpisode:
        state = super()._open(index, episode)
        context = self.contexts.get(episode.task.task_id)
        self.n_without_context += context is None
        first = next((m.content for m in state.messages if m.role == "user"), None)
        if first is not None:
            if self._serializer.by_task_text.get(first, context) != context:
                raise ValueError(f"two tasks share the text {first[:60]!r} but not their teacher context")
            self._serializer.by_task_text[first] = context
        return state

    def __call__(self, episodes: Sequence[Episode]) -> list[Trajectory]:
        trajectories = self.run(episodes, desc="teacher rollout")
        for t in trajectories:
            t.metadata["context"] = "teacher"
        return trajectories
