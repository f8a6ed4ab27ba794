"""The knobs of an EnvScaler-format suite (`EnvScalerConfig`) and the prompt styles it accepts."""

from __future__ import annotations

from dataclasses import dataclass, field

from lopd_core.sandbox import SandboxLimits

PROMPT_STYLES = ("full", "compact", "minimal")


@dataclass(frozen=True)
class EnvScalerConfig:
    """Knobs of an EnvScaler-format suite."""

    limits: SandboxLimits = field(default_factory=lambda: SandboxLimits(timeout_s=10.0, memory_mb=1024, cpu_s=300))
    check_timeout_s: float = 5.0  # per check function
    max_calls_per_turn: int = 1  # further calls in the same turn are ignored (noted, counted as "extra_calls")
    max_observation_chars: int = 2000  # longer tool results are cut (the model sees a note)
    trace_result_chars: int = 80  # tool results in the compact trace are cut to this length
    include_rules: bool = True  # show the environment's rules in the system prompt
    call_style: str = "flat"  # how the prompt shows tool calls: "flat" {"tool": ...} or "nested" {"name", "arguments"}
    prompt: str = "full"  # "full": introduction, rules, call templates, examples; "compact": tool signatures only;
    # "minimal": the environment's id only (small students that learn the tools from demonstrations)
    episodes_per_worker: int = 1  # episodes one sandbox worker hosts (>1 only for trusted code; see the package doc)

    def __post_init__(self) -> None:
        if self.prompt not in PROMPT_STYLES:
            raise ValueError(f"EnvScalerConfig.prompt must be one of {PROMPT_STYLES}, got {self.prompt!r}")
        if self.episodes_per_worker < 1:
            raise ValueError(f"EnvScalerConfig.episodes_per_worker must be >= 1, got {self.episodes_per_worker}")
