"""What a researcher sees in the MLflow and Prefect UIs, in a real browser: Debian's headless Chromium, driven by
Playwright (no browser download), against a Prefect server with its UI and an MLflow UI, both started here.

A fresh `lopd deploy`, then the default deployment run as Quick run starts it (the tiny preset; only its run_dir
is moved into the test's folder), on a process worker: it must finish in minutes on a CPU. Then, on that run:

* MLflow's runs list opens in training mode with the experiment's view: the held-out score columns;
* the LOPD train run's charts: the margin and the margin target m (search "margin");
* the pipeline run's arms.json renders as a table, a row per arm;
* Prefect: every deployment listed under a unique name, the automation card naming the re-training deployment,
  the default deployment's run form (the preset first, "tiny" chosen) and the era shift's (study-rules chosen, the
  era and whether to re-train at once).

Screenshots go to $LOPD_SCREENSHOTS (default test-output/browser/ in the repository, not committed) for a reviewer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.flows.servers import ROOT, lopd, mlflow_ui, prefect_server, started, wait_for

pytestmark = pytest.mark.slow
SHOTS = Path(os.environ.get("LOPD_SCREENSHOTS", ROOT / "test-output" / "browser"))
DEFAULT_DEPLOYMENT = ("lopd-pipeline", "pipeline-on-this-machine")


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.fail("the browser test needs Debian's chromium: `make browser` (apt-get install -y chromium, as root)")
    from playwright.sync_api import sync_playwright

    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser.new_page(viewport={"width": 2200, "height": 1100})  # the runs table draws visible columns
        finally:
            browser.close()


def look(page: Any, url: str | None, shot: str, until: str, timeout_s: float = 60) -> str:
    """Open `url` (None: stay), wait until the page's text holds `until`, screenshot it; the page's text."""
    if url:
        page.goto(url)
    deadline = time.monotonic() + timeout_s
    while until not in (text := page.inner_text("body")):
        assert time.monotonic() < deadline, f"{url}: no {until!r} after {timeout_s} s; the page shows:\n{text[:2000]}"
        page.wait_for_timeout(500)
    page.wait_for_timeout(1000)  # the charts and tables finish drawing
    page.screenshot(path=str(SHOTS / shot), full_page=True)
    return page.inner_text("body")


def test_a_researcher_sees_scores_curves_presets_and_unique_deployments(page, tmp_path):
    from mlflow import MlflowClient

    from components.tracking.tracker import experiment_url

    with prefect_server(tmp_path / "prefect-home", ui=True) as server:
        deployed = lopd(server, "deploy").stdout
        assert "12 deployments on" in deployed and "Quick run" in deployed, deployed
        deployments = httpx.post(f"{server['api']}/deployments/filter", json={}, timeout=30).json()
        default = next(d for d in deployments if d["name"] == DEFAULT_DEPLOYMENT[1])
        assert default["parameters"] == {"preset": "tiny"}

        # Quick run of the default deployment (its run_dir moved here), on a process worker
        run_dir = tmp_path / "quick"
        worker = [sys.executable, "-m", "prefect", "worker", "start", "--pool", "lopd-process", "--type", "process"]
        env = {**server["env"], "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
        with started(worker, env, tmp_path / "worker.log"):
            t0 = time.monotonic()
            body = {"parameters": {"overrides": [f"run_dir={run_dir}"]}}
            created = httpx.post(f"{server['api']}/deployments/{default['id']}/create_flow_run", json=body, timeout=30)
            run_id = created.json()["id"]

            def finished() -> dict[str, Any] | None:
                run = httpx.get(f"{server['api']}/flow_runs/{run_id}", timeout=30).json()
                return run if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

            run = wait_for("the Quick run of the default deployment", finished, timeout=900)
            quick_s = time.monotonic() - t0
        assert run["state_type"] == "COMPLETED", (run["state"], (tmp_path / "worker.log").read_text()[-3000:])
        print(json.dumps({"quick_run_s": round(quick_s, 1)}))
        assert quick_s < 600, f"the default deployment's Quick run took {quick_s:.0f} s on this CPU"

        # Prefect: unique deployment names, the automation, the run form with its preset
        ui = server["ui"]
        text = look(page, f"{ui}/deployments", "prefect-deployments.png", DEFAULT_DEPLOYMENT[1])
        names = [d["name"] for d in deployments]
        assert len(set(names)) == len(names) == 12, names
        shown = [n for n in names if n in text]  # the first page lists 10
        assert len(shown) >= 10 and all(text.count(f"{n}\n") == 1 for n in shown), text[:2000]
        text = look(page, f"{ui}/automations", "prefect-automation.png", "Run deployment")
        assert "retrain-on-bank-growth" in text.split("Run deployment", 1)[1][:200], text[:2000]
        text = look(page, f"{ui}/deployments/deployment/{default['id']}/run", "prefect-run-form.png", "preset")
        form = text.split("Parameters", 1)[1]
        labels = [form.index(f"{name} (Optional)") for name in ("preset", "overrides", "config")]
        assert labels == sorted(labels), form[:1500]  # the preset first, the whole config last
        preset = form[labels[0] : labels[1]]
        assert "\ntiny\n" in preset and "demo" in preset, form[:1500]  # tiny chosen; the others described
        assert "Property is type" not in form[: labels[2]], form[:1500]  # no None tab before the config
        # the era shift's run form (issue 43): the study-rules preset chosen, the era and when to re-train
        era = next(d for d in deployments if d["name"] == "era-shift-on-this-machine")
        text = look(page, f"{ui}/deployments/deployment/{era['id']}/run", "prefect-era-shift-form.png", "retrain_now")
        form = text.split("Parameters", 1)[1]
        assert "\nstudy-rules\n" in form and "era (Optional)" in form and "retrain_now (Optional)" in form, form[:1500]

    # MLflow: the run's store in the MLflow UI
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("lopd")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    train = runs["lopd s0 · train"]
    (pipe,) = [r for r in runs.values() if r.data.tags.get("lopd.role") == "pipeline"]
    assert {"train/margin", "train/margin_target", "train/beta", "eval/toolworld/headline"} <= set(train.data.metrics)
    with mlflow_ui(uri, tmp_path / "mlflow.log") as mlflow:
        text = look(page, experiment_url(mlflow, experiment.experiment_id), "mlflow-runs.png", "eval/toolworld")
        assert "matching runs" in text and "Model registry" in text, text[:3000]  # training mode: the runs table
        assert "Judges" not in text, text[:3000]  # not GenAI's sidebar (Traces, Judges, Evaluation runs)
        assert "lopd/eval/toolworld" in text and "eval/toolworld/headline" in text, text[:3000]  # the score columns
        assert f"pipeline {run['name']}" in text, text[:3000]  # the pipeline run's row carries them

        base = f"{mlflow}/#/experiments/{experiment.experiment_id}/runs"
        page.goto(f"{base}/{train.info.run_id}/model-metrics?workflowType=machine_learning")
        page.get_by_placeholder("Search metric charts").fill("margin")
        text = look(page, None, "mlflow-train-margin.png", "margin_target")
        assert "train/margin)" in text and "train/margin_target)" in text, text[:3000]  # both series, in "train"
        assert "Judges" not in text, text[:3000]

        arms = f"{base}/{pipe.info.run_id}/artifacts/arms.json?workflowType=machine_learning"
        text = look(page, arms, "mlflow-arms-table.png", "toolworld score")
        assert "View as table" in text and "lopd" in text.split("toolworld score", 1)[1], text[:3000]
        assert "Judges" not in text, text[:3000]
    print(f"screenshots: {SHOTS}")
