"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe: the browser reads commands
on fd 3 and writes answers on fd 4, each a JSON object ended by a NUL byte): no WebDriver, no websocket library.

    with Chromium(binary, timeout_s=60) as browser:
        browser.open("http://127.0.0.1:8000/")
        browser.type_into("#prompt", "the cat"); browser.click("#generate button"); browser.wait_for("...")
"""

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

BINARIES = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install -y chromium (Debian's package; see docs/serving.md)"


def find_chromium():
    return next((path for path in map(shutil.which, BINARIES) if path), None)


class BrowserError(RuntimeError):
    pass


class Chromium:
    def __init__(self, binary, timeout_s=60, width=1280, height=900):
        self.deadline = time.monotonic() + timeout_s  # every wait below ends by then: the test cannot hang
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        to_browser, self.to_browser = os.pipe()
        self.from_browser, from_us = os.pipe()
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                 "--remote-debugging-pipe", f"--user-data-dir={self.profile}", f"--window-size={width},{height}"]
        # bash puts the pipe ends on fds 3 and 4, where the browser looks for them (dash reads one digit: fd 12 fails)
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$0" "$@" 3<&{to_browser} 4>&{from_us}', binary, *flags,
                                      "about:blank"], pass_fds=(to_browser, from_us), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_us)
        self.next_id, self.buffer, self.session = 0, b"", None
        target = self.send("Target.createTarget", url="about:blank", browser=True)["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target, flatten=True, browser=True)["sessionId"]
        self.send("Page.enable")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.proc.kill()
        self.proc.wait(timeout=10)
        os.close(self.to_browser)
        os.close(self.from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)

    def left(self):
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise BrowserError("the browser did not finish in time")
        return remaining

    def send(self, method, browser=False, **params):
        """A command's result (to the page's session unless browser); a BrowserError if it failed."""
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if not browser:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply["result"]

    def receive(self):
        while b"\0" not in self.buffer:
            if not select.select([self.from_browser], [], [], self.left())[0]:
                continue
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                raise BrowserError(f"the browser exited (code {self.proc.poll()})")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def evaluate(self, expression):
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url):
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'")

    def wait_for(self, expression, poll_s=0.05):
        while not self.evaluate(expression):
            self.left()
            time.sleep(poll_s)

    def click(self, selector):
        """A real mouse click at the middle of the element."""
        x, y = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                             f".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type_into(self, selector, text):
        """Empty the field, focus it and type text as keyboard input."""
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.value = ''; e.focus(); "
                      f"}})()")
        self.send("Input.insertText", text=text)

    def screenshot(self):
        """The page as PNG bytes, full length."""
        return base64.b64decode(self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
