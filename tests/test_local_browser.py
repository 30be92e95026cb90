"""End to end in headless Chromium: open the local page, click a breach, see its flame graph,
switch it to allocated and in-use memory, and switch the route comparison to memory.

Needs Debian's ``chromium`` (``.ci/run`` installs it) and Playwright for Python, which drives
that browser: ``playwright install`` is never run. The screenshot lands in
``test-artifacts/local-mode.png``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from spanprof._profiling._samplers._signal import MAX_DEPTH

from .conftest import require
from .e2e.server import ROOT
from .test_local_hostile import DEEP_REQUEST, spanprof_dev
from .test_local_mode import HOARD, SLOW, local_run, marker_name, markers_in, settle

pytestmark = pytest.mark.e2e

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SCREENSHOT = ROOT / "test-artifacts" / "local-mode.png"
TIMEOUT_MS = 20_000


def test_clicking_a_breach_renders_that_requests_flame_graph(tmp_path: Path) -> None:
    """A click on the slow request's breach draws its flame graph, its marker and no other."""
    chromium = shutil.which("chromium")
    require(chromium is not None, "Debian's chromium is missing (apt-get install chromium)")
    require(
        importlib.util.find_spec("playwright") is not None,
        "Playwright for Python is missing (pip install playwright; no browser download needed)",
    )
    from playwright.sync_api import sync_playwright

    marker = marker_name(SLOW)
    errors: list[str] = []
    with local_run(tmp_path) as run, sync_playwright() as playwright:
        slow = run.labels[SLOW]
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{run.ui}/")
            row = page.locator(f'tr.breach[data-span-id="{slow["span_id"]}"]')
            row.wait_for(timeout=TIMEOUT_MS)
            dots = page.locator(f'#latency circle.exemplar[data-span-id="{slow["span_id"]}"]')
            dot_count = dots.count()
            row.click()
            label = page.locator("#flamegraph .d3-flame-graph-label", has_text=marker)
            label.first.wait_for(state="visible", timeout=TIMEOUT_MS)
            names = page.eval_on_selector_all(
                "#flamegraph g.frame", "frames => frames.map(f => f.getAttribute('name'))"
            )
            waterfall = page.locator(f'#waterfall .waterfall-row[data-span-id="{slow["span_id"]}"]')
            waterfall.wait_for(timeout=TIMEOUT_MS)
            title = page.inner_text("#detail-title")
            pprof_href = page.get_attribute("#pprof-link", "href")
            cpu_tip = page.text_content(f'#flamegraph g.frame[name="{marker}"] title')
            memory = {kind: _switch_to(page, kind) for kind in ("alloc_space", "inuse_space")}
            compared = _compare_memory(page)
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True)
        finally:
            browser.close()
    assert errors == []
    assert dot_count == 1, "the breach is an exemplar dot on the latency plot"
    assert markers_in(set(names)) == {marker}
    assert title == slow["span_name"]
    assert pprof_href == f"/api/pprof?span_id={slow['span_id']}"
    assert cpu_tip is not None
    assert " ms CPU, " in cpu_tip
    for kind, verb in (("alloc_space", "allocated"), ("inuse_space", "in use")):
        frames, tip, status = memory[kind]
        assert HOARD in frames, (kind, frames)
        # Memory reads in bytes: "12.3 MB allocated, 97.0%" (kB when small).
        assert re.search(rf"\n[0-9.]+ [kM]B {verb}, [0-9.]+%$", tip), (kind, tip)
        assert re.search(rf"^[0-9.]+ [kM]B {verb} in [0-9]+ distinct stacks", status), status
        assert markers_in(set(frames)) <= {marker}
    metric, functions = compared
    assert metric == "extra allocated memory per breaching request"
    # The CPU burn allocates too (ints past 256): which of the two comes first is chance.
    assert HOARD in functions, functions
    assert SCREENSHOT.stat().st_size > 10_000


def _switch_to(page: Any, kind: str) -> tuple[list[str], str, str]:
    """Press the span flame graph's ``kind`` button; its frames, the allocator's tooltip and
    the status line once the memory flame graph is drawn."""
    page.click(f'#flamegraph-kind button[data-kind="{kind}"]')
    label = page.locator(f'#flamegraph[data-kind="{kind}"] .d3-flame-graph-label', has_text=HOARD)
    label.first.wait_for(state="visible", timeout=TIMEOUT_MS)
    names = page.eval_on_selector_all(
        "#flamegraph g.frame", "frames => frames.map(f => f.getAttribute('name'))"
    )
    tip = page.text_content(f'#flamegraph g.frame[name="{HOARD}"] title') or ""
    return names, tip, page.inner_text("#flamegraph-status")


def _compare_memory(page: Any) -> tuple[str, list[str]]:
    """Switch the route comparison to allocations; its metric header and its functions."""
    page.click('#compare-kind button[data-kind="alloc_space"]')
    page.locator('#compare-flamegraph[data-kind="alloc_space"] g.frame').first.wait_for(
        state="attached", timeout=TIMEOUT_MS
    )
    page.locator("#compare-functions tbody tr td").first.wait_for(timeout=TIMEOUT_MS)
    functions = page.eval_on_selector_all(
        "#compare-functions tbody tr td:first-child", "cells => cells.map(c => c.textContent)"
    )
    return page.inner_text("#compare-metric"), functions


def test_a_900_frame_request_renders_its_flame_graph_down_to_the_leaf(tmp_path: Path) -> None:
    """A request recursing 900 frames deep: its breach's flame graph draws its levels and leaf."""
    chromium = shutil.which("chromium")
    require(chromium is not None, "Debian's chromium is missing (apt-get install chromium)")
    require(
        importlib.util.find_spec("playwright") is not None,
        "Playwright for Python is missing (pip install playwright; no browser download needed)",
    )
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with spanprof_dev(tmp_path) as (_pid, app, ui, _log), sync_playwright() as playwright:
        labels = httpx.get(f"{app}/deep/{DEEP_REQUEST}", params={"seconds": 0.6}, timeout=60).json()
        settle(ui)
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{ui}/")
            row = page.locator(f'tr.breach[data-span-id="{labels["span_id"]}"]')
            row.wait_for(timeout=TIMEOUT_MS)
            row.click()
            leaf = page.locator("#flamegraph .d3-flame-graph-label", has_text="deep_leaf")
            leaf.first.wait_for(state="visible", timeout=TIMEOUT_MS)
            names = page.eval_on_selector_all(
                "#flamegraph g.frame", "frames => frames.map(f => f.getAttribute('name'))"
            )
        finally:
            browser.close()
    assert errors == []
    assert "deep_leaf" in names
    # The exact sampler keeps a stack's MAX_DEPTH leaf-most frames (pyroscope-io all).
    assert names.count("_descend") >= min(DEEP_REQUEST, MAX_DEPTH) - 1
