"""The warm start: verified demonstrations of the training split only (and the generator's pool, disjoint from
every shipped scenario), the validation slice, the study student's tokenizer, the SFT loop and its schedule."""

from __future__ import annotations

import copy
import json
import math
from collections import Counter
from dataclasses import replace

import pytest
import torch

from lopd_core.backbone import load_backbone
from lopd_core.config import SFTConfig
from lopd_core.envs.base import VALIDATION, WithValidation
from lopd_core.envs.envscaler import EnvScalerSuite, load_env_items
from lopd_core.envs.toolworld import DATA_DIR, ENV_FILE, SPLIT_FILES, load_toolworld
from lopd_core.envs.toolworld.generate import fingerprint, training_pool
from lopd_core.methods import SolutionContext
from lopd_core.serialization import ChatSerializer, TeacherContext
from lopd_core.sft import copy_loss, demonstrations, lr_at, nll, reference_actions, sft, with_privileged_solution


@pytest.fixture(scope="module")
def suite():
    suite = load_toolworld(prompt="compact")
    yield suite
    suite.close()


def test_validation_slice_is_stratified_disjoint_and_seeded(suite):
    a, b = WithValidation(suite, 0.1), WithValidation(suite, 0.1)
    train, val = a.tasks("train"), a.tasks(VALIDATION)
    assert {t.task_id for t in val} == {t.task_id for t in b.tasks(VALIDATION)}  # deterministic
    assert not {t.task_id for t in train} & {t.task_id for t in val}
    assert len(train) + len(val) == len(suite.tasks("train"))
    assert all(t.split == VALIDATION for t in val) and all(t.split == "train" for t in train)
    groups = Counter((t.env_id, t.difficulty) for t in suite.tasks("train"))
    held = Counter((t.env_id, t.difficulty) for t in val)
    assert all(held[g] == round(0.1 * n) for g, n in groups.items())  # every (env, level) group gives its share
    assert a.tasks("eval") == suite.tasks("eval")
    assert {t.task_id for t in WithValidation(suite, 0.1, seed=1).tasks(VALIDATION)} != {t.task_id for t in val}
    with pytest.raises(ValueError, match="fraction"):
        WithValidation(suite, 1.0)


def test_demonstrations_replay_reference_solutions_and_refuse_other_splits(suite):
    split = WithValidation(suite, 0.1)
    tasks = [t for t in split.tasks("train") if t.difficulty in (1, 3)][:6]
    demos, dropped = demonstrations(split, tasks)
    assert not dropped and len(demos) == len(tasks)
    for demo, task in zip(demos, tasks, strict=True):
        assert demo.reward == 1.0 and demo.split == "train" and demo.task_id == task.task_id
        actions = [m.content for m in demo.messages if m.role == "assistant"]
        assert actions == reference_actions(split.scenario(task.task_id))
        assert actions[-1] == "Done." and json.loads(actions[0])["tool"]
        assert [m.role for m in demo.messages[:2]] == ["system", "user"]  # the student's own prompt format
    with pytest.raises(ValueError, match="training split only"):
        demonstrations(split, split.tasks("eval")[:1])
    with pytest.raises(ValueError, match="training split only"):
        demonstrations(split, split.tasks(VALIDATION)[:1])


def test_the_generator_pool_never_holds_a_held_out_task_or_instance():
    shipped = {split: json.loads((DATA_DIR / name).read_text()) for split, name in SPLIT_FILES.items()}
    pool = training_pool(6, levels=(1, 2, 3))
    assert len(pool) == 8 * 3 * 6 and len({p["task_id"] for p in pool}) == len(pool)
    for split in ("eval", "train"):  # the held-out split, and the training split that holds the validation slice
        instances = {fingerprint(item) for item in shipped[split]}
        texts = {(item["env_id"], item["task"]) for item in shipped[split]}
        assert not instances & {fingerprint(p) for p in pool}
        assert not texts & {(p["env_id"], p["task"]) for p in pool}
    assert training_pool(6, levels=(1, 2, 3)) == pool  # seeded
    replay = EnvScalerSuite(load_env_items(DATA_DIR / ENV_FILE), {"train": pool[:8]}, config=load_toolworld().config)
    demos, dropped = demonstrations(replay, replay.tasks("train"))
    assert len(demos) == 8 and not dropped
    replay.close()


def test_study_tokenizer_copies_ids_exactly():
    _, tok = load_backbone("toolworld-1m")
    task, call = "Freeze account ACC-9337.", '{"tool": "freeze_account", "account_id": "ACC-9337"}'
    ids_task, ids_call = tok(task)["input_ids"], tok(call)["input_ids"]
    piece = tok("ACC-9337", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(piece) == ["ACC-", "93", "37"]  # the prefix with its dash, digit pairs
    assert any(ids_task[i : i + 3] == piece for i in range(len(ids_task)))  # the same tokens in the task ...
    assert any(ids_call[i : i + 3] == piece for i in range(len(ids_call)))  # ... and inside the call
    for text in (call, 'Zoë "quoted" 3.50\n\tend'):
        assert tok.decode(tok(text)["input_ids"]) == text


def test_capacity_probe_student_shares_the_study_tokenizer():
    small, tok_small = load_backbone("toolworld-1m")
    wide, tok_wide = load_backbone("toolworld-4m")
    assert tok_wide.get_vocab() == tok_small.get_vocab()  # only the width differs: same tokens, same prompts
    assert wide.config.hidden_size == 2 * small.config.hidden_size
    assert wide.config.num_hidden_layers == small.config.num_hidden_layers
    assert wide.config.hidden_size // wide.config.num_attention_heads == 32  # vLLM's CPU kernels need 32
    assert 3.5e6 < sum(p.numel() for p in wide.parameters()) < 4e6


def test_lr_schedule_hand_checked():
    cfg = SFTConfig(steps=110, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way: cos = 0
    assert lr_at(110, cfg) == pytest.approx(1e-4)


def test_sft_lowers_the_demonstrations_nll_and_nll_matches_a_brute_force(suite):
    torch.manual_seed(0)
    model, tok = load_backbone("tiny")
    demos, _ = demonstrations(suite, [t for t in suite.tasks("train") if t.difficulty == 1][:8])
    serializer = ChatSerializer(tok)
    with torch.no_grad():
        before = nll(model, serializer, demos).item()
        view = serializer.student_view(demos[0])  # brute force, one record: full logits, float64
        logits = model(input_ids=torch.tensor([view.input_ids])).logits[0].double()
        logp = logits.log_softmax(-1)
        terms = [-logp[t - 1, view.input_ids[t]].item() for t, m in enumerate(view.action_mask) if m]
        assert nll(model, serializer, demos[:1]).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    losses = sft(model, tok, demos, SFTConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=3), progress=False)
    with torch.no_grad():
        after = nll(model, serializer, demos).item()
    assert after < 0.5 * before and losses[-1] < losses[0]


def test_copy_pretraining_data_is_a_repeated_span():
    model, _ = load_backbone("tiny")
    g = torch.Generator().manual_seed(0)
    loss = copy_loss(model, g, batch_size=4, span=8, length=32)
    assert math.isfinite(loss.item()) and loss.item() > 1.0  # an untrained model cannot copy yet


def test_a_privileged_demonstration_is_token_for_token_what_opsd_s_teacher_reads(suite):
    """sft.privileged_fraction: the demonstration with its own solution in front of the task has exactly the token
    view (ids and supervised positions) of OPSD's teacher view of it, so the warm start has seen that context."""
    _, tok = load_backbone("tiny")
    serializer = ChatSerializer(tok)
    demos, _ = demonstrations(suite, [t for t in suite.tasks("train") if t.difficulty in (1, 2)][:3])
    opsd = SolutionContext.__new__(SolutionContext)  # only its describe(): the solutions lookup below
    opsd.solutions = {d.task_id: d.trace for d in demos}.get
    for demo in demos:
        (context,) = SolutionContext.contexts(opsd, [demo])
        assert isinstance(context, TeacherContext) and demo.trace in context.pieces[0]
        privileged = serializer.student_view(with_privileged_solution(demo))
        teacher = serializer.teacher_view(demo, context)
        assert privileged.input_ids == teacher.input_ids and list(privileged.action_mask) == list(teacher.action_mask)
        assert with_privileged_solution(demo).task_id == demo.task_id + "#privileged"


def test_copy_probe_matches_a_float64_brute_force():
    """lopd_core.diagnostics.copy_probe against full-vocabulary float64 log-probs of each written alternative with
    each shown one, on the tiny random model (which reads nothing: near chance)."""
    from lopd_core.diagnostics import copy_probe
    from lopd_core.envs.toolworld import open_toolworld

    ruled = open_toolworld("toolworld-rules")
    model, tok = load_backbone("tiny")
    model.eval()
    serializer = ChatSerializer(tok)
    demos, _ = demonstrations(ruled, [t for t in ruled.tasks("train") if t.difficulty == 1][:3])
    got = copy_probe(model, serializer, ruled.rules, demos)
    right, wrong = [], []
    model64 = copy.deepcopy(model).double()
    for d in demos:
        rule = ruled.rules.rules[d.env_id]
        for shown in rule.alternatives:
            solution = ruled.rules.recode(d, shown).trace
            logps = []
            for w in rule.alternatives:
                view = serializer.student_view(
                    with_privileged_solution(replace(ruled.rules.recode(d, w), trace=solution))
                )
                ids = torch.tensor([view.input_ids])
                with torch.no_grad():
                    logp = torch.log_softmax(model64(input_ids=ids).logits[0], -1)
                logps.append(sum(logp[t - 1, view.input_ids[t]].item() for t, m in enumerate(view.action_mask) if m))
            p = math.exp(logps[rule.alternatives.index(shown)]) / sum(math.exp(x) for x in logps)
            (right if shown == rule.code else wrong).append(p)
    assert got["n_demonstrations"] == 3 and got["chance"] == 0.5
    assert got["p_shown_right"] == pytest.approx(sum(right) / len(right), abs=1e-4)
    assert got["p_shown_wrong"] == pytest.approx(sum(wrong) / len(wrong), abs=1e-4)
    assert got["p_shown"] == pytest.approx(sum(right + wrong) / len(right + wrong), abs=1e-4)
    assert abs(got["p_shown"] - 0.5) < 0.1  # a random model reads (almost) nothing: 1/k whatever it prefers


def test_pool_codes_need_copies_and_house_rules(tmp_path):
    from components.sft import SFTSpec, run_sft

    with pytest.raises(ValueError, match="privileged_fraction > 0"):
        SFTConfig(privileged_codes="pool")
    cfg = SFTConfig(steps=1, batch_size=2, n_demonstrations=2, privileged_fraction=0.5, privileged_codes="pool")
    spec = SFTSpec(run_dir=str(tmp_path), backbone="tiny", suite="toolworld-compact", sft=cfg,
                   tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")  # fmt: skip
    with pytest.raises(ValueError, match="privileged_codes: pool draws house codes"):
        run_sft(spec)
