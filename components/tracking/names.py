"""The vocabulary of the tracking package: tag keys, metric names, file names and the errors."""

from __future__ import annotations

import logging
from typing import Literal, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
GIT_SHA_ENV = "LOPD_GIT_SHA"  # set in images built without .git
DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"
CONFIG_ARTIFACT = "config.yaml"

# Metric names carry their stage's namespace, `train/margin`, `collect/success_rate`, `eval/<benchmark>/headline`:
# MLflow's charts group a run's metrics by that prefix, and a compare view never mixes a train metric with a collect
# one of the same name. A stage run's `TrackedRun` adds the prefix itself (`namespaced`); the code that computes the
# values (lopd_core) keeps the bare names. The pipeline run's metrics are per arm: `<arm>/eval/<benchmark>`.
NAMESPACES = {"evaluate": "eval"}  # stage -> metric namespace, where they differ (every other stage: its own name)
TRAIN = "train"


def namespace_of(stage: str | None) -> str | None:
    return NAMESPACES.get(stage, stage) if stage else None


def namespaced(namespace: str | None, key: str) -> str:
    """`train` + `margin` -> `train/margin`; a key already in the namespace (or no namespace) stays as it is."""
    if not namespace or key.startswith(f"{namespace}/"):
        return key
    return f"{namespace}/{key}"


def train_metric(name: str) -> str:
    return namespaced(TRAIN, name)


CUM = "generations_cum"  # running sum of `generations`, logged at every step in the run's namespace: the x axis
CUM_GENERATIONS = train_metric(CUM)
GENERATIONS = train_metric("generations")
MARGIN_TARGET = train_metric("margin_target")  # m, logged beside the margin at every LOPD step
NONFINITE_METRICS = "nonfinite_metrics"  # number of non-finite values dropped at a step (logged when > 0; namespaced)
# What a train step reports (lopd_core.step.TrainStep), bare; steps without an update lack the loss terms.
STEP_METRICS = (
    "distill_kl", "margin", "beta", "anchor", "privilege", "reward_mean", "success_rate", "teacher_topm_mass",
    "tail_mass", "n_action_tokens", "n_overlength", "failed_rollouts", "generations", "step_seconds",
)  # fmt: skip
# The curves of a train run (and of the report): the margin against its target m, beta, the privilege, the reward.
DEFAULT_PANELS: tuple[tuple[str, ...], ...] = (
    (train_metric("margin"), MARGIN_TARGET),
    (train_metric("beta"),),
    (train_metric("privilege"),),
    (train_metric("reward_mean"), train_metric("success_rate")),
)
CurveX = Literal["step", "generations"]


# The MLflow UI (3.17) opens an experiment in its GenAI mode unless the URL says `workflowType=machine_learning`
# (it ignores the experiment tag `mlflow.experimentKind`, which we set too for versions that read it). Every link
# we print carries that parameter and the saved view below (`Tracker.publish_view`): score columns, the
# generations x axis, no empty charts.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
TRAINING_MODE = "workflowType=machine_learning"
VIEW_KEY = "lopd"  # the experiment's saved view: the tag mlflow.sharedViewState.lopd, ?viewStateShareKey=lopd
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"


class Tag:
    """Tag keys (search them with `tags.<key>`, dotted ones as tags.`<key>`)."""

    SUITE = "suite"
    STAGE = "stage"
    ROLE = "lopd.role"  # "pipeline" | "stage"
    METHOD = "method"
    SEED = "seed"
    BACKBONE = "backbone"
    BENCHMARK = "benchmark"
    BANK_SNAPSHOT = "bank_snapshot_id"
    CONFIG_HASH = "config_hash"  # sha256 of the config's canonical JSON
    GIT_SHA = "git_sha"
    PIPELINE_RUN = "pipeline_run_id"
    PREFECT_FLOW_RUN_ID = "prefect.flow_run_id"
    PREFECT_FLOW_RUN_URL = "prefect.flow_run_url"
    PARAMS_TRUNCATED = "lopd.params_truncated"  # params cut to MLflow's length limit (full values in config.yaml)
    NONFINITE_KEYS = "lopd.nonfinite_keys"
    TRAIN_RUN = "lopd.train_run_id"  # an evaluate run's: the train run of the model it evaluated
    TRIGGER = "lopd.trigger"  # a pipeline run's: what started it ("retrain bank v2"), when not a person
    LAST_CHECKPOINT = "lopd.last_checkpoint"  # artifact path of the newest checkpoint reference
    PARENT_RUN = "mlflow.parentRunId"  # MLflow's own: nests the run under its parent in the UI
    GIT_COMMIT = "mlflow.source.git.commit"
    NOTE = "mlflow.note.content"  # the run description shown in the UI


# A stage run takes these from its parent unless given explicitly.
INHERITED_TAGS = (
    Tag.METHOD, Tag.SEED, Tag.BACKBONE, Tag.BENCHMARK, Tag.BANK_SNAPSHOT, Tag.PREFECT_FLOW_RUN_ID,
    Tag.PREFECT_FLOW_RUN_URL, Tag.NOTE, Tag.TRIGGER,
)  # fmt: skip
ROW_COLUMNS = (
    "run_id", "run_name", "stage", "method", "seed", "backbone", "benchmark", "bank_snapshot_id", "config_hash",
    "pipeline_run_id", "status", "step", "generations",
)  # fmt: skip


class TrackingError(RuntimeError):
    """A tracking call kept failing (after retries)."""


class TrackingUnavailableError(TrackingError):
    """The tracking store cannot be reached at all."""
