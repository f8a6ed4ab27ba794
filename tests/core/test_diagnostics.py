"""Teacher diagnostics (lopd_core/diagnostics.py): hand-checked values, and the train step's per-step figures
against an independent float64 brute force over the full vocabulary."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from lopd_core.config import LOPDConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.diagnostics import marked_positions, order_auc, teacher_diagnostics
from lopd_core.envs.toolworld.rules import HouseRules
from lopd_core.methods import PRIVILEGED_HEADER, build_method
from lopd_core.models import build_models
from lopd_core.serialization import ChatSerializer

RULES = HouseRules.draw(0)


def test_order_auc_hand_checked():
    # successes {0.3, 0.2} vs failures {0.1, 0.2}: 0.3 > both (2), 0.2 > 0.1 (1), 0.2 = 0.2 (1/2) -> 3.5 / 4
    assert order_auc([0.3, 0.1, 0.2, 0.2], [True, False, True, False]) == 0.875
    assert order_auc([0.0, 1.0], [True, False]) == 0.0
    assert order_auc([1.0, 2.0], [True, True]) is None and order_auc([], []) is None


def test_teacher_diagnostics_against_brute_force():
    gen = torch.Generator().manual_seed(0)
    n, records = 40, 5
    privilege = torch.randn(n, generator=gen)
    rows = torch.sort(torch.randint(0, records, (n,), generator=gen)).values
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0])
    marked = (torch.rand(n, generator=gen) < 0.3).float()
    metrics, weights = teacher_diagnostics(privilege, rows, rewards, marked)

    d, r, m = privilege.double().tolist(), rows.tolist(), marked.tolist()
    win = {
        "success": lambda i: rewards[r[i]] >= 1, "failure": lambda i: rewards[r[i]] < 1,
        "rule": lambda i: m[i] == 1, "other": lambda i: m[i] == 0,
        "rule_success": lambda i: m[i] == 1 and rewards[r[i]] >= 1,
        "rule_failure": lambda i: m[i] == 1 and rewards[r[i]] < 1,
    }  # fmt: skip
    for name, keep in win.items():
        values = [d[i] for i in range(n) if keep(i)]
        assert metrics[f"privilege_{name}"] == pytest.approx(sum(values) / len(values), abs=1e-12)
        assert weights[f"privilege_{name}"] == len(values)
    sequence = {b: [d[i] for i in range(n) if r[i] == b] for b in set(r)}
    means = {b: sum(v) / len(v) for b, v in sequence.items()}
    pos = [means[b] for b in means if rewards[b] >= 1]
    neg = [means[b] for b in means if rewards[b] < 1]
    pairs = list(itertools.product(pos, neg))
    assert metrics["order_auc"] == pytest.approx(sum((p > q) + 0.5 * (p == q) for p, q in pairs) / len(pairs))
    assert metrics["n_rule_tokens"] == sum(m)


def _trajectory(task_id: str, code: str, reward: float) -> Trajectory:
    return Trajectory(
        task_id=task_id, env_id="toolworld_messaging", task=f"Send hello to Ana ({task_id})", reward=reward,
        messages=[
            Message("system", "Environment: toolworld_messaging"),
            Message("user", f"Send hello to Ana ({task_id})"),
            Message("assistant", f'{{"tool": "send_message", "to": "Ana", "text": "hello", "code": "{code}"}}'),
            Message("tool", '{"success": true}'),
            Message("assistant", "Done."),
        ],
    )  # fmt: skip


def test_marked_positions_cover_exactly_the_code_value(tiny):
    _, tok = tiny
    serializer = ChatSerializer(tok)
    traj = _trajectory("t0", "G-way 17", 1.0)
    view = serializer.student_view(traj)
    positions = marked_positions(view, traj, tok, RULES.spans)
    assert positions and all(view.action_mask[p] == 1 for p in positions)
    assert tok.decode([view.input_ids[p] for p in positions]).strip('"') == "way 17"
    assert marked_positions(view, _trajectory("t1", "", 0.0), tok, lambda text: []) == []


def test_step_diagnostics_equal_a_float64_full_vocabulary_brute_force(tiny):
    """OPSD's step on two rollouts (a success with the right code, a failure with a wrong one): the logged
    privilege by outcome and by rule token equals log pT(a) - log pS(a) from plain float64 forwards of the student
    and teacher views, with the rule tokens found from the tokenizer's character offsets."""
    model, tok = tiny
    cfg = LOPDConfig(method="opsd", n_queries=4, qformer_layers=2, encoder_max_tokens=64)
    models = build_models(model, tok, cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a student that differs from its teacher
        for n, p in models.backbone.named_parameters():
            if ".student." in n and "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    batch = [_trajectory("t0", "urn 42", 1.0), _trajectory("t1", "way 17", 0.0)]
    solution = '{"name": "send_message", "arguments": {"code": "urn 42"}} -> {"success": true}'
    strategy, objective = build_method(models, cfg, solutions=lambda task_id: solution)
    rows = []

    class Sink:
        def log(self, step, metrics):
            rows.append(dict(metrics))

    from lopd_core.step import TrainStep

    reference = copy.deepcopy(models.backbone).double()  # before the step's update
    step = TrainStep(models, ChatSerializer(tok), strategy, objective, cfg, Sink(), token_marks=RULES.spans)
    step(batch)
    (logged,) = rows

    deltas = {"success": [], "failure": [], "rule": [], "other": [], "rule_success": [], "rule_failure": []}
    sequence = []
    for traj in batch:
        context = PRIVILEGED_HEADER + f"A verified successful solution of this task:\n{solution}" + "\n\n"
        s_ids, s_targets = _plain_ids(tok, traj.messages)
        t_ids, t_targets = _plain_ids(tok, traj.messages, context)
        assert [a for a, *_ in s_targets] == [a for a, *_ in t_targets]
        with torch.no_grad():
            s_logp = _logp(reference, s_ids, adapter="student")
            t_logp = _logp(reference, t_ids, adapter=None)
        seq = []
        for (token, s_pos, is_rule), (_, t_pos, _) in zip(s_targets, t_targets, strict=True):
            delta = t_logp[t_pos - 1, token].item() - s_logp[s_pos - 1, token].item()
            outcome = "success" if traj.reward >= 1 else "failure"
            deltas[outcome].append(delta)
            deltas["rule" if is_rule else "other"].append(delta)
            if is_rule:
                deltas[f"rule_{outcome}"].append(delta)
            seq.append(delta)
        sequence.append(sum(seq) / len(seq))
    for name, values in deltas.items():
        assert logged[f"privilege_{name}"] == pytest.approx(sum(values) / len(values), abs=2e-5), name
    assert logged["n_rule_tokens"] == len(deltas["rule"]) == 2 * 3  # "urn", " ", "42" and "way", " ", "17"
    assert logged["order_auc"] == (1.0 if sequence[0] > sequence[1] else 0.0)


def _plain_ids(tok, messages, context: str | None = None):
    """The ChatML text built by hand (no serializer): ids, and (token, position, is_rule) of each assistant content
    token plus its end-of-turn token, the rule tokens found by character offsets."""
    ids, targets = [], []
    for i, m in enumerate(messages):
        ids += tok(f"<|im_start|>{m.role}\n", add_special_tokens=False)["input_ids"]
        if context is not None and m.role == "user" and all(x.role != "user" for x in messages[:i]):
            ids += tok(context, add_special_tokens=False)["input_ids"]
        enc = tok(m.content, add_special_tokens=False, return_offsets_mapping=True)
        rule = [m.content.index(c) for c in ("urn 42", "way 17") if c in m.content]
        for token, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
            if m.role == "assistant":
                is_rule = any(start < r + 6 and r < end for r in rule)
                targets.append((token, len(ids), is_rule))
            ids.append(token)
        end_ids = tok("<|im_end|>\n", add_special_tokens=False)["input_ids"]
        if m.role == "assistant":
            targets.append((end_ids[0], len(ids), False))
        ids += end_ids
    return ids, targets


def _logp(model, ids, adapter):
    from lopd_core.adapters import AdapterSwitch

    with AdapterSwitch(model).use(adapter):
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def test_retrieval_same_env_share(tiny):
    model, tok = tiny
    cfg = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64, n_retrieved=2)
    models = build_models(model, tok, cfg)
    docs = {"Task: a\nTrace: x": "toolworld_messaging", "Task: b\nTrace: y": "toolworld_bank"}
    strategy, _ = build_method(models, cfg, retrieve=lambda task, task_id: list(docs), source_env=docs.get)
    batch = [_trajectory("t0", "urn 42", 1.0), _trajectory("t1", "way 17", 0.0)]
    strategy.inputs(batch)
    assert strategy.metrics()["retrieval_same_env"] == 0.5  # one of the two retrieved items is from messaging
