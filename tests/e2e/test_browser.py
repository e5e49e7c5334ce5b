"""A person's path through the UIs, in headless Chromium (Debian's chromium + chromedriver, driven by selenium):
log into Airflow, find recforge_daily, trigger it from the trigger form with changed Params, see the run
succeed, open the RecForge page and see that run's plan and reports, then find the run in MLflow's UI.
Screenshots go to $RECFORGE_TEST_ARTIFACTS/browser (default tests/e2e/artifacts/browser)."""
import os
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from e2e_services import DAG_ID, artifacts_dir
from recforge.pipelines.context import run_key_from

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]


@pytest.fixture
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed (make sysdeps installs Debian's chromium and chromium-driver)")
    assert os.path.exists(CHROMEDRIVER), f"{CHROMIUM} is installed but {CHROMEDRIVER} is not: run make sysdeps"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    with tempfile.TemporaryDirectory(prefix="recforge-chromium-") as profile:
        options.add_argument(f"--user-data-dir={profile}")
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(90)
        try:
            yield driver
        finally:
            driver.quit()


class Shots:
    def __init__(self, driver):
        self.driver, self.dir, self.n = driver, artifacts_dir() / "browser", 0
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.glob("*.png"):
            old.unlink()

    def __call__(self, name: str) -> Path:
        self.n += 1
        path = self.dir / f"{self.n:02d}_{name}.png"
        assert self.driver.save_screenshot(str(path)), path
        return path


def _fill(element, value) -> None:
    element.send_keys(Keys.CONTROL, "a")
    element.send_keys(Keys.DELETE)
    element.send_keys(str(value))


def test_trigger_from_the_ui_then_browse_recforge_and_mlflow(live, browser):
    wait = WebDriverWait(browser, 90)
    shot = Shots(browser)
    run_id = f"e2e_browser_{uuid.uuid4().hex[:8]}"
    seed = 500_000 + int(time.time()) % 100_000
    params = {"rows_per_day": 3000, "batch_size": 256, "table_cap": 5000, "workers": 1, "seed": seed}

    # log in with the generated admin password, land on the DAG
    browser.get(f"{live.airflow_url}/auth/login?next=%2Fdags%2F{DAG_ID}")
    wait.until(EC.presence_of_element_located((By.NAME, "username"))).send_keys("admin")
    browser.find_element(By.NAME, "password").send_keys(live.password)
    shot("login")
    browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    trigger = wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, "[data-testid=trigger-dag-button]")))
    assert DAG_ID in browser.page_source
    shot("dag")

    # the trigger form: change Params, name the run, submit
    live.owned.add(run_id)
    trigger.click()
    wait.until(EC.presence_of_element_located((By.NAME, "element_rows_per_day")))
    for name, value in params.items():
        _fill(browser.find_element(By.NAME, f"element_{name}"), value)
    browser.find_element(By.XPATH, "//button[contains(., 'Advanced Options')]").click()
    _fill(wait.until(EC.element_to_be_clickable((By.NAME, "dagRunId"))), run_id)
    submit = browser.find_element(By.CSS_SELECTOR, "[data-testid=trigger-dag-submit]")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", submit)
    shot("trigger_form")
    wait.until(lambda d: submit.is_enabled())
    submit.click()
    wait.until(EC.url_contains(f"/runs/{run_id}"))
    shot("run_started")
    run_page = browser.current_url

    # the run as Airflow recorded it carries the form's Params; wait for it, then see it succeed in the UI. Meanwhile
    # the browser waits on a blank page: the run page polls the API server every few seconds (Chromium's renderer and
    # the API server took ~40% of a core of the 2 the run itself needs)
    conf = live.api("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}").json()["conf"]
    assert {k: conf[k] for k in params} == params, conf
    browser.get("about:blank")
    live.wait_for_run(run_id)
    browser.get(run_page)
    wait.until(lambda d: "Success" in d.find_element(By.TAG_NAME, "body").text)
    shot("run_succeeded")

    # RecForge from Airflow's navigation: the runs list, then this run's page (inside Airflow's iframe)
    key = run_key_from(run_id)
    wait.until(EC.element_to_be_clickable((By.XPATH, "//a[contains(@href, 'plugin/recforge')]"))).click()
    frame = wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "iframe[src*='recforge']")))
    browser.switch_to.frame(frame)
    link = wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, f"tr[data-run-key='{key}'] a")))
    row = browser.find_element(By.CSS_SELECTOR, f"tr[data-run-key='{key}']").text
    assert "complete" in row and f"seed={seed}" in row, row
    browser.switch_to.default_content()
    shot("recforge_runs")
    browser.switch_to.frame(frame)
    link.click()
    title = wait.until(EC.presence_of_element_located((By.ID, "run-title")))
    assert key in title.text
    states = {e.get_attribute("data-stage"): e.get_attribute("data-state")
              for e in browser.find_elements(By.CSS_SELECTOR, "#stages [data-stage]")}
    assert set(states.values()) == {"done"} and len(states) == 7, states
    chains = browser.find_element(By.ID, "plan-chains").text
    assert "fill_null → sigrid_hash → firstx" in chains and "fill_null → log1p" in chains, chains
    assert browser.find_element(By.ID, "run-status").get_attribute("data-state") == "complete"
    # per system what it decided, did and measured (or, in words, why it did not run); the training curve
    systems = {e.get_attribute("data-system"): e.get_attribute("data-state")
               for e in browser.find_elements(By.CSS_SELECTOR, "[data-system]")}
    assert set(systems) == {"rap", "dlrover", "recom", "checkpoints", "executor", "warm_start", "gate"}, systems
    assert set(systems.values()) <= {"used", "not used"} and systems["recom"] == systems["gate"] == "used", systems
    assert browser.find_elements(By.CSS_SELECTOR, "svg[data-metric='train_loss'] polyline")
    body = browser.find_element(By.TAG_NAME, "body").text
    for text in ("speedup vs eager", "max |compiled - eager|", "AUC ceiling (Bayes-optimal)", "recforge-dlrm v",
                 "challenger AUC"):
        assert text in body, text
    browser.switch_to.default_content()
    shot("recforge_run")
    browser.switch_to.frame(frame)
    browser.execute_script("document.getElementById('compile').scrollIntoView()")
    mlflow_run = browser.find_element(By.LINK_TEXT, "MLflow pipeline run").get_attribute("href")
    browser.switch_to.default_content()
    shot("recforge_compile_report")

    # MLflow's UI: the pipeline run the page links to, named after the run key, in experiment recforge_daily
    assert mlflow_run.startswith(live.mlflow_url), mlflow_run
    browser.get(mlflow_run)
    wait.until(lambda d: key in d.find_element(By.TAG_NAME, "body").text)
    assert DAG_ID in browser.find_element(By.TAG_NAME, "body").text
    shot("mlflow_run")
