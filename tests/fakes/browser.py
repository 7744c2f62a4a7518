"""Headless Chromium driven over the Chrome DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages, NUL-terminated, commands on the browser's fd 3, answers on its fd 4), with the
standard library only.

    with Browser.launch(tmp_path) as browser:
        page = browser.new_page(width=1280, height=900)
        page.goto(url)
        page.wait_for("document.querySelector('#send') !== null")
        page.screenshot(tmp_path / "page.png")
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Optional

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, process: subprocess.Popen, commands: int, answers: int):
        self._process = process
        self._commands = os.fdopen(commands, "wb", buffering=0)
        self._answers = os.fdopen(answers, "rb", buffering=0)
        self._next_id = 0
        self._replies: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="cdp-reader", daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, profile: Path) -> "Browser":
        if CHROMIUM is None:
            raise BrowserError("chromium is not installed")
        to_browser_r, to_browser_w = os.pipe()
        from_browser_r, from_browser_w = os.pipe()
        # Above 9, so that bash's `3<&N 4>&M` never overwrites one end with the other (dash takes one digit only).
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser_r, from_browser_w)]
        os.close(to_browser_r)
        os.close(from_browser_w)
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--mute-audio",
                 "--remote-debugging-pipe", f"--user-data-dir={profile}", "about:blank"]
        process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{high[0]} 4>&{high[1]}', "bash", CHROMIUM, *flags],
            pass_fds=high, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for fd in high:
            os.close(fd)
        return cls(process, to_browser_w, from_browser_r)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (BrowserError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._commands.close()

    # -- the protocol --------------------------------------------------------------------------
    def send(self, method: str, params: Optional[dict] = None, session: Optional[str] = None,
             timeout: float = 30) -> dict:
        with self._lock:
            self._next_id += 1
            message_id = self._next_id
            reply: queue.Queue = queue.Queue(maxsize=1)
            self._replies[message_id] = reply
        message = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self._commands.write(json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer within {timeout:g}s") from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def _read(self) -> None:
        buffer = b""
        while True:
            data = self._answers.read(65536)
            if not data:
                return
            buffer += data
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                message = json.loads(raw)
                reply = self._replies.pop(message.get("id"), None) if "id" in message else None
                if reply is not None:
                    reply.put(message)  # events (no id) are not needed: pages are polled

    def new_page(self, width: int, height: int, mobile: bool = False) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "mobile": mobile,
                                                          "deviceScaleFactor": 2 if mobile else 1})
        return page


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser = browser
        self.session = session

    def send(self, method: str, params: Optional[dict] = None, timeout: float = 30) -> dict:
        return self.browser.send(method, params, self.session, timeout)

    def goto(self, url: str, timeout: float = 30) -> None:
        self.send("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete'", timeout)

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        """The expression's value once it is truthy."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout:g}s: {expression}")
            time.sleep(0.05)

    def screenshot(self, path: Path) -> Path:
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": False})["data"]
        path.write_bytes(base64.b64decode(data))
        return path
