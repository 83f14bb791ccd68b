"""The status page (``GET /``) in a real headless browser: Debian's ``chromium`` driven by
``chromedriver`` through selenium, against a real edge on 127.0.0.1, polling the real
``/admin/status``. ``.ci/run`` installs the browser; elsewhere the tests are skipped when it is
missing (and fail when ``CI`` is set, so CI can never skip them silently).

Screenshots are saved in ``$DISPATCHER_TEST_ARTIFACTS`` (default ``test-artifacts/`` in the
checkout)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import httpx
import pytest
import trio

from dispatcher import wire
from dispatcher.api.admin import PAGE
from dispatcher.observe import status
from dispatcher.observe.traffic import RequestSummary
from dispatcher.store.seam import EdgeRecord

from .fakes import connect, hello, wait_until
from .test_observability import ADMIN_KEY, CLIENT_KEY, chat, open_edge

if TYPE_CHECKING:
    from selenium.webdriver.chrome.webdriver import WebDriver

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(
    os.environ.get("DISPATCHER_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / "test-artifacts"
)
REFRESH = 0.5
"""The page's polling period in these tests (``?refresh=``; 2 s by default)."""
SEEN_WITHIN = 20.0
"""How long the page may take to show a change: generous (a loaded CI machine); the page
itself polls every REFRESH seconds."""


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """A headless chromium with a fresh profile; its console collected."""
    missing = _browser_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the status page tests need a browser in CI: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # As this machine's probe starts it: no sandbox (root), and none of the background
    # connections a closed network refuses.
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def _console_errors(driver: WebDriver) -> list[dict[str, Any]]:
    # selenium's get_log carries no annotations (the library's, not ours).
    entries: list[dict[str, Any]] = driver.get_log("browser")  # type: ignore[no-untyped-call]
    return [entry for entry in entries if entry["level"] in ("SEVERE", "ERROR")]


def _section_text(driver: WebDriver, section: str) -> str:
    from selenium.webdriver.common.by import By

    text: str = driver.find_element(By.ID, section).text
    return text


async def _until(driver: WebDriver, what: str, condition: Callable[[WebDriver], bool]) -> None:
    """Wait (in a thread: selenium blocks) until the page meets ``condition``."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    def wait() -> None:
        try:
            WebDriverWait(driver, SEEN_WITHIN, poll_frequency=0.1).until(condition)
        except TimeoutException:
            raise AssertionError(
                f"the page did not show {what} within {SEEN_WITHIN} s; it shows:\n"
                + _section_text(driver, "main")
            ) from None

    await trio.to_thread.run_sync(wait)


def _table(driver: WebDriver, section: str) -> list[dict[str, str]]:
    """A section's table as the page shows it now: one row per ``<tr>``, each cell's text
    by its column's header."""
    # Pairs, not objects: the driver hands a JS object back with its keys sorted.
    rows: list[list[list[str]]] = driver.execute_script(
        """
        var table = document.querySelector("#" + arguments[0] + " table");
        if (!table) { return []; }
        var heads = Array.from(table.tHead.rows[0].cells).map(function (c) {
          return c.textContent;
        });
        return Array.from(table.tBodies[0].rows).map(function (tr) {
          return Array.from(tr.cells).map(function (td, i) { return [heads[i], td.textContent]; });
        });
        """,
        section,
    )
    return [dict(row) for row in rows]


def _screenshot(driver: WebDriver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), path
    return path


async def test_the_page_shows_nodes_queues_and_requests_and_follows_them(
    browser: WebDriver,
) -> None:
    async with open_edge(local_node=False) as edge, trio.open_nursery() as nursery:
        node_a = await connect(edge.dispatcher, hello("node-a", model="m", slots=1))
        node_b = await connect(edge.dispatcher, hello("node-b", model="b-model", slots=2))
        nursery.start_soon(node_b.answer_pings)
        streamed: list[bytes] = []
        answered: list[httpx.Response] = []

        async def stream() -> None:
            async with edge.client(CLIENT_KEY) as client:
                body = chat("m", stream=True)
                async with client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-request-id": "streaming-1"},
                ) as response:
                    async for chunk in response.aiter_bytes():
                        streamed.append(chunk)

        async def queued() -> None:
            async with edge.client(CLIENT_KEY) as client:
                answered.append(
                    await client.post(
                        "/v1/chat/completions",
                        json=chat("m"),
                        headers={"x-request-id": "queued-1"},
                    )
                )

        nursery.start_soon(stream)
        run = await node_a.receive_run()
        await node_a.emit(run.run_id, ("run.delta", {"text": "partial "}))
        await wait_until(lambda: streamed)
        nursery.start_soon(queued)
        await wait_until(lambda: edge.dispatcher.admission.statistics().waiting == 1)
        # node-a's pings are answered by the scripted receive calls below; the page's
        # whole first part happens well within a heartbeat timeout.

        # The key travels in the fragment, which the browser never sends; the page keeps it
        # for the tab and takes it out of the address bar.
        url = f"{edge.url}/?refresh={REFRESH}#key={ADMIN_KEY}"
        await trio.to_thread.run_sync(browser.get, url)

        def shows_everything(driver: WebDriver) -> bool:
            edges = _section_text(driver, "edges")
            nodes = _section_text(driver, "nodes")
            queues = _section_text(driver, "queues")
            flight = _section_text(driver, "in-flight")
            return (
                "Edges (1)" in edges  # the edge alone: no Redis
                and f"{edge.dispatcher.cluster.edge_id} this edge" in edges
                and "node-a" in nodes
                and "node-b" in nodes
                and "node-b label" in nodes
                and "m" in queues
                and "streaming-1" in flight
                and "queued-1" in flight
                and "answering" in flight
                and "queued" in flight
            )

        await _until(browser, "both nodes, the queue and both requests", shows_everything)
        assert "#" not in browser.current_url, browser.current_url
        queues = _section_text(browser, "queues")
        assert "m 1" in queues, queues  # model m, one waiting
        [row] = [line for line in queues.splitlines() if line.startswith("m 1")]
        assert row.endswith(" off"), row  # the affinity column: off for this group
        _screenshot(browser, "status-page-busy.png")

        # The stream ends; the queued request gets node-a's slot and is answered; node-b
        # leaves.
        await node_a.send(wire.RunCompleted(run_id=run.run_id, seq=1))
        second = await node_a.receive_run()
        await node_a.emit(second.run_id, ("run.delta", {"text": "ok"}), ("run.completed", {}))
        await wait_until(lambda: answered)
        await node_b.conn.aclose()
        await wait_until(lambda: "node-b" not in edge.dispatcher.registry.sessions)

        def shows_it_over(driver: WebDriver) -> bool:
            nodes = _section_text(driver, "nodes")
            flight = _section_text(driver, "in-flight")
            return "node-a" in nodes and "node-b" not in nodes and "Nothing in flight." in flight

        await _until(browser, "the stream over and node-b gone", shows_it_over)
        assert "Nodes (1)" in _section_text(browser, "nodes")
        _screenshot(browser, "status-page-after.png")

        # Usable at a phone's width: the document never scrolls sideways (wide tables scroll
        # inside their own box).
        await trio.to_thread.run_sync(browser.set_window_size, 390, 844)
        await trio.sleep(REFRESH * 2)
        overflow = await trio.to_thread.run_sync(
            browser.execute_script,
            "return document.documentElement.scrollWidth - window.innerWidth;",
        )
        assert overflow <= 0, f"the page is {overflow}px wider than a phone's screen"
        _screenshot(browser, "status-page-phone.png")

        errors = await trio.to_thread.run_sync(_console_errors, browser)
        await node_a.conn.aclose()

    assert errors == []
    assert answered[0].status_code == 200
    assert b"data: [DONE]" in b"".join(streamed)


async def test_the_page_asks_for_the_key_and_shows_node_labels_as_text(
    browser: WebDriver,
) -> None:
    """Without a key the page asks for one (no data shown); with it, what a node sent is
    shown as text: a label that looks like markup never becomes markup."""
    from selenium.webdriver.common.by import By

    async with open_edge(local_node=False) as edge, trio.open_nursery() as nursery:
        greeting = hello("node-x", model="m")
        greeting = wire.Hello(
            protocol=greeting.protocol,
            node_id=greeting.node_id,
            label='<img src=x onerror="document.title=1">',
            token=greeting.token,
            providers=greeting.providers,
        )
        node = await connect(edge.dispatcher, greeting)
        nursery.start_soon(node.answer_pings)

        await trio.to_thread.run_sync(browser.get, f"{edge.url}/?refresh={REFRESH}")

        def asks(driver: WebDriver) -> bool:
            form = driver.find_element(By.ID, "login")
            return form.is_displayed() and not driver.find_element(By.ID, "main").is_displayed()

        await _until(browser, "the key form", asks)

        def log_in() -> None:
            browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
            browser.find_element(By.CSS_SELECTOR, "#login button").click()

        await trio.to_thread.run_sync(log_in)
        await _until(
            browser,
            "the node's label as text",
            lambda driver: "<img src=x" in _section_text(driver, "nodes"),
        )
        images = await trio.to_thread.run_sync(browser.find_elements, By.CSS_SELECTOR, "#nodes img")
        title = await trio.to_thread.run_sync(lambda: browser.title)
        errors = await trio.to_thread.run_sync(_console_errors, browser)
        await node.conn.aclose()

    assert images == []
    assert title == "trio-dispatcher status"
    # The one request made without a key was refused (401) before the form appeared: that
    # refusal is the only thing the console may say.
    assert all("401" in entry["message"] for entry in errors), errors
    assert len(errors) <= 1, errors


async def test_the_page_is_one_document_with_a_strict_policy() -> None:
    async with open_edge(local_node=False) as edge, httpx.AsyncClient(base_url=edge.url) as client:
        page = await client.get("/")
        head = await client.head("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy
    assert "connect-src 'self'" in policy
    assert "'unsafe-inline'" not in policy
    assert "frame-ancestors 'none'" in policy
    assert page.headers["x-frame-options"] == "DENY"
    # Nothing is fetched from anywhere else; no data is in the document itself.
    assert "http://" not in page.text
    assert "https://" not in page.text
    assert "node-" not in page.text
    assert head.status_code == 200
    assert head.content == b""


EMPTY = ("", "\N{EN DASH}")
"""What a cell shows for a value it does not have (the page's dash)."""


async def test_every_column_of_a_live_request_and_a_failures_time_show_a_value(
    browser: WebDriver,
) -> None:
    """A stream held on the echo model (admitted, answering, tokens so far) has a value in
    every column of the in-flight table, and a failure has its time in the failures table:
    the page reads the fields the document has (``attempts``, ``duration_s``,
    ``started_at``), not names it does not (which render as a dash for ever)."""
    async with open_edge() as edge, trio.open_nursery() as nursery:
        async with edge.client(CLIENT_KEY) as client:
            unknown = await client.post(
                "/v1/chat/completions",
                json=chat("no-such-model"),
                headers={"x-request-id": "failing-1"},
            )
        assert unknown.status_code == 404, unknown.text
        failures = (await edge.status())["recent_failures"]
        assert [f["client_request_id"] for f in failures] == ["failing-1"], failures

        streamed: list[bytes] = []

        async def stream() -> None:
            # 400 words, 0.1 s apart: held far longer than the test looks at it.
            words = " ".join(f"w{i}" for i in range(400))
            body = chat("echo", words, stream=True, echo={"token_delay": 0.1})
            async with (
                edge.client(CLIENT_KEY) as client,
                client.stream(
                    "POST",
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-request-id": "held-1"},
                ) as response,
            ):
                async for chunk in response.aiter_bytes():
                    streamed.append(chunk)

        nursery.start_soon(stream)
        await wait_until(lambda: b'"content":"w' in b"".join(streamed), timeout=30)

        await trio.to_thread.run_sync(browser.get, f"{edge.url}/?refresh={REFRESH}#key={ADMIN_KEY}")
        await _until(
            browser,
            "the held stream answering and the failure",
            lambda driver: (
                "held-1" in _section_text(driver, "in-flight")
                and "answering" in _section_text(driver, "in-flight")
                and "failing-1" in _section_text(driver, "failures")
            ),
        )
        flight = await trio.to_thread.run_sync(_table, browser, "in-flight")
        failed = await trio.to_thread.run_sync(_table, browser, "failures")
        _screenshot(browser, "status-page-columns.png")
        errors = await trio.to_thread.run_sync(_console_errors, browser)
        nursery.cancel_scope.cancel()

    (row,) = flight
    assert list(row) == [
        "route",
        "model",
        "tenant",
        "state",
        "node",
        "attempt",
        "age",
        "ttft",
        "in",
        "out",
        "request",
    ]
    missing = [column for column, text in row.items() if text.strip() in EMPTY]
    assert missing == [], f"in-flight columns without a value: {missing} in {row}"
    assert (row["route"], row["model"], row["state"], row["node"], row["attempt"]) == (
        "/v1/chat/completions",
        "echo",
        "answering",
        "local",
        "1",
    )
    assert row["request"] == "held-1"
    assert re.fullmatch(r"\d+(\.\d+)? (ms|s|min|h)", row["age"]), row
    assert re.fullmatch(r"\d+(\.\d+)? (ms|s|min|h)", row["ttft"]), row
    (failure,) = failed
    assert re.fullmatch(r"\d+(\.\d+)? (ms|s|min|h) ago", failure["when"]), failure
    assert (failure["status"], failure["outcome"], failure["request"]) == (
        "404",
        "rejected",
        "failing-1",
    )
    assert errors == []


# -- what the page's script reads -------------------------------------------------------

_SCRIPT = re.search(rb"<script>(.*?)</script>", PAGE, re.DOTALL)
assert _SCRIPT is not None
SCRIPT = _SCRIPT.group(1).decode()

READS: dict[str, type[Any]] = {
    "s": status.EdgeStatus,
    "n": status.NodeStatus,
    "p": status.ProviderStatus,
    "m": status.ModelSlots,
    "q": status.QueueStatus,
    "r": RequestSummary,
    "f": RequestSummary,
    "e": EdgeRecord,
}
"""The script's names for the document's objects (its ``function (n) ...`` callbacks) and
the class in ``dispatcher.status`` each one is."""


def test_the_page_reads_only_fields_the_document_has() -> None:
    """Every ``x.field`` the script reads of the document (``s`` the document, ``e`` an edge,
    ``n`` a node, ``r`` a request in flight ...) is a field of the class that document part
    is: a field it does not have reads as ``undefined`` and its column shows a dash for
    ever."""
    read: dict[str, set[str]] = {name: set() for name in READS}
    for name, field in re.findall(r"(?<![\w.])([snpmqrfe])\.([A-Za-z_]\w*)", SCRIPT):
        read[name].add(field)
    unknown = {
        name: sorted(fields - {f.name for f in attrs.fields(READS[name])})
        for name, fields in read.items()
    }
    assert {name: fields for name, fields in unknown.items() if fields} == {}
    # Each name is still what the script calls that part (a renamed callback variable
    # would otherwise leave its reads unchecked).
    assert all(read.values()), read
