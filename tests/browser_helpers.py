"""Headless Chromium driven over the Chrome DevTools protocol, for the browser tests.

``tests/test_docs_site.py`` opens the docs site with it and
``tests/test_live_view.py`` the live view of a running engine: one tab, pages
loaded with every console error, exception and failed (or external) request
collected, JavaScript evaluated, screenshots taken.
"""

from __future__ import annotations

import functools
import http.server
import itertools
import json
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from base64 import b64decode
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import websocket

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
PAGE_TIMEOUT_S = 20.0
# Material renders each diagram into a closed shadow root that replaces the
# source <div class="mermaid">, so "rendered" shows as a host with no text left.
DIAGRAMS_PENDING_JS = (
    "new Promise(done => { const t0 = Date.now(); (function poll() {"
    " const pending = Array.from(document.querySelectorAll('.mermaid'))"
    "   .filter(e => e.textContent.trim() !== '' || e.getBoundingClientRect().height < 20).length;"
    " if (pending === 0 || Date.now() - t0 > 10000) done(pending); else setTimeout(poll, 50); })(); })"
)
# ------------------------------------------------------------------- CDP client
class Browser:
    """Headless Chromium with one tab, driven over the DevTools websocket."""

    def __init__(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "chromium is not installed: run `make test` (it apt-installs chromium)"
        self.profile = tempfile.mkdtemp(prefix="nanoengine-chromium-")
        self.process = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             "--window-size=1280,1600", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        port = self._devtools_port()
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=PAGE_TIMEOUT_S,
                                              suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")

    def _devtools_port(self) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().splitlines()[0])
            assert self.process.poll() is None, "chromium exited at start-up"
            time.sleep(0.05)
        raise TimeoutError("chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == call_id:
                assert "error" not in message, f"{method}: {message['error']}"
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            self.events.append(message)
            if message.get("method") == method:
                return
        raise TimeoutError(f"no {method} within {PAGE_TIMEOUT_S} s")

    def open(self, url: str) -> list[str]:
        """Load ``url`` and let its diagrams render; return every console error,
        exception, failed request and diagram left unrendered.

        The page before is left for a blank one first: a script of it still
        running (a live view reconnecting to a server that is gone) would
        otherwise be counted against ``url``."""
        self.call("Page.navigate", url="about:blank")
        self.wait_for("Page.loadEventFired")
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        pending = self.evaluate(DIAGRAMS_PENDING_JS)
        origin = "{0.scheme}://{0.netloc}/".format(urlsplit(url))
        return _errors(self.events, origin) + ([f"{pending} mermaid diagram(s) not rendered"] if pending else [])

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=1600, deviceScaleFactor=1,
                  mobile=False)
        path.write_bytes(b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    @contextmanager
    def viewport(self, width: int, height: int) -> Iterator[None]:
        """Lay pages out at ``width`` x ``height`` CSS pixels inside the ``with`` block."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        try:
            yield
        finally:
            self.call("Emulation.clearDeviceMetricsOverride")

    def close(self) -> None:
        self.ws.close()
        self.process.terminate()
        self.process.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)


def _errors(events: list[dict[str, Any]], origin: str) -> list[str]:
    """Everything that went wrong, including any request that left the site (it must work offline)."""
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            request_url = params["request"]["url"]
            if not request_url.startswith((origin, "data:", "blob:")):
                errors.append(f"external request: {request_url}")
        elif method == "Runtime.exceptionThrown":
            errors.append(f"exception: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            errors.append(f"log: {params['entry']['text']} {params['entry'].get('url', '')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            errors.append(f"request failed: {params.get('errorText')}")
    return errors


def wait_for_js(browser: Browser, condition: str, what: str, timeout_s: float = PAGE_TIMEOUT_S) -> Any:
    """Poll ``condition`` (a JavaScript expression) in the page until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = browser.evaluate(condition)
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"the page did not show {what} within {timeout_s:.0f} s ({condition})")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def serving_folder(folder: Path) -> Iterator[str]:
    """Serve ``folder``'s files on a free 127.0.0.1 port; yield its base URL (ending in /)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
