"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe): no websocket library,
no browser download, only the system's /usr/bin/chromium. Used by the report tests to open a report as a person
would and record what the page did: console messages, exceptions, dialogs, and every network request."""
from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--disable-extensions", "--mute-audio"]


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageRecord:
    """What happened while a page loaded."""

    console: list[dict[str, Any]] = field(default_factory=list)     # Runtime.consoleAPICalled
    exceptions: list[dict[str, Any]] = field(default_factory=list)  # Runtime.exceptionThrown
    log: list[dict[str, Any]] = field(default_factory=list)         # Log.entryAdded (CSP violations, failed loads)
    requests: list[str] = field(default_factory=list)               # URLs of Network.requestWillBeSent
    dialogs: list[dict[str, Any]] = field(default_factory=list)     # alert(), confirm() ...

    def errors(self) -> list[str]:
        found = [f"console.{m['type']}: {m.get('args')}" for m in self.console
                 if m["type"] in ("error", "warning", "assert")]
        found += [f"exception: {e['exceptionDetails'].get('text')}" for e in self.exceptions]
        found += [f"log {e['entry']['level']}: {e['entry'].get('text')}" for e in self.log
                  if e["entry"]["level"] in ("error", "warning")]
        found += [f"dialog: {d.get('message')}" for d in self.dialogs]
        return found


class Chromium:
    """One browser, one tab. Use as a context manager."""

    def __init__(self, binary: str, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._profile = tempfile.mkdtemp(prefix="analyzer-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def wire_pipes() -> None:  # the browser reads commands on fd 3 and writes replies on fd 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self._proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self._profile}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=wire_pipes,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False)
        except Exception:  # noqa: BLE001 - the browser may already be gone; it is killed below either way
            pass
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, session: bool = True, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and getattr(self, "_session", None):
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_for(self, method: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        for i, event in enumerate(self._events):
            if event.get("method") == method:
                return self._events.pop(i)
        while True:
            event = self._read_message(deadline)
            if event.get("method") == method:
                return event
            self._events.append(event)

    def open(self, url: str, width: int = 1280, height: int = 900, dark: bool = False) -> PageRecord:
        """Load `url` and return what the page did while loading (and a moment after)."""
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Emulation.setEmulatedMedia", media="",
                  features=[{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}])
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(r => setTimeout(r, 200))")  # let late errors or requests show up
        record = PageRecord()
        for event in self._events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled":
                record.console.append(params)
            elif method == "Runtime.exceptionThrown":
                record.exceptions.append(params)
            elif method == "Log.entryAdded":
                record.log.append(params)
            elif method == "Network.requestWillBeSent":
                record.requests.append(params["request"]["url"])
            elif method == "Page.javascriptDialogOpening":
                record.dialogs.append(params)
        self._events.clear()
        return record

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = True, max_height: int = 16000) -> None:
        if full_page:
            height = min(int(self.evaluate("document.documentElement.scrollHeight")), max_height)
            width = int(self.evaluate("document.documentElement.clientWidth"))
            self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                      mobile=False)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
