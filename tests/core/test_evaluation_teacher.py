"""The text teacher as a policy (lopd_core/evaluation/teacher.py): its prompts are the teacher views of training."""

from __future__ import annotations

import torch

from lopd_core.envs.toolworld import open_toolworld
from lopd_core.evaluation.teacher import TextTeacherRollout
from lopd_core.methods import privileged_text, solution_text
from lopd_core.rollout import RolloutConfig
from lopd_core.serialization import ChatSerializer, TeacherContext


def test_each_task_is_played_with_its_own_context_in_front(tiny):
    model, tok = tiny
    suite = open_toolworld("toolworld-rules")
    tasks = suite.tasks("eval")[:3]
    contexts = {t.task_id: TeacherContext.text(privileged_text(solution_text(f"solution of {t.task_id}")))
                for t in tasks[:2]}  # fmt: skip
    config = RolloutConfig(temperature=0.0, max_turns=1, max_new_tokens=6, batch_size=3, progress=False)
    trajectories = TextTeacherRollout(model, tok, config, contexts)([suite.episode(t) for t in tasks])
    assert [t.metadata["context"] for t in trajectories] == ["teacher"] * 3
    serializer = ChatSerializer(tok)
    for task, trajectory in zip(tasks, trajectories, strict=True):
        first = trajectory.messages[: next(i for i, m in enumerate(trajectory.messages) if m.role == "assistant")]
        prompt = serializer.prompt_ids(first, contexts.get(task.task_id))  # the training teacher view + header
        expected = []
        with torch.no_grad():
            ids = list(prompt)
            for _ in range(len(trajectory.messages[len(first)].token_ids)):
                token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                expected.append(token)
                ids.append(token)
        assert trajectory.messages[len(first)].token_ids == expected, task.task_id
