"""JupyterLab in a real browser: what a person sees when driving the notebooks.

Starts JupyterLab the way `make lab` does (.ci/lab: 127.0.0.1, a free port, a fresh
token) on a temporary folder holding three prepared notebooks, opens headless Chromium
(Debian's `chromium` and `chromium-driver`, through selenium) and, through the page:
runs notebook 06 on a small checkpoint, types a prompt, clicks Generate and reads
the story; runs notebook 06 with an out-of-range temperature and reads its one error
line; runs notebook 01 with small parameters and checks that no error is shown, the
progress line reached its end and the loss figure was redrawn in place while it trained.
Screenshots (this run's only) go to runs/browser/. Skips, saying why, where there is
no browser, unless $SONATA_REQUIRE_BROWSER is set (.ci/run sets it): then it fails.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not (CHROMIUM and DRIVER) and os.environ.get("SONATA_REQUIRE_BROWSER"):
    pytest.fail("SONATA_REQUIRE_BROWSER is set (.ci/run sets it) but chromium or chromedriver is not on PATH",
                pytrace=False)
if not (CHROMIUM and DRIVER):
    pytest.skip("no Chromium and chromium-driver here (apt-get install chromium chromium-driver; "
                ".ci/run installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the test extra has it)")
papermill = pytest.importorskip("papermill")
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SHOTS = REPO / "runs" / "browser"
TRAIN_01 = dict(d_model=32, n_layers=1, d_state=4, vocab_size=300, seq_len=64, max_steps=60, micro_batch=8,
                effective_batch=8, eval_every=20, max_stories=60, n_samples=1, sample_tokens=20, warmup_steps=5)


def lab_url_line(proc) -> str:
    """The line .ci/lab prints once the server answers (the server's own log comes first)."""
    for line in proc.stdout:
        if line.startswith("JupyterLab: "):
            return line
    raise AssertionError(".ci/lab ended without printing its URL")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    env = {k: v for k, v in os.environ.items() if k != "SONATA_PROGRESS"}   # the kernel decides: live display
    # JupyterLab configuration of this test only, outside the served folder: no user
    # settings or saved workspace, every cell attached to the page (no windowing)
    config = tmp_path_factory.mktemp("lab-config")
    settings = config / "settings" / "@jupyterlab"
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    (settings / "apputils-extension").mkdir()
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false"}))
    env.update(JUPYTERLAB_SETTINGS_DIR=str(config / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(config / "workspaces"),
               JUPYTER_CONFIG_DIR=str(config / "jupyter"))
    # a small checkpoint for notebook 06
    subprocess.run([sys.executable, "-m", "sonata", "train", "--out", str(root / "small"), "--progress", "none",
                    "model.d_model=32", "model.n_layers=1", "model.d_state=4", "data.seq_len=32",
                    "data.max_stories=60", "train.max_steps=30", "train.eval_every=0"],
                   check=True, env=env, cwd=REPO, capture_output=True, timeout=300)
    papermill.execute_notebook(str(REPO / "notebooks/06_generate.ipynb"), str(root / "06_generate.ipynb"),
                               parameters=dict(checkpoint=str(root / "small/checkpoint.pt"), max_new_tokens=60),
                               prepare_only=True, progress_bar=False)
    papermill.execute_notebook(str(REPO / "notebooks/01_train_tinystories.ipynb"),
                               str(root / "01_train_tinystories.ipynb"),
                               parameters=dict(TRAIN_01, out_dir=str(root / "run01")),
                               prepare_only=True, progress_bar=False)
    papermill.execute_notebook(str(REPO / "notebooks/06_generate.ipynb"), str(root / "06_out_of_range.ipynb"),
                               parameters=dict(checkpoint=str(root / "small/checkpoint.pt"), temperature=6.0),
                               prepare_only=True, progress_bar=False)
    for name in ("06_generate.ipynb", "01_train_tinystories.ipynb", "06_out_of_range.ipynb"):   # no outputs yet
        nb = json.loads((root / name).read_text())
        for c in nb["cells"]:
            if c["cell_type"] == "code":
                c["outputs"], c["execution_count"] = [], None
        (root / name).write_text(json.dumps(nb, indent=1))
    proc = subprocess.Popen([str(REPO / ".ci/lab"), sys.executable, str(root)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        first = lab_url_line(proc)
        m = re.match(r"JupyterLab: (http://127\.0\.0\.1:(\d+))/lab\?token=(\w+)", first)
        assert m, f"unexpected URL line from .ci/lab: {first!r}"
        base, token = m.group(1), m.group(3)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("JupyterLab did not start: " + "".join(proc.stdout.readlines()[-5:])
                                         if proc.poll() is not None else "JupyterLab did not answer in 120 s")
                time.sleep(0.5)
        yield base, token, root
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1100"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):           # only this run's screenshots stay
        old.unlink()
    yield driver
    driver.quit()


def _css(driver, selector):
    """Elements of the notebook shown now (other notebooks stay in the page, hidden)."""
    panels = [p for p in driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel") if p.is_displayed()]
    return [e for p in panels for e in p.find_elements(By.CSS_SELECTOR, selector)]


def _kernel_connected(base, token, name):
    """The notebook's kernel, asked through the server's REST API: idle, with the page's
    websocket attached (before that, Run All clears the cells and runs nothing)."""
    with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
        sessions = json.loads(r.read())
    k = next((s["kernel"] for s in sessions if s["path"] == name or s["path"].endswith("/" + name)), None)
    return k is not None and k["execution_state"] == "idle" and k.get("connections", 0) >= 1


def _status_bar(driver):
    return driver.execute_script("const e = document.getElementById('jp-main-statusbar'); "
                                 "return e ? e.innerText : '';")


def _prompts(driver):
    return [e.text for e in _css(driver, ".jp-Notebook .jp-CodeCell .jp-InputPrompt")]


def _run_all(driver):
    menu = next(e for e in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item") if e.text.strip() == "Run")
    menu.click()
    item = WebDriverWait(driver, 30, poll_frequency=0.25).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, '.lm-Menu-item[data-command="runmenu:run-all"]'))[0]
    item.click()


def _open_and_run_all(driver, base, token, root, name, timeout=240, while_running=None, finished=None):
    """Open `name`, wait for its kernel, Run All from the menu and wait until `finished`
    (default: every code cell has an execution count and the kernel is idle again)."""
    driver.get(f"{base}/lab/tree/{name}?token={token}")
    n_code = sum(c["cell_type"] == "code" for c in json.loads((root / name).read_text())["cells"])
    try:
        WebDriverWait(driver, 120, poll_frequency=0.5, ignored_exceptions=(StaleElementReferenceException,)).until(
            lambda d: len(_css(d, ".jp-Notebook .jp-CodeCell")) == n_code and _kernel_connected(base, token, name)
            and re.search(r"\| Idle\b", _status_bar(d)))
    except TimeoutException:
        driver.save_screenshot(str(SHOTS / f"{name}.open-timeout.png"))
        raise AssertionError(f"{name}: the notebook did not show its {n_code} code cells with a connected, idle "
                             f"kernel within 120 s (status bar: {_status_bar(driver)!r}); "
                             f"screenshot in {SHOTS}") from None
    for attempt in range(3):          # a click the page was not ready for runs nothing: try again
        _run_all(driver)
        try:
            WebDriverWait(driver, 30, poll_frequency=0.25, ignored_exceptions=(StaleElementReferenceException,)).until(
                lambda d: any(re.fullmatch(r"\[(\*|\d+)\]:", p) for p in _prompts(d)))
            break
        except TimeoutException:
            driver.save_screenshot(str(SHOTS / f"{name}.run-all-{attempt + 1}-ignored.png"))
    else:
        raise AssertionError(f"{name}: Run All started no cell in 3 tries; screenshots in {SHOTS}")

    def done(d):
        if while_running:
            while_running(d)
        if finished:
            return finished(d)
        prompts = _prompts(d)
        return len(prompts) == n_code and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts) and \
            _kernel_connected(base, token, name)
    try:
        WebDriverWait(driver, timeout, poll_frequency=0.3,
                      ignored_exceptions=(StaleElementReferenceException,)).until(done)
    except TimeoutException:
        driver.save_screenshot(str(SHOTS / f"{name}.timeout.png"))
        raise AssertionError(f"{name}: not every cell ran within {timeout} s; errors on the page: "
                             f"{_errors(driver)}; screenshot in {SHOTS}") from None


def _errors(driver):
    return [e.text[:300] for e in _css(driver, '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
            if "Traceback" in e.text or "Error" in e.text or "error:" in e.text]


@pytest.fixture
def shot_on_failure(browser, request):
    """A screenshot of the page when the test fails, beside the others."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        browser.save_screenshot(str(SHOTS / f"{request.node.name}.failed.png"))


def _cell(driver, text):
    """The code cell of the shown notebook whose text (source and outputs) holds `text`."""
    return next(c for c in _css(driver, ".jp-Notebook .jp-CodeCell") if text in c.text)


def test_notebook_06_panel_generates_a_story(lab, browser, shot_on_failure):
    base, token, root = lab
    _open_and_run_all(browser, base, token, root, "06_generate.ipynb")
    assert not _errors(browser)
    model_cell = _cell(browser, "load_or_train(")
    assert f"loaded {root / 'small/checkpoint.pt'}" in model_cell.text, model_cell.text
    assert re.search(r"1 layers, d_model 32, d_state 4, vocabulary \d+, [\d,]+ parameters", model_cell.text)
    wait = WebDriverWait(browser, 90, poll_frequency=0.2, ignored_exceptions=(StaleElementReferenceException,))
    box = wait.until(lambda d: _css(d, ".widget-textarea textarea"))[0]
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)
    assert box.get_attribute("value") == "Once upon a time"          # the notebook's default prompt
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    box.send_keys("The little dog")
    button = next(e for e in _css(browser, "button.jupyter-button") if e.text.strip() == "Generate")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", button)
    time.sleep(1.0)              # the text box sends its value to the kernel on change
    button.click()
    wait.until(lambda d: _css(d, ".sonata-status") and _css(d, ".sonata-status")[0].text.startswith("done:"))
    story = _css(browser, ".sonata-story")[0].text
    browser.save_screenshot(str(SHOTS / "06_generate.png"))
    assert story.startswith("The little dog") and len(story) > len("The little dog") + 10, story
    assert re.fullmatch(r"done: \d+ pieces, seed 0", _css(browser, ".sonata-status")[0].text)
    assert not _errors(browser)


def test_notebook_06_out_of_range_shows_one_error_line(lab, browser, shot_on_failure):
    base, token, root = lab
    line = "error: parameter temperature = 6.0 is out of range; allowed: range 0..5"

    def stopped(d):
        return any(e.text.strip() == line for e in _css(d, ".jp-OutputArea-output")) and \
            _kernel_connected(base, token, "06_out_of_range.ipynb")
    _open_and_run_all(browser, base, token, root, "06_out_of_range.ipynb", timeout=120, finished=stopped)
    check_cell = _cell(browser, 'check("06_generate", globals())')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", check_cell)
    time.sleep(0.5)
    browser.save_screenshot(str(SHOTS / "06_out_of_range.png"))
    outputs = [e.text.strip() for e in _css(browser, ".jp-OutputArea-output") if e.text.strip()]
    assert outputs == [line]                    # that line alone: no traceback, nothing else ran
    prompts = _prompts(browser)
    cells = _css(browser, ".jp-Notebook .jp-CodeCell")
    i = cells.index(check_cell)
    assert all(re.fullmatch(r"\[\d+\]:", p) for p in prompts[:i + 1]), prompts
    assert all(p == "[ ]:" for p in prompts[i + 1:]), prompts       # Run All stopped at the check


def test_notebook_01_trains_live_without_errors(lab, browser, shot_on_failure):
    base, token, root = lab
    seen = set()

    def watch(d):          # the figure's image, sampled while the cells run
        for img in _css(d, ".jp-OutputArea-output img"):
            src = img.get_attribute("src") or ""
            if src and src not in seen:
                seen.add(src)
                if len(seen) == 2:          # redrawn once: show it mid-run
                    cell = next((c for c in _css(d, ".jp-Notebook .jp-CodeCell") if "LiveLossCurve" in c.text), None)
                    if cell is not None:
                        d.execute_script("arguments[0].scrollIntoView({block: 'start'});", cell)
                    d.save_screenshot(str(SHOTS / "01_train_live.png"))

    _open_and_run_all(browser, base, token, root, "01_train_tinystories.ipynb", while_running=watch)
    train_cell = _cell(browser, "LiveLossCurve")
    browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", train_cell)
    time.sleep(0.5)
    browser.save_screenshot(str(SHOTS / "01_train.png"))
    assert not _errors(browser)
    steps = TRAIN_01["max_steps"]
    # the progress line as plain text (not a quoted repr), at its end
    assert re.search(rf"(?m)^train: {steps}/{steps} \(100%\) ", train_cell.text), train_cell.text[:500]
    assert re.search(rf"(?m)^trained {steps} steps, ", train_cell.text), train_cell.text[:800]
    imgs = train_cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img")
    assert len(imgs) == 1                                                   # redrawn in place
    # the final draw (at the end of training) counts even when the run ended between two samples:
    # a training shorter than the curve's 3 s cadence draws twice, first row and end
    seen.add(imgs[0].get_attribute("src") or "")
    assert len(seen) >= 2, "the loss figure was not redrawn while training"
    summary = json.loads((root / "run01" / "summary.json").read_text())
    assert summary["steps"] == steps
    assert f"validation bits per byte: {summary['val_bpb']:.4f}" in _cell(browser, "validation bits per byte").text
