"""The timeline page (`/dashboard`) in a real headless Chromium against a real cluster: it loads with no
console error, lists the workers, and draws a finished request as a bar whose phase widths are its
meta_info's times; a click shows the request's spans and meta_info. A screenshot is written
(PDSERVE_SCREENSHOT_DIR, else the test's folder)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from harness import start_up

PX_TOL = 3.0  # pixels


@pytest.fixture
def browser(require_tool):
    hint = "`make browser` installs them from the system packages; make test-all runs it"
    chrome = require_tool("chromium", "chromium-browser", "google-chrome", hint=hint)
    driver = require_tool("chromedriver", hint=hint)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chrome
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=opts, service=Service(driver))
    try:
        yield d
    finally:
        d.quit()


def _wait(cond, timeout_s: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(400)
def test_dashboard_page_in_chromium(tmp_path, browser):
    from selenium.webdriver.common.by import By

    c = start_up(tmp_path)
    try:
        c.wait_healthy()
        t0 = time.monotonic()
        browser.get(c.url + "/dashboard")
        _wait(
            lambda: browser.execute_script("return document.body.dataset.loaded === '1'"), what="first data"
        )
        load_s = time.monotonic() - t0
        workers = {
            e.get_attribute("data-worker")
            for e in browser.find_elements(By.CSS_SELECTOR, "#workers tbody tr")
        }
        assert workers == {"prefill-0", "decode-0"}, workers

        prompt = "Zanzibar quartz phrasing: the capital of France is"
        r = httpx.post(
            c.url + "/generate",
            json={
                "text": prompt,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
            },
            timeout=300,
        )
        assert r.status_code == 200, r.text
        out = r.json()
        mi = out["meta_info"]
        row = _wait(
            lambda: browser.find_elements(By.CSS_SELECTOR, f'.row[data-rid="{mi["id"]}"]'),
            what="the request's bar",
        )[0]
        px = float(browser.find_element(By.ID, "chart").get_attribute("data-px-per-s"))
        width = {
            s.get_attribute("data-phase"): s.rect["width"] for s in row.find_elements(By.CSS_SELECTOR, ".seg")
        }
        received, first = mi["request_received_ts"], mi["request_received_ts"] + mi["first_token_latency"]
        expect = {
            "queue": mi["forward_entry_time"] - received,
            "prefill": mi["prefill_finished_time"] - mi["forward_entry_time"],
            "transfer+first_token": first - mi["prefill_finished_time"],
            "decode": mi["request_finished_ts"] - first,
        }
        width["transfer+first_token"] = width.pop("transfer") + width.pop("first_token")
        # queue and prefill are the same spans in both; after them the bar splits at the KV's arrival at the
        # decode worker, the meta at the first token, which the prefill streams before its KV has moved:
        # those two phases are compared together.
        for phase in ("queue", "prefill"):
            assert abs(width[phase] - expect[phase] * px) <= PX_TOL, (phase, width[phase], expect[phase] * px)
        after = width["transfer+first_token"] + width["decode"]
        expect_after = (expect["transfer+first_token"] + expect["decode"]) * px
        assert abs(after - expect_after) <= PX_TOL, (after, expect_after)
        assert width["decode"] > 50  # the bar spans the chart: a real width was compared

        row.click()
        meta = json.loads(_wait(lambda: browser.find_element(By.ID, "meta").text, what="the detail"))
        assert meta == mi
        spans = [
            e.get_attribute("data-span") for e in browser.find_elements(By.CSS_SELECTOR, "#spans .span-row")
        ]
        assert spans[0] == "prefill.queue" and "decode" in spans and spans[-1] == "response", spans

        # Neither the page nor its data carry the prompt or the output.
        data = httpx.get(c.url + "/dashboard/data", timeout=10).text
        for text in (prompt, out["text"]):
            assert text.strip() and text.strip() not in data and text.strip() not in browser.page_source
        assert "Zanzibar" not in data

        shots = os.environ.get("PDSERVE_SCREENSHOT_DIR", str(tmp_path))
        path = os.path.join(shots, "dashboard.png")
        browser.save_screenshot(path)
        assert os.path.getsize(path) > 10_000
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        print(f"dashboard: first data drawn {load_s * 1000:.0f} ms after navigation")
    finally:
        c.stop()
