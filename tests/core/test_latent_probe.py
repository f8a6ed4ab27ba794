"""The latent-dependence probe (lopd_core.latent_probe) against a float64 full-vocabulary brute force, and its
behaviour on a teacher whose latents cannot carry anything; the cold start's code relabelling."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lopd_core.backbone import load_backbone
from lopd_core.cold_start import cold_start
from lopd_core.config import ColdStartConfig, LOPDConfig
from lopd_core.conversation import experience_document
from lopd_core.diagnostics import marked_positions
from lopd_core.envs.toolworld import open_toolworld
from lopd_core.latent_probe import latent_probe, probe_contexts, probe_targets
from lopd_core.models import build_models, splice_latents
from lopd_core.serialization import ChatSerializer, TeacherContext
from lopd_core.sft import demonstrations

CFG = LOPDConfig(n_retrieved=2, n_queries=2, qformer_layers=1, encoder_max_tokens=96)


@pytest.fixture(scope="module")
def ruled():
    return open_toolworld("toolworld-rules-s1-digits")


@pytest.fixture(scope="module")
def demos(ruled):
    """Verified demonstrations of level-1 training tasks, three per environment of two environments."""
    envs = ("toolworld_bank", "toolworld_shop")
    tasks = [t for e in envs for t in [t for t in ruled.tasks("train") if t.env_id == e and t.difficulty == 1][:3]]
    kept, _ = demonstrations(ruled, tasks)
    assert {d.env_id for d in kept} == set(envs)
    return kept


def bank_of(demos):
    """(task, task_id, env) -> the documents of the other demonstrations of env (never the task's own)."""

    def experiences(task, task_id, env):
        return [experience_document(d.task, d.trace) for d in demos if d.env_id == env and d.task_id != task_id]

    return experiences


def test_probe_contexts_read_own_other_none_and_rewritten(ruled, demos):
    experiences = bank_of(demos)
    target = demos[0]
    contexts, code = probe_contexts(ruled.rules, target, experiences, sorted(ruled.rules.rules))
    rule = ruled.rules.rules[target.env_id]
    assert contexts["own"] == experiences(target.task, target.task_id, target.env_id)
    assert contexts["own"] and all(target.trace not in doc for doc in contexts["own"])  # never its own
    assert contexts["other"] and all(f'"code": "{rule.code}"' not in doc for doc in contexts["other"])
    assert contexts["none"] == []
    assert code in rule.alternatives and code != rule.code
    assert all(f'"code": "{code}"' in doc and f'"code": "{rule.code}"' not in doc for doc in contexts["rewritten"])
    assert [ruled.rules.recode_text(d, rule.code) for d in contexts["rewritten"]] == contexts["own"]


def test_latent_probe_matches_a_float64_brute_force(ruled, demos):
    """Each of the four figures against full-vocabulary float64 log-probs of the teacher reading the same latents,
    with every alternative written; the latents' relative changes against their own norms."""
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    serializer = ChatSerializer(tok)
    experiences = bank_of(demos)
    got = latent_probe(models, serializer, ruled.rules, demos, experiences, batch_size=4)

    envs = sorted(ruled.rules.rules)
    context = TeacherContext.latent(CFG.n_latents)
    sums = {"own": 0.0, "other": 0.0, "none": 0.0, "rewritten": 0.0}
    gaps = {"other": 0.0, "none": 0.0}
    drift = []  # log pT(own latents) - log p0 at each non-code action token
    with torch.no_grad():
        latents = {}
        for t in demos:
            contexts, code = probe_contexts(ruled.rules, t, experiences, envs)
            latents[t.task_id] = ({c: models.composer([t.task], [docs])[0] for c, docs in contexts.items()}, code)
        models.backbone.double()
        for t in demos:
            by_condition, rewritten_code = latents[t.task_id]
            own = by_condition["own"].double()
            for c in gaps:
                gaps[c] += ((own - by_condition[c].double()).norm() / own.norm()).item()
            rule = ruled.rules.rules[t.env_id]
            for c, lat in by_condition.items():
                logps = []
                for w in rule.alternatives:
                    view = serializer.teacher_view(ruled.rules.recode(t, w), context)
                    ids = torch.tensor([view.input_ids])
                    embeds = splice_latents(
                        models.backbone.get_input_embeddings()(ids),
                        lat.double()[None],
                        torch.tensor([view.latent_start]),
                    )
                    with models.switch.use(None):
                        logits = models.backbone(inputs_embeds=embeds).logits[0]
                    logp = torch.log_softmax(logits, -1)
                    per_token = [logp[i - 1, view.input_ids[i]].item() for i, m in enumerate(view.action_mask) if m]
                    logps.append(sum(per_token))
                    if c == "own" and w == rule.code:  # the target as it is: against the plain backbone
                        plain_view = serializer.student_view(t)
                        with models.switch.use(None):
                            plain_logits = models.backbone(torch.tensor([plain_view.input_ids])).logits[0]
                        plain = torch.log_softmax(plain_logits, -1)
                        positions = [i for i, m in enumerate(plain_view.action_mask) if m]
                        code = set(marked_positions(plain_view, t, tok, ruled.rules.spans))
                        assert code and len(positions) == len(per_token)
                        drift += [per_token[k] - plain[i - 1, plain_view.input_ids[i]].item()
                                  for k, i in enumerate(positions) if i not in code]  # fmt: skip
                want = rewritten_code if c == "rewritten" else rule.code
                sums[c] += math.exp(logps[rule.alternatives.index(want)]) / sum(math.exp(x) for x in logps)
    n = len(demos)
    assert got.n == n
    for c in sums:
        assert getattr(got, c) == pytest.approx(sums[c] / n, abs=1e-4), c
    assert got.change_other == pytest.approx(gaps["other"] / n, rel=1e-3)
    assert got.change_none == pytest.approx(gaps["none"] / n, rel=1e-3)
    assert got.metrics()["probe_reads"] == pytest.approx(got.own - got.other)
    assert got.drift == pytest.approx(sum(drift) / len(drift), abs=1e-4)
    assert got.drift != 0  # the untrained composer's latents do move the backbone's predictions


def test_a_composer_that_reads_nothing_gives_the_same_figure_in_every_context(ruled, demos):
    """Latents that do not depend on the documents (the QFormer's output projection zeroed: every latent is its
    bias): (a) = (b) = (c), (d) = 1 - (a) with k = 2, no latent change, and the gate fails."""
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    with torch.no_grad():
        models.composer.qformer.out_proj.weight.zero_()
        models.composer.qformer.out_proj.bias.normal_(0, 0.02)
    got = latent_probe(models, ChatSerializer(tok), ruled.rules, demos, bank_of(demos))
    assert got.own == pytest.approx(got.other, abs=1e-6) and got.own == pytest.approx(got.none, abs=1e-6)
    assert got.rewritten == pytest.approx(1 - got.own, abs=1e-6)
    assert got.change_other == pytest.approx(0, abs=1e-6) and got.change_none == pytest.approx(0, abs=1e-6)
    assert not got.passes()


def test_probe_targets_are_training_or_validation_replays_spread_over_environments(ruled):
    from lopd_core.envs.base import WithValidation

    suite = WithValidation(ruled, 0.2)
    tasks = [t for t in suite.tasks("validation") if t.difficulty == 1]
    targets = probe_targets(suite, tasks, 8, seed=0)
    assert len(targets) == 8 and len({t.env_id for t in targets}) == 8  # round robin over the 8 environments
    assert all(t.reward >= 1.0 for t in targets)
    assert all(ruled.rules.rules[t.env_id].code in t.trace for t in targets if '"code"' in t.trace)
    with pytest.raises(ValueError, match="never held-out"):
        probe_targets(suite, ruled.tasks("eval")[:2], 2)


def test_relabeller_writes_one_code_in_the_record_and_its_documents(ruled, demos):
    docs = [experience_document(d.task, d.trace) for d in demos[1:3]]
    for scope, choices in (("alternatives", None), ("pool", ruled.rules.pool)):
        relabel = ruled.rules.relabeller(scope)
        rng, drawn = random.Random(0), set()
        for _ in range(200):  # 24 pool codes: each drawn with probability 1 - (23/24)^200 > 0.9998
            record, documents = relabel(demos[0], docs, rng)
            code = record.metadata["house_code"]
            drawn.add(code)
            assert f'"code": "{code}"' in record.trace
            assert all(m.content.count('"code"') == m.content.count(f'"code": "{code}"') for m in record.messages)
            assert all(doc.count('"code"') == doc.count(f'"code": "{code}"') for doc in documents)
        assert drawn == set(choices or ruled.rules.rules[demos[0].env_id].alternatives)
    with pytest.raises(ValueError, match="relabel scope"):
        ruled.rules.relabeller("everything")


def test_cold_start_relabels_every_step_and_probes_on_schedule(ruled, demos):
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    experiences = bank_of(demos)
    seen, probed = [], []
    relabel = ruled.rules.relabeller("pool")

    def spy(record, documents, rng):
        out = relabel(record, documents, rng)
        seen.append(out[0].metadata["house_code"])
        return out

    cold = ColdStartConfig(steps=5, batch_size=2, lr=1e-3)
    cold_start(models, ChatSerializer(tok), demos, lambda task, task_id: experiences(task, task_id, "toolworld_bank"),
               CFG, cold, relabel=spy, on_probe=probed.append, probe_every=2)  # fmt: skip
    assert len(seen) == 10 and set(seen) <= set(ruled.rules.pool)
    assert probed == [0, 2, 4, 5]


def test_targets_of_an_environment_with_nothing_to_read_are_left_out(ruled, demos):
    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    experiences = bank_of(demos)

    def no_shop(task, task_id, env):
        return [] if env == "toolworld_shop" else experiences(task, task_id, env)

    got = latent_probe(models, ChatSerializer(tok), ruled.rules, demos, no_shop)
    shop = sum(d.env_id == "toolworld_shop" for d in demos)
    assert got.skipped == shop and got.n == len(demos) - shop
    with pytest.raises(ValueError, match="no experience"):
        latent_probe(models, ChatSerializer(tok), ruled.rules, demos, lambda *a: [])


def test_token_selection_keeps_the_surprising_or_the_rule_tokens(ruled, demos):
    """cold_start.token_selection: "surprising" keeps the tokens whose NLL under the plain backbone on the student's
    view (no context) exceeds the threshold (0: every token, the paper's NLL; huge: none); "rule" keeps exactly
    the code's value tokens (the diagnostics' marks)."""
    from lopd_core.cold_start import latent_nll_sum, token_selector
    from lopd_core.diagnostics import marked_positions
    from lopd_core.loss_head import token_logprobs
    from lopd_core.serialization import aligned_action_positions

    model, tok = load_backbone("tiny")
    models = build_models(model, tok, CFG)
    ser = ChatSerializer(tok)
    batch = demos[:3]
    docs = [bank_of(demos)(t.task, t.task_id, t.env_id) for t in batch]
    with torch.no_grad():
        total, n = latent_nll_sum(models, ser, batch, docs)
        for threshold, expect_all in ((0.0, True), (1e9, False)):
            cold = ColdStartConfig(token_selection="surprising", surprisal_threshold=threshold)
            got, kept = latent_nll_sum(models, ser, batch, docs, token_selector(models, ser, cold))
            assert (kept == n and torch.allclose(got, total)) if expect_all else (kept == 0 and got == 0)
        cold = ColdStartConfig(token_selection="surprising", surprisal_threshold=3.0)
        s_batch = ser.collate([ser.student_view(t) for t in batch])
        t_batch = ser.collate([ser.teacher_view(t, TeacherContext.latent(CFG.n_latents)) for t in batch])
        rows, s_pos, _, targets = aligned_action_positions(s_batch, t_batch)
        with models.switch.use(None):
            plain = -token_logprobs(models.backbone.model(input_ids=s_batch.input_ids).last_hidden_state[rows, s_pos],
                                    targets, models.backbone.lm_head.weight)  # fmt: skip
        _, kept = latent_nll_sum(models, ser, batch, docs, token_selector(models, ser, cold))
        assert kept == int((plain > 3.0).sum())
        marks = sum(len(marked_positions(ser.student_view(t), t, tok, ruled.rules.spans)) for t in batch)
        rule = token_selector(models, ser, ColdStartConfig(token_selection="rule"), ruled.rules.spans)
        _, kept = latent_nll_sum(models, ser, batch, docs, rule)
        assert kept == marks > 0
        # the tokens left out, weighted: 1 is every token; w between counts each left-out token w times
        every = ColdStartConfig(token_selection="rule", unselected_weight=1.0)
        got, count = latent_nll_sum(models, ser, batch, docs, rule, every.unselected_weight)
        assert count == n and torch.allclose(got, total)
        rule_sum, _ = latent_nll_sum(models, ser, batch, docs, rule)
        got, count = latent_nll_sum(models, ser, batch, docs, rule, 0.25)
        assert count == pytest.approx(marks + 0.25 * (n - marks))
        assert got.item() == pytest.approx(rule_sum.item() + 0.25 * (total - rule_sum).item(), rel=1e-5)
    with pytest.raises(ValueError, match="marks its rule tokens"):
        token_selector(models, ser, ColdStartConfig(token_selection="rule"))
