"""The chat page takes an image (the file button here; paste and drop read files the same
way), shows it in the conversation, and sends it: the second turn's prompt is served from
the cache past the image. Chromium, headless, as in test_pages_browser."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tests.e2e.test_pages_browser import (  # noqa: F401
    WAIT,
    browser,
    pytestmark,  # noqa: F401  (skipped without chromium)
    screenshot,
    wait_for,
)
from tests.e2e.test_vision import BEFORE_IMAGE
from tests.live import serving
from tests.vision_models import build_gemma3_vision


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    folder = str(build_gemma3_vision(tmp_path_factory.mktemp("gemma3_page")))
    with serving(folder, served_model_name="tiny-vision") as server:
        yield server


def test_an_attached_image_is_shown_sent_and_reused(live, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    picture = tmp_path / "picture.png"
    Image.fromarray((np.random.RandomState(5).rand(60, 80, 3) * 255).astype("uint8")).save(picture)
    browser.get(live.url + "/")
    wait_for(browser, "#model option")
    browser.execute_script('document.getElementById("max-tokens").value = "16"')  # short replies
    browser.find_element(By.ID, "image-file").send_keys(str(picture))
    wait_for(browser, "#attachments img.thumb")
    encoded = live.engine.vision.features.encoded
    box = browser.find_element(By.ID, "input")
    for turn, text in enumerate(["What is in this picture?", "And its colours?"], start=1):
        box.send_keys(text)
        box.send_keys(Keys.ENTER)
        wait_for(browser, "article.assistant .stats", turn)
    assert browser.find_elements(By.CSS_SELECTOR, "article.user img.thumb")
    assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img")  # sent, not kept
    assert live.engine.vision.features.encoded == encoded + 1
    stats = browser.find_elements(By.CSS_SELECTOR, "article.assistant .stats")
    assert int(stats[1].get_attribute("data-cached")) > BEFORE_IMAGE + 4, stats[1].text
    screenshot(browser, tmp_path, "ui-chat-image.png")
