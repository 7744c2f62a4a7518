"""The playground in headless Chromium (Debian's package; scripts/install.sh test installs it),
against servers on the fake backends: a prompt streams into coloured spans and a stats line, side
by side with `off` the greedy texts agree, the dashboard fills from /metrics and the costs, a
phone-width window does not scroll sideways, and with a key required the page is refused until
the key is entered. Screenshots go into each test's temporary folder."""
import json
import re

import httpx
import pytest
from fakes.browser import CHROMIUM, Browser

from specdec.backends.fake import FakeBackend
from specdec.engine.engine import Engine
from specdec.server import ServerConfig, create_app
from specdec.server.testing import serve_in_thread
from specdec.types import SpecConfig

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (scripts/install.sh test installs "
                                                          "it when run as root with apt)")]

MODEL = "fake-target"
PROMPT = "the cat sat on the mat"
KEY = "sk-playground"
LAST_ANSWER = "[...document.querySelectorAll('.answer')].at(-1)"


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with Browser.launch(tmp_path_factory.mktemp("chromium-profile")) as chromium:
        yield chromium


def serve(**config):
    engine = Engine(FakeBackend(seed=7), FakeBackend(seed=7, noise=0.6), n_slots=4)
    return serve_in_thread(create_app(engine, ServerConfig(served_model_name=MODEL, spec=SpecConfig("draft", 4),
                                                           **config)))


def open_page(browser, url, width=1280, height=900, mobile=False):
    page = browser.new_page(width, height, mobile)
    page.goto(url + "/")
    page.wait_for("document.querySelector('#server-status').textContent !== ''")
    return page


def ask(page, prompt, **settings):
    """Type the prompt and send it, as a user would, after setting the controls (id -> value)."""
    for control, value in settings.items():
        kind = "checked" if isinstance(value, bool) else "value"
        page.evaluate(f"document.getElementById({json.dumps(control)}).{kind} = {json.dumps(value)}")
    answers = page.evaluate("document.querySelectorAll('.answer').length")
    page.evaluate(f"document.getElementById('prompt').value = {json.dumps(prompt)};"
                  "document.getElementById('composer').requestSubmit()")
    page.wait_for(f"document.querySelectorAll('.answer').length > {answers}")
    return page.wait_for(f"{LAST_ANSWER}.dataset.state !== 'running' && {LAST_ANSWER}.dataset.state")


def spans_of_last_answer(page):
    return page.evaluate(f"[...{LAST_ANSWER}.querySelectorAll('.text span')].map(s => [s.className, s.textContent])")


def greedy_text(url, headers=None):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 256}
    response = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    return response.json()["choices"][0]["message"]["content"]


def test_a_prompt_streams_into_coloured_tokens_and_a_stats_line(browser, tmp_path):
    with serve() as (url, _):
        page = open_page(browser, url)
        assert ask(page, PROMPT, method="draft") == "done"
        spans = spans_of_last_answer(page)
        classes = {cls for cls, _ in spans}
        assert {"src-draft", "src-target"} <= classes  # the fake draft model is right most of the time
        assert "".join(text for cls, text in spans if cls != "rejected") == greedy_text(url)
        stats = page.evaluate(f"{LAST_ANSWER}.querySelector('.stats').textContent")
        assert re.fullmatch(r"[\d.]+ tok/s · TTFT \d+ ms · acceptance \d+% · [\d.]+ tokens/round · "
                            r"\d+ rounds: .*draft \d+.*", stats), stats
        assert page.evaluate(f"{LAST_ANSWER}.querySelectorAll('.rounds i').length") > 1
        # Rejected proposals are there, hidden until asked for.
        visible = f"[...{LAST_ANSWER}.querySelectorAll('.rejected')].some(s => getComputedStyle(s).display !== 'none')"
        assert "rejected" in classes and not page.evaluate(visible)
        page.evaluate("document.getElementById('show-rejected').click()")
        assert page.evaluate(visible)
        page.screenshot(tmp_path / "chat-desktop.png")


def test_side_by_side_with_off_gives_the_same_greedy_text(browser, tmp_path):
    with serve() as (url, _):
        page = open_page(browser, url)
        assert ask(page, PROMPT, method="draft", compare=True) == "done"
        page.wait_for("document.querySelector('.comparison') !== null")
        titles = page.evaluate("[...document.querySelectorAll('.answer h3')].map(h => h.textContent)")
        assert titles == ["off", "draft"]
        texts = page.evaluate("[...document.querySelectorAll('.answer .text')].map(t => "
                              "[...t.querySelectorAll('span:not(.rejected)')].map(s => s.textContent).join(''))")
        assert texts[0] == texts[1] == greedy_text(url)
        assert page.evaluate("document.querySelector('.comparison').textContent").startswith("identical text")
        page.screenshot(tmp_path / "side-by-side.png")


def test_the_dashboard_shows_metrics_and_costs(browser, tmp_path):
    with serve() as (url, _):
        page = open_page(browser, url)
        page.evaluate("document.getElementById('tab-dashboard').click()")
        page.wait_for("document.getElementById('costs-summary').textContent.startsWith('t(1)')")
        page.wait_for("document.getElementById('now-slots').textContent === '0 / 4'")
        assert page.evaluate("document.getElementById('chat-view').hidden")
        assert page.evaluate("document.getElementById('now-queue').textContent") == "0"
        greedy_text(url)  # traffic after the first poll: the next polls see its tokens and drafts
        page.wait_for("Number(document.getElementById('now-tps').textContent) > 0")
        assert re.fullmatch(r"\d+%", page.evaluate("document.getElementById('now-acceptance').textContent"))
        page.screenshot(tmp_path / "dashboard.png")


def test_a_phone_screen_does_not_scroll_sideways(browser, tmp_path):
    with serve() as (url, _):
        page = open_page(browser, url, width=390, height=844, mobile=True)
        assert ask(page, PROMPT, compare=True) == "done"
        page.wait_for("document.querySelector('.comparison') !== null")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(tmp_path / "chat-phone.png")
        page.evaluate("document.getElementById('tab-dashboard').click()")
        page.wait_for("document.getElementById('costs-summary').textContent.startsWith('t(1)')")
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        page.screenshot(tmp_path / "dashboard-phone.png")


def test_with_a_key_required_the_page_is_refused_until_the_key_is_entered(browser, tmp_path):
    with serve(api_key=KEY) as (url, _):
        page = open_page(browser, url)
        assert "API key" in page.evaluate("document.getElementById('server-status').textContent")
        assert ask(page, PROMPT) == "error"
        assert "API key" in page.evaluate(f"{LAST_ANSWER}.querySelector('.stats').textContent")
        page.screenshot(tmp_path / "refused.png")
        page.evaluate(f"const key = document.getElementById('api-key'); key.value = {json.dumps(KEY)};"
                      "key.dispatchEvent(new Event('change'))")
        page.wait_for("document.getElementById('server-status').textContent === 'model: fake-target'")
        assert page.evaluate("sessionStorage.getItem('specdec.apiKey')") == KEY
        assert ask(page, PROMPT) == "done"
        text = "".join(t for cls, t in spans_of_last_answer(page) if cls != "rejected")
        assert text == greedy_text(url, {"Authorization": f"Bearer {KEY}"})
        page.screenshot(tmp_path / "with-key.png")
