"""The rollout engine: batched multi-turn generation for many episodes, producing `Trajectory` records.

    engine = RolloutEngine(model, tokenizer, RolloutConfig(temperature=1.0, max_turns=8, batch_size=16))
    trajectories = engine.run([suite.episode(t) for t in tasks])

Up to `batch_size` episodes are live at once. Every round, each live episode's next prompt is built with
`ChatSerializer.prompt_ids` (so the training views reproduce it token for token), all prompts are left-padded
into one batch, and one turn is sampled for all of them with a KV cache (prefill, then one token per step;
rows that stopped are dropped from the batch). A row stops at the end-of-turn token, at `max_new_tokens`, or
when the episode's `max_total_tokens` budget runs out. Each sampled turn goes to its episode's `step`;
finished episodes are scored (`result`) and replaced from the queue, so the batch stays full (continuous
batching at turn granularity).

With `reuse_cache` (default) prefill work is not repeated: each episode keeps the keys/values of everything
it has seen, so a later turn prefills only the new observation and header, and episodes sharing a system
prompt start from one cached copy of it. The cached ids are checked against each new prompt (a mismatch
falls back to a full prefill), so reuse never changes what the model conditions on; models whose cache is
not a plain per-layer key/value cache (sliding windows, recurrent layers) run without reuse.

Assistant messages keep exactly the sampled content ids (without the end-of-turn token); `truncated=True`
marks a turn that ended without sampling the end-of-turn token. The model may be any Hugging Face causal
LM, including a peft model (the active adapter is used); it is put in eval mode during the run and restored.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from lopd_core.config import RolloutConfig
from lopd_core.conversation import Message, Trajectory
from lopd_core.envs.base import Episode
from lopd_core.serialization import ChatSerializer
from lopd_core.timing import section


@dataclass
class Generation:
    """One sampled turn: content ids (no end-of-turn token) and whether it ended without end-of-turn."""

    token_ids: list[int]
    truncated: bool
    logprobs: list[float] = field(default_factory=list, repr=False)  # log p(token) under the model, untempered
    past: Past | None = field(default=None, repr=False)  # the row's keys/values after the turn (reuse_cache)


@dataclass
class Past:
    """Cached keys/values of a token prefix (batch dimension 1): one (keys, values) pair per layer."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LiveEpisode:
    """An episode while it is rolled out: its messages so far, counters, and its cached prefix."""

    index: int
    episode: Episode
    messages: list[Message]
    n_turns: int = 0
    n_calls: int = 0
    gen_tokens: int = 0
    truncated_turns: int = 0
    finish_reason: str = ""
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    past: Past | None = None


class RolloutEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: RolloutConfig | None = None,
        serializer: ChatSerializer | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or RolloutConfig()
        self.serializer = serializer or ChatSerializer(tokenizer)
        self.end_of_turn_id = self.serializer.end_of_turn_id
        self.stop_ids = {self.end_of_turn_id} | _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.end_of_turn_id)
        self._prefixes: dict[tuple[int, ...], Past] = {}
        self._reuse = self.config.reuse_cache
        self._reuse_checked: bool | None = None  # whether the model's cache supports reuse (checked once)
        self.stats: dict[str, float] = {}  # of the last run: generated tokens, seconds, forward passes, ...

    # the engine samples from `model` itself, so a weight update needs no sync; the vLLM engine holds a copy
    holds_weights = False

    def sync(self, model: torch.nn.Module | None = None) -> float:
        """Bring the engine's weights up to `model`'s after an update; returns seconds (nothing to do here)."""
        return 0.0

    def close(self) -> None:
        """Release what the engine holds (the HF engine holds nothing; the vLLM engine its worker process)."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- episodes

    def run(self, episodes: Sequence[Episode], desc: str = "rollout") -> list[Trajectory]:
        """Roll out every episode; returns one trajectory per episode, in order."""
        with section("rollout"):  # what generation and the environments leave: prompts, decoding, bookkeeping
            return self._run(episodes, desc)

    def _run(self, episodes: Sequence[Episode], desc: str) -> list[Trajectory]:
        cfg = self.config
        generator = torch.Generator(device=_device(self.model)).manual_seed(cfg.seed)
        queue = deque(range(len(episodes)))
        live: list[LiveEpisode] = []
        done: dict[int, Trajectory] = {}
        self._reset_stats()
        self._prefixes: dict[tuple[int, ...], Past] = {}  # shared system-prompt caches, valid for this run only
        self._reuse = cfg.reuse_cache
        t0 = time.monotonic()
        was_training = self.model.training
        self.model.eval()
        bar = tqdm(total=len(episodes), desc=desc, disable=not cfg.progress, unit="ep")
        try:
            while queue or live:
                while queue and len(live) < cfg.batch_size:
                    i = queue.popleft()
                    state = self._open(i, episodes[i])
                    if state.finish_reason:
                        done[i] = self._close(state)
                        bar.update(1)
                    else:
                        live.append(state)
                if not live:
                    continue
                prompts, rows = [], []
                for state in live:
                    ids = self.serializer.prompt_ids(state.messages)
                    budget = min(cfg.max_new_tokens, cfg.max_total_tokens - len(ids))
                    if budget <= 0:
                        state.finish_reason = "max_tokens"
                    else:
                        if self._reuse and state.past is None and state.n_turns == 0:
                            state.past = self._shared_prefix(state.messages, ids)
                        prompts.append(ids)
                        rows.append((state, budget))
                if rows:
                    t_gen = time.monotonic()
                    pasts = [state.past for state, _ in rows] if self._reuse else None
                    with section("rollout/generate"):
                        outputs = self.generate(prompts, [b for _, b in rows], generator, pasts)
                    self.stats["generate_s"] += time.monotonic() - t_gen
                    self.stats["rounds"] += 1
                    self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
                    for (state, _), out in zip(rows, outputs, strict=True):
                        self._advance(state, out)
                still = []
                for state in live:
                    if state.finish_reason:
                        done[state.index] = self._close(state)
                        bar.update(1)
                        rewards = [t.reward for t in done.values() if not t.failed]
                        if rewards:
                            bar.set_postfix(reward=f"{sum(rewards) / len(rewards):.3f}", refresh=False)
                    else:
                        still.append(state)
                live = still
        finally:
            for state in live:  # interrupted: release the environments
                _safe_close(state.episode)
            bar.close()
            self.model.train(was_training)
        self.stats["seconds"] = time.monotonic() - t0
        return [done[i] for i in range(len(episodes))]

    def _reset_stats(self) -> None:
        keys = ("generated_tokens", "prompt_tokens", "prefilled_tokens", "forward_passes", "rounds", "generate_s")
        self.stats = dict.fromkeys(keys, 0)

    def _open(self, index: int, episode: Episode) -> LiveEpisode:
        try:
            with section("rollout/environment"):
                messages = list(episode.initial_messages())
        except Exception as exc:
            return LiveEpisode(index, episode, [], finish_reason="error", error=f"initial_messages: {exc!r}")
        return LiveEpisode(index, episode, messages)

    def _shared_prefix(self, messages: list[Message], prompt: list[int]) -> Past | None:
        """The cache of the prompt's part before the first user message's content (system prompt and user
        header), computed once per distinct prefix in a run."""
        cut = self.serializer.view(messages).insert_pos
        if cut < 16:
            return None
        key = tuple(prompt[:cut])
        if key not in self._prefixes:
            if len(self._prefixes) >= 64:
                self._prefixes.pop(next(iter(self._prefixes)))
            with torch.inference_mode():
                ids = torch.tensor([list(key)], device=_device(self.model))
                out = self._forward(ids, torch.ones_like(ids), torch.arange(len(key), device=ids.device)[None], None)
                self.stats["prefilled_tokens"] += len(key)
            kv = _layers(out.past_key_values)
            if kv is None:
                self._reuse = False
                return None
            self._prefixes[key] = Past(list(key), kv)
        return self._prefixes[key]

    def _advance(self, state: LiveEpisode, out: Generation) -> None:
        cfg = self.config
        state.past = out.past
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        state.messages.append(Message("assistant", text, token_ids=list(out.token_ids), truncated=out.truncated))
        state.n_turns += 1
        state.gen_tokens += len(out.token_ids)
        state.truncated_turns += int(out.truncated)
        self.stats["generated_tokens"] += len(out.token_ids)
        try:
            with section("rollout/environment"):
                step = state.episode.step(text)
        except Exception as exc:
            state.finish_reason, state.error = "error", f"step: {exc!r}"
            return
        state.messages.extend(step.messages)
        state.n_calls += step.n_calls
        if step.done:
            state.finish_reason = step.event if step.event not in ("call", "") else "finish"
        elif state.n_turns >= cfg.max_turns:
            state.finish_reason = "max_turns"

    def _close(self, state: LiveEpisode) -> Trajectory:
        task = state.episode.task
        meta: dict[str, Any] = {
            "generations": 1,
            "suite": task.suite,
            "difficulty": task.difficulty,
            "generated_tokens": state.gen_tokens,
            "truncated_turns": state.truncated_turns,
            "seconds": round(time.monotonic() - state.started, 3),
        }
        reward, checks, trace, n_calls, n_errors = 0.0, [], "", state.n_calls, 0
        error = state.error
        if error is None:
            try:
                with section("rollout/environment"):
                    result = state.episode.result()
                reward, checks, trace = float(result.reward), list(result.checks), result.trace
                n_calls, n_errors = result.n_calls, result.n_errors
                meta["error_counts"] = dict(result.error_counts)
            except Exception as exc:
                error = f"result: {exc!r}"
        with section("rollout/environment"):
            _safe_close(state.episode)
        messages = state.messages or [Message("user", task.instruction)]
        return Trajectory(
            task_id=task.task_id,
            env_id=task.env_id,
            task=task.instruction,
            messages=messages,
            reward=reward if error is None else 0.0,
            split=task.split,
            checks=checks,
            trace=trace,
            failed=error is not None,
            error=error,
            finish_reason="error" if error is not None else state.finish_reason,
            n_turns=state.n_turns,
            n_calls=n_calls,
            n_errors=n_errors,
            metadata=meta,
        )

    # ----------------------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: Sequence[int],
        generator: torch.Generator | None = None,
        pasts: Sequence[Past | None] | None = None,
    ) -> list[Generation]:
        """Sample one turn for each prompt at once: left padding, KV cache, per-row stop and token budget.

        `pasts[b]`, if given, caches a prefix of `prompts[b]`: only the rest is prefilled. Each cache row is laid
        out as [padding | cached prefix | padding | rest of the prompt], so that every row's prompt ends in the
        last column; positions are the true ones and padding is masked out.
        """
        cfg = self.config
        device = _device(self.model)
        n = len(prompts)
        prompts = [list(p) for p in prompts]
        usable = [
            past if past is not None and len(past.ids) < len(p) and p[: len(past.ids)] == past.ids else None
            for p, past in zip(prompts, pasts or [None] * n, strict=True)
        ]
        cached = [len(p.ids) if p is not None else 0 for p in usable]
        width_cache = max(cached)
        rest = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        width = max(len(r) for r in rest)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width_cache + width), dtype=torch.long)
        positions = torch.zeros((n, width), dtype=torch.long)
        for b, (r, c) in enumerate(zip(rest, cached, strict=True)):
            input_ids[b, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attention[b, width_cache - c : width_cache] = 1
            attention[b, width_cache + width - len(r) :] = 1
            positions[b, width - len(r) :] = torch.arange(c, c + len(r))
        input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)
        cache = _merge(usable, width_cache) if width_cache else None
        out = self._forward(input_ids, attention, positions, cache)
        self.stats["prefilled_tokens"] = self.stats.get("prefilled_tokens", 0) + sum(len(r) for r in rest)
        cache = out.past_key_values
        reuse = bool(pasts is not None) and self._reuse_ok(cache)
        logits = out.logits[:, -1, :]
        rows = list(range(n))  # original index of each row still in the batch
        sampled: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        results: list[Generation | None] = [None] * n
        next_pos = positions[:, -1]
        while rows:
            tokens = sample_tokens(logits, cfg.temperature, cfg.top_p, generator)
            token_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens.view(-1, 1)).view(-1).tolist()
            keep = []
            for r, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
                done = None
                if token in self.stop_ids:
                    # Stopped by end-of-turn: not truncated. Another end token: the end-of-turn was not sampled.
                    done = Generation(sampled[row], truncated=token != self.end_of_turn_id, logprobs=logprobs[row])
                    fed = sampled[row]
                else:
                    sampled[row].append(token)
                    logprobs[row].append(token_logprobs[r])
                    if len(sampled[row]) >= int(max_new_tokens[row]):
                        done = Generation(sampled[row], truncated=True, logprobs=logprobs[row])
                        fed = sampled[row][:-1]  # the last token was sampled but never fed
                if done is None:
                    keep.append(r)
                    continue
                if reuse:
                    done.past = Past(prompts[row] + fed, _extract(cache, r, attention[r]))
                results[row] = done
            if not keep:
                break
            if len(keep) < len(rows):  # drop finished rows from the batch and the cache
                index = torch.tensor(keep, device=device)
                tokens, attention, next_pos = tokens[index], attention[index], next_pos[index]
                if hasattr(cache, "batch_select_indices"):
                    cache.batch_select_indices(index)
                else:  # a legacy tuple cache
                    cache = tuple(tuple(t[index] for t in layer) for layer in cache)
                rows = [rows[r] for r in keep]
            attention = torch.cat([attention, attention.new_ones((len(rows), 1))], dim=1)
            next_pos = next_pos + 1
            out = self._forward(tokens.view(-1, 1), attention, next_pos.view(-1, 1), cache)
            cache = out.past_key_values
            logits = out.logits[:, -1, :]
        return [r if r is not None else Generation([], truncated=True) for r in results]

    def _reuse_ok(self, cache: Any) -> bool:
        if self._reuse_checked is None:
            self._reuse_checked = _layers(cache, probe=True) is not None
        return self._reuse_checked

    def _forward(self, input_ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: Any) -> Any:
        self.stats["forward_passes"] = self.stats.get("forward_passes", 0) + 1
        kwargs = dict(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, past_key_values=cache, use_cache=True
        )
        try:
            return self.model(**kwargs, logits_to_keep=1)
        except TypeError:  # a model without logits_to_keep
            return self.model(**kwargs)


def _layers(cache: Any, probe: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """A plain per-layer (keys, values) view of a cache, or None for caches that cannot be re-laid-out."""
    if type(cache) is not DynamicCache or not cache.layers:
        return None
    if any(type(layer) is not DynamicLayer or getattr(layer, "keys", None) is None for layer in cache.layers):
        return None
    if probe:
        return []
    return [(layer.keys, layer.values) for layer in cache.layers]


def _extract(cache: Any, row: int, mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cached keys/values of one batch row at its unmasked positions, as a batch of one."""
    index = mask.nonzero().view(-1)
    return [(k[row : row + 1, :, index].clone(), v[row : row + 1, :, index].clone()) for k, v in _layers(cache) or []]


def _merge(pasts: Sequence[Past | None], width: int) -> DynamicCache:
    """One batched cache from per-row prefixes, each left-padded with zeros to `width` positions."""
    template = next(p for p in pasts if p is not None).kv
    layers = []
    for j, (k0, v0) in enumerate(template):
        keys, values = [], []
        for past in pasts:
            k, v = past.kv[j] if past is not None else (k0[:, :, :0], v0[:, :, :0])
            pad = width - k.shape[2]
            keys.append(torch.cat([k.new_zeros(*k.shape[:2], pad, k.shape[3]), k], dim=2) if pad else k)
            values.append(torch.cat([v.new_zeros(*v.shape[:2], pad, v.shape[3]), v], dim=2) if pad else v)
        layers.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(layers)


def sample_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        drop = cumulative - sorted_probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _safe_close(episode: Episode) -> None:
    try:
        episode.close()
    except Exception:
        pass


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """Mean reward, success rate (reward == 1) and counts, overall and per difficulty level."""

    def block(items: Sequence[Trajectory]) -> dict[str, Any]:
        ok = [t for t in items if not t.failed]
        n = max(len(ok), 1)
        return {
            "episodes": len(items),
            "failed": len(items) - len(ok),
            "mean_reward": round(sum(t.reward for t in ok) / n, 4),
            "success_rate": round(sum(t.reward >= 1.0 for t in ok) / n, 4),
            "mean_turns": round(sum(t.n_turns for t in ok) / n, 2),
            "mean_calls": round(sum(t.n_calls for t in ok) / n, 2),
            "mean_errors": round(sum(t.n_errors for t in ok) / n, 2),
            "finish_reasons": {
                r: sum(t.finish_reason == r for t in items) for r in sorted({t.finish_reason for t in items})
            },
        }

    levels: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        level = t.metadata.get("difficulty")
        key = "?" if level is None else str(min(int(level), 6)) + ("+" if int(level) >= 6 else "")
        levels.setdefault(key, []).append(t)
    return {"all": block(trajectories), "by_difficulty": {k: block(v) for k, v in sorted(levels.items())}}
