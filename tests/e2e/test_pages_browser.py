"""The pages in a real browser: Debian's chromium, headless, driven through its
chromium-driver by Selenium (nothing here downloads a browser).

The server runs a tiny model that answers every chat with REPLY: markdown and an HTML
tag, which must show as text. Screenshots go to the test's folder, and to the folder in
$UI_SCREENSHOTS when set (docs/images, for the README).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="no chromium and chromedriver here: apt-get install chromium chromium-driver "
    "(.ci/run installs them)",
)

REPLY = "# Safe heading <script>"  # no token twice, nor the prompt's last (a bigram model)
WAIT = 60


@pytest.fixture(scope="module")
def reply_model(tmp_path_factory) -> Path:
    from mlx_cache_server.models.default_model import default_model_dir
    from tests.tiny_model import build_agent_model

    folder = tmp_path_factory.mktemp("pages")
    return build_agent_model(Path(default_model_dir()), folder / "model", reply=REPLY)


@pytest.fixture(scope="module")
def live(reply_model):
    from tests.live import serving

    with serving(str(reply_model), served_model_name="tiny") as server:
        yield server


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager: look nothing up
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(WAIT)
    yield driver
    driver.quit()


def wait_for(driver, css: str, count: int = 1):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, css)) >= count)
    return driver.find_elements(By.CSS_SELECTOR, css)


def send(driver, text: str, replies: int) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    wait_for(driver, "#model option")
    box = driver.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    wait_for(driver, "article.assistant .stats", replies)


def screenshot(driver, tmp_path: Path, name: str) -> None:
    driver.save_screenshot(str(tmp_path / name))
    if os.environ.get("UI_SCREENSHOTS"):
        folder = Path(os.environ["UI_SCREENSHOTS"])
        folder.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(folder / name))


def test_two_turns_show_the_cache_at_work_and_the_tree_shows_their_prefix(live, browser, tmp_path):
    from selenium.webdriver.common.by import By

    browser.get(live.url + "/")
    send(browser, "What does this server keep between turns?", 1)
    send(browser, "And how much of it was reused?", 2)
    stats = browser.find_elements(By.CSS_SELECTOR, "article.assistant .stats")
    cached = [int(s.get_attribute("data-cached")) for s in stats]
    assert cached[1] > 0, [s.text for s in stats]
    assert f"cached {cached[1]}" in stats[1].text and "first token" in stats[1].text
    screenshot(browser, tmp_path, "ui-chat.png")

    browser.get(live.url + "/ui/cache")
    wait_for(browser, f'li.branch[data-depth="{cached[1]}"]')
    assert "Safe heading" in browser.find_element(By.ID, "tree").text  # where the prefix ends
    rows = wait_for(browser, "#requests tbody tr", 2)
    assert rows[0].find_elements(By.TAG_NAME, "td")[3].text == str(cached[1])  # "cached"
    screenshot(browser, tmp_path, "ui-cache.png")


def test_a_reply_with_a_tag_and_markdown_renders_as_text(live, browser):
    from selenium.webdriver.common.by import By

    browser.get(live.url + "/")
    send(browser, "Say something.", 1)
    reply = browser.find_elements(By.CSS_SELECTOR, "article.assistant")[-1]
    assert reply.find_element(By.CSS_SELECTOR, "h3").text == "Safe heading <script>"
    assert "<script>" in reply.text
    assert (
        browser.execute_script("return document.querySelectorAll('#messages script').length") == 0
    )
    # A stored reply with more markdown and tags, drawn as every reply is.
    tag = "<img src=x onerror=\"document.title='x'\">"
    text = f"**bold** and `code`\n\n- one\n- two\n\n```html\n{tag}\n```\n{tag} <b>not bold</b>"
    browser.execute_script(
        "const all = JSON.parse(localStorage.getItem('mcs.conversations'));"
        "all[0].messages.push({role: 'assistant', content: arguments[0]});"
        "localStorage.setItem('mcs.conversations', JSON.stringify(all));", text)  # fmt: skip
    browser.refresh()
    last = wait_for(browser, "article.assistant", 2)[-1]
    assert last.find_element(By.CSS_SELECTOR, "strong").text == "bold"
    assert [li.text for li in last.find_elements(By.CSS_SELECTOR, "li")] == ["one", "two"]
    assert "<img" in last.find_element(By.CSS_SELECTOR, "pre code").text
    assert "<b>not bold</b>" in last.text
    assert not last.find_elements(By.CSS_SELECTOR, "img, b")
    assert browser.title != "x"


def test_with_api_keys_the_pages_ask_for_one_and_work_with_it(reply_model, browser):
    from selenium.webdriver.common.by import By

    from tests.live import serving

    with serving(str(reply_model), served_model_name="tiny", api_keys=["secret-key"],
                 admin_key="admin-key") as live:  # fmt: skip
        browser.get(live.url + "/")
        wait_for(browser, "#key-dialog[open]")
        browser.find_element(By.ID, "key-input").send_keys("secret-key")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        send(browser, "Hello?", 1)
        assert browser.execute_script("return sessionStorage.getItem('mcs.key')") == "secret-key"
        assert "secret-key" not in browser.current_url

        browser.get(live.url + "/ui/cache")  # the tenant's key is not the admin key
        wait_for(browser, "#key-dialog[open]")
        browser.find_element(By.ID, "key-input").send_keys("admin-key")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_for(browser, "li.branch")
        assert "tenant" in browser.find_element(By.ID, "tree").text
