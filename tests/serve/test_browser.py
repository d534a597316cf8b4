"""The status page in a real headless browser (Debian's chromium through selenium): it renders
every GPU, shows hostile text as text, updates in place when a lease starts, fits a phone, and
its own CSP lets its own assets load. Skips cleanly where chromium or selenium is missing.

Set ``DEVICEKIT_SERVE_SCREENSHOT=docs/serve.png`` to keep the screenshot (the README's).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.serve import StatusServer
from devicekit.sharing.leases import Lease
from tests.serve.conftest import machine

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
         "--disable-extensions", "--hide-scrollbars")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium not installed")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip("chromium and chromium-driver not installed (apt-get install chromium "
                "chromium-driver)", allow_module_level=True)

from selenium.common.exceptions import NoAlertPresentException  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # with both paths given, selenium downloads nothing
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument("--window-size=1280,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def test_page_in_a_browser(simulate, browser, tmp_path):
    simulate(machine(4))
    gpus = dk.gpus()
    with StatusServer("127.0.0.1", 0, interval=0.3) as server, \
            Lease.acquire([gpus[1].uuid], memory=20 * 2**30, command="python finetune.py"):
        browser.get(server.url)
        wait = WebDriverWait(browser, 60, poll_frequency=0.1)
        # the live part is swapped in every 0.3 s: read it in one script, never stale
        def read(selector: str, what: str = "textContent") -> list[str]:
            return browser.execute_script(
                "return Array.from(document.querySelectorAll(arguments[0]),"
                " e => arguments[1] === 'class' ? e.className :"
                " arguments[1].startsWith('data-') ? e.getAttribute(arguments[1]) :"
                " e[arguments[1]]);", selector, what)

        assert read("section.gpu", "data-uuid") == [g.uuid for g in gpus]
        # hostile text is text: no alert, the markup visible as characters
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018
        commands = read("td.command")
        assert any("<script>alert(1)</script>" in c and "\\x1b[2J" in c for c in commands)
        assert read("#live script, #live img") == []
        # a lease that starts shows up in place: no reload (the marker survives)
        browser.execute_script("window.devicekitMarker = 42;")
        third = f'section.gpu[data-uuid="{gpus[2].uuid}"]'
        assert "leased" not in read(third, "class")[0]
        with Lease.acquire([gpus[2].uuid], command="python eval.py"):
            # (a sample taken between the lock and the lease file shows "held through its lock")
            wait.until(lambda d: "leased by" in read(third, "innerText")[0])
            assert "leased" in read(third, "class")[0]
            assert "python eval.py" in read(third, "innerText")[0]
            assert browser.execute_script("return window.devicekitMarker;") == 42
            assert read("#state") == ["live"]
            shot = Path(os.environ.get("DEVICEKIT_SERVE_SCREENSHOT") or tmp_path / "serve.png")
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        # readable on a phone: one column, nothing wider than the screen
        browser.set_window_size(390, 844)
        wait.until(lambda d: d.execute_script("return window.innerWidth") <= 400)
        overflow = browser.execute_script(
            "return document.documentElement.scrollWidth - window.innerWidth;")
        assert overflow <= 0
        lefts = browser.execute_script(
            "return Array.from(document.querySelectorAll('section.gpu'),"
            " e => e.getBoundingClientRect().left);")
        assert len(set(lefts)) == 1 and len(lefts) == 4
    # the page's own CSP let its own script and style load: no violation in the console
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [e for e in errors if "Content Security Policy" in e or "/static/" in e], errors


def test_lab_page_in_a_browser(simulate, browser):
    """``serve --peer``: every peer's GPUs and jobs on one page, hostile text as text, a job that
    starts on a peer shown in place, one column on a phone, nothing blocked by the CSP."""
    from devicekit.serve.peer_fetch import PeerAddress
    from devicekit.serve.sampler import Sampler
    from tests.conftest import h100
    from tests.serve.conftest import HOSTILE_USER, document

    quiet = document(simulate, "gpu1", [h100(uuid="GPU-11"), h100(uuid="GPU-12")])
    late = document(simulate, "gpu1", [h100(uuid="GPU-11"), h100(uuid="GPU-12")],
                    {1: {"job": "late-job"}})
    busy = document(simulate, "gpu2", [h100(uuid="GPU-21", processes=[
        {"pid": 5, "user": HOSTILE_USER, "memory": "1GiB", "command": "x"}])],
        {0: {"job": "<script>alert(3)</script>", "user": "<img src=x onerror=alert(4)>"}})
    current = {"doc": quiet}
    peers = [StatusServer("127.0.0.1", 0, interval=0.3,
                          sampler=Sampler(0.3, collect=lambda: current["doc"]())),
             StatusServer("127.0.0.1", 0, interval=0.3, sampler=Sampler(0.3, collect=busy))]
    for peer in peers:
        peer.start()
    simulate(machine(2))
    try:
        with StatusServer("127.0.0.1", 0, interval=0.3, peers=[
                PeerAddress.parse(f"127.0.0.1:{p.address[1]}") for p in peers]) as server:
            browser.get(server.url + "lab")
            wait = WebDriverWait(browser, 60, poll_frequency=0.1)

            def read(selector: str, what: str = "textContent") -> list[str]:
                return browser.execute_script(
                    "return Array.from(document.querySelectorAll(arguments[0]),"
                    " e => arguments[1].startsWith('data-') ? e.getAttribute(arguments[1]) :"
                    " e[arguments[1]]);", selector, what)

            wait.until(lambda d: len(read("section.host.up")) == 3)
            assert read("tr[data-uuid]", "data-uuid") == [
                *(g.uuid for g in dk.gpus()), "GPU-11", "GPU-12", "GPU-21"]
            with pytest.raises(NoAlertPresentException):
                browser.switch_to.alert.text  # noqa: B018
            page = read("#live", "innerText")[0]
            assert "<script>alert(3)</script>" in page and "<img src=x onerror=alert(4)>" in page
            assert read("#live script, #live img") == []
            # a job that starts on a peer shows up in place, without a reload
            browser.execute_script("window.devicekitMarker = 7;")
            current["doc"] = late
            wait.until(lambda d: "late-job" in read('tr[data-uuid="GPU-12"]', "innerText")[0])
            assert browser.execute_script("return window.devicekitMarker;") == 7
            browser.set_window_size(390, 844)
            wait.until(lambda d: d.execute_script("return window.innerWidth") <= 400)
            overflow = browser.execute_script(
                "return document.documentElement.scrollWidth - window.innerWidth;")
            assert overflow <= 0
            lefts = browser.execute_script(
                "return Array.from(document.querySelectorAll('section.host'),"
                " e => e.getBoundingClientRect().left);")
            assert len(set(lefts)) == 1 and len(lefts) == 3
    finally:
        for peer in peers:
            peer.stop()
    errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not [e for e in errors if "Content Security Policy" in e or "/static/" in e], errors
