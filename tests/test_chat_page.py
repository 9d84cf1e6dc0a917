"""The chat page `petals-chain api` serves at /, driven in headless Chromium over the DevTools
protocol (Chromium's `--remote-debugging-pipe`: JSON messages on file descriptors 3 and 4, so no
websocket library is needed): a two-turn conversation over a live two-server swarm (conftest's
`live_gateway`, shared with tests/test_api_gateway.py) whose text equals
the API's greedy answer, the second turn reusing the first's prompt from the servers' prefix caches,
the stop button, and a screenshot (saved as chat_page.png in the test's tmp dir)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.swarm_helpers import LIVE_GATEWAY_KEY

openai = pytest.importorskip("openai", reason="the gateway tests need the official `openai` package")

MODEL = "smollm2-135m"
KEY = LIVE_GATEWAY_KEY
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--window-size=1200,900",
]


def test_chat_page_is_served_from_the_package_and_can_be_turned_off():
    from fastapi.testclient import TestClient

    from petals_chain.api.gateway import Gateway, GatewayConfig

    def app(**config):
        return TestClient(Gateway(object(), None, GatewayConfig(model_name=MODEL, **config)).app)

    on = app(api_keys={"k": "user"})
    page = on.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert 'data-key-required="true"' in page.text and "http" not in page.text.replace("http-equiv", "")  # no CDN
    for path in ("/chat/chat.js", "/chat/chat.css"):
        assert on.get(path).status_code == 200
    assert 'data-key-required="false"' in app().get("/").text
    off = app(chat_page=False)
    assert off.get("/").status_code == 200 and "chat page off" in off.get("/").text  # Ollama clients probe /
    assert off.get("/chat/chat.js").status_code == 404


class DevTools:
    """Chromium driven over `--remote-debugging-pipe`: one page, commands answered in order of id."""

    def __init__(self, browser: str, profile_dir: str):
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # the pipe's ends become the browser's fds 3 (commands) and 4 (replies and events); bash, as dash
        # redirects only single-digit fds
        redirect = f"3<&{to_browser_r} 4>&{from_browser_w} {to_browser_r}<&- {from_browser_w}>&-"
        self.proc = subprocess.Popen(
            [
                "bash",
                "-c",
                f'exec "$0" "$@" {redirect}',
                browser,
                *BROWSER_FLAGS,
                f"--user-data-dir={profile_dir}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            pass_fds=(to_browser_r, from_browser_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()  # never let its stderr fill up
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", {"targetId": page["targetId"], "flatten": True})["sessionId"]
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method, session=True)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1200, "height": 900, "deviceScaleFactor": 1, "mobile": False},
            session=True,
        )

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._from_browser, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._cond:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._replies[message["id"]] = message
                    else:
                        self.events.append(message)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def call(self, method: str, params: dict | None = None, *, session: bool = False, timeout_s: float = 60) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._next_id not in self._replies:
                left = deadline - time.monotonic()
                assert left > 0 and self.proc.poll() is None, f"Chromium did not answer {method}"
                self._cond.wait(left)
            reply = self._replies.pop(self._next_id)
        assert "error" not in reply, f"{method}: {reply['error']}"
        return reply["result"]

    def js(self, expression: str):
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, session=True
        )
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_js(self, expression: str, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not (value := self.js(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.2)
        return value

    def type_into(self, element_id: str, text: str) -> None:
        """Focus the element, clear it, and type `text` as keyboard input would insert it."""
        self.js(f"(() => {{ const e = document.getElementById({element_id!r}); e.focus(); e.value = ''; }})()")
        self.call("Input.insertText", {"text": text}, session=True)
        self.js(f"document.getElementById({element_id!r}).dispatchEvent(new Event('change'))")

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call(
                "Input.dispatchKeyEvent",
                {
                    "type": kind,
                    "key": "Enter",
                    "code": "Enter",
                    "windowsVirtualKeyCode": 13,
                    **({"text": "\r"} if kind == "keyDown" else {}),
                },
                session=True,
            )

    def click(self, element_id: str) -> None:
        x, y = self.js(
            f"(() => {{ const r = document.getElementById({element_id!r}).getBoundingClientRect(); "
            "return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1},
                session=True,
            )

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close", timeout_s=10)
            self.proc.wait(10)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(self._to_browser)


@pytest.fixture(scope="module")
def gateway(live_gateway):
    """The shared swarm and `petals-chain api` over it (conftest's `live_gateway`: two servers, their
    prefix caches on, as by default); the gateway's root URL."""
    return live_gateway.root


@pytest.fixture
def browser():
    """Chromium's path; skips (before the swarm starts) where it is not installed."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip(
            "chromium is not installed (make browser, or apt-get install -y chromium); the chat page test "
            "drives it headless"
        )
    return found


@pytest.fixture
def page(browser, gateway, tmp_path):
    tools = DevTools(browser, str(tmp_path / "profile"))
    try:
        tools.call("Page.navigate", {"url": gateway}, session=True)
        tools.wait_js("document.readyState === 'complete' && !!document.getElementById('api-key')", 60, "the page")
        assert tools.js("!document.getElementById('key-label').hidden")  # the gateway has keys: the page asks
        tools.type_into("api-key", KEY)
        tools.wait_js("document.getElementById('model').value", 60, "the model list")
        yield tools
    finally:
        tools.close()


def _turn(page, text: str, index: int) -> dict:
    """Type `text`, press Enter and wait for the answer `index` (0-based) to finish; returns what it shows."""
    page.type_into("input", text)
    page.press_enter()
    answer = f"document.querySelectorAll('.msg.assistant')[{index}]"
    page.wait_js(f"({answer} || {{dataset: {{}}}}).dataset.state === 'done'", 240, f"answer {index + 1}")
    return page.js(
        f"(() => {{ const m = document.querySelectorAll('.msg.assistant')[{index}]; const meta = "
        "m.querySelector('.meta'); return {text: m.querySelector('.text').textContent, "
        "meta: meta.textContent, ...meta.dataset}; })()"
    )


@pytest.mark.integration
@pytest.mark.model
def test_two_turns_in_headless_chromium_equal_the_apis_greedy_answers(page, gateway, tmp_path):
    assert page.js("document.getElementById('model').value") == MODEL
    page.type_into("temperature", "0")
    page.type_into("max-tokens", "12")
    questions = ["What is the capital of France?", "And of Italy?"]
    first = _turn(page, questions[0], 0)
    second = _turn(page, questions[1], 1)
    client = openai.OpenAI(base_url=gateway + "v1", api_key=KEY, max_retries=0, timeout=180)
    messages = [{"role": "user", "content": questions[0]}]
    expected = []
    for question, shown in zip(questions, (first, second)):
        if question != questions[0]:
            messages += [{"role": "assistant", "content": expected[-1]}, {"role": "user", "content": question}]
        expected.append(
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
        )
    assert [first["text"], second["text"]] == expected
    for shown in (first, second):
        # the chain of the shared swarm's two servers, as `describe()` names it
        assert re.fullmatch(r"\S+\[0:15\) -> \S+\[15:30\)", shown["chain"]), shown["chain"]
        assert int(shown["tokens"]) >= 1 and "tokens/s" in shown["meta"]
        assert float(shown["rate"]) > 0
    # the second turn's session started past the first turn's prompt, cached by the servers
    assert int(second["cached"]) >= 16 and f"{second['cached']} reused" in second["meta"]
    shot = tmp_path / "chat_page.png"
    shot.write_bytes(page.screenshot())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    problems = [
        e
        for e in page.events
        if e.get("method") in ("Runtime.exceptionThrown", "Log.entryAdded")
        and (e["method"] == "Runtime.exceptionThrown" or e["params"]["entry"]["level"] == "error")
    ]
    assert not problems, problems  # no script error, nothing blocked by the page's Content-Security-Policy


@pytest.mark.integration
@pytest.mark.model
def test_stop_button_cancels_the_answer_and_frees_the_session(page, gateway):
    page.type_into("temperature", "0")
    page.type_into("max-tokens", "400")
    page.type_into("input", "Write a long story about a dragon.")
    page.press_enter()
    page.wait_js("(document.querySelector('.msg.assistant .text') || {}).textContent", 120, "the first tokens")
    assert page.js("document.getElementById('send').textContent") == "Stop"
    page.click("send")
    page.wait_js("document.querySelector('.msg.assistant').dataset.state === 'stopped'", 30, "the stop")
    assert page.js("document.getElementById('send').textContent") == "Send"
    deadline = time.monotonic() + 60
    while json.loads(urllib.request.urlopen(gateway + "health", timeout=10).read())["active_sessions"]:
        assert time.monotonic() < deadline, "the stopped answer's session is still running"
        time.sleep(0.2)
