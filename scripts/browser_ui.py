"""Drive ComfyUI's own web frontend in a real browser: Debian's Chromium through Playwright, which is told to
use that system browser (nothing downloads a browser build). Used by tests/test_browser.py and, as a script,
to refresh the screenshots in docs/screenshots/:

    .venv/bin/python scripts/browser_ui.py --screenshots docs/screenshots

(starts a headless CPU ComfyUI with only this pack, the tiny checkpoint and dataset; scripts/setup_browser.sh
installs chromium and playwright.)"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = sorted((REPO / "example_workflows").glob("*.json"))
TWIN = REPO / "workflows" / "api" / "train_then_generate.json"
TRAIN_ID = "5"  # the Train node's id in the templates and the API twin
PANEL_TEMPLATE = "leanlora_train_with_samples"  # the runs' panel: the template whose Train node has room for samples
TITLE_HEIGHT = 30


def chromium_path() -> str | None:
    """The system Chromium (Debian's `chromium` package), or LEANLORA_CHROMIUM."""
    for candidate in (os.environ.get("LEANLORA_CHROMIUM"), "/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if candidate and Path(candidate).is_file():
            return candidate
    return shutil.which("chromium")


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (bash scripts/setup_browser.sh)"
    if chromium_path() is None:
        return "no system chromium (bash scripts/setup_browser.sh: apt-get install chromium)"
    return None


# the frontends' dialogs: PrimeVue's (1.32.9), and 1.49.6's own (its template browser)
DIALOGS = ".p-dialog, [role=dialog]"


class Page:
    """One browser tab on a ComfyUI server, with the console kept."""

    def __init__(self, page, url: str):
        self.page, self.url, self.console = page, url, []
        self.load_errors, self.load_dialogs = [], []  # the last load_template's console errors and dialogs
        page.on("console", lambda message: self.console.append(f"{message.type}: {message.text}"))
        page.on("pageerror", lambda error: self.console.append(f"pageerror: {error}"))
        page.on("requestfailed", lambda request: self.console.append(f"requestfailed: {request.url}"))

    def open(self, timeout_s: float = 180) -> None:
        self.page.goto(self.url)
        self.page.wait_for_function("window.app && window.app.graph && window.LeanLoRA", timeout=timeout_s * 1000)
        self.page.wait_for_timeout(1000)
        # a fresh user gets the template browser on first start: closed, as a returning user has it
        self.evaluate("""async () => { try { await app.extensionManager.setting.set('Comfy.TutorialCompleted', true); }
                                       catch (error) { console.log('setting: ' + error); } }""")
        self.close_dialogs()

    def evaluate(self, script: str, arg=None):
        return self.page.evaluate(script, arg)

    def load_template(self, name: str) -> list[dict]:
        """Opens a shipped template as the template browser does (its JSON from the server) and returns every
        node's bounds on the canvas [x, y, width, height], title included, as the frontend sized it."""
        before = len(self.console)
        self.evaluate("""async name => {
            const response = await fetch(`/api/workflow_templates/LeanLoRA/${name}.json`);
            await app.loadGraphData(await response.json(), true, true, name, {openSource: "template"});
        }""", name)
        self.page.wait_for_timeout(1500)
        self.load_errors = [line for line in self.console[before:] if self.own_error(line)]
        self.load_dialogs = self.close_dialogs()
        return self.nodes()

    def nodes(self) -> list[dict]:
        return self.evaluate("""() => app.graph._nodes.map(n => ({
            id: n.id, type: n.type, title: n.title, bounds: [...n.boundingRect],
            registered: !!LiteGraph.registered_node_types[n.type], errors: !!n.has_errors}))""")

    def own_error(self, line: str) -> bool:
        """A console error of this server's page: not the frontend's calls to hosts this offline machine cannot
        reach (its registry lookups of a node's pack, api.comfy.org), which fail before any answer."""
        if line.startswith("requestfailed:"):
            return line.removeprefix("requestfailed: ").startswith(self.url)
        return line.startswith(("error:", "pageerror:")) and "net::ERR_NAME_NOT_RESOLVED" not in line

    def dialogs(self) -> list[str]:
        """The text of each dialog open over the canvas."""
        return self.evaluate(f"() => [...document.querySelectorAll({DIALOGS!r})].map(d => d.innerText)")

    def close_dialogs(self) -> list[str]:
        """Closes the dialogs over the canvas (e.g. the template browser a fresh user gets); returns their text."""
        seen = []
        for _ in range(3):
            texts = self.dialogs()
            if not texts:
                return seen
            closed = self.evaluate("""selector => { const buttons = [...document.querySelectorAll(selector)]
                .map(d => d.querySelector('button[aria-label="Close"], .p-dialog-close-button')
                          ?? d.querySelector('i.pi-times, [class*="lucide--x"]')?.closest('button')).filter(Boolean);
                buttons.forEach(b => b.click()); return buttons.length; }""", DIALOGS)
            if not closed:
                self.page.keyboard.press("Escape")
            seen += texts
            self.page.wait_for_timeout(400)
        return seen

    def view(self, x: float, y: float, scale: float = 1.0) -> None:
        """Canvas at `scale` with graph point (x, y) at the top left."""
        self.evaluate("""([x, y, scale]) => { const ds = app.canvas.ds; ds.scale = scale;
            ds.offset = [-x, -y]; app.canvas.setDirty(true, true); }""", [x, y, scale])
        self.page.wait_for_timeout(400)

    def queue(self, prompt: dict) -> str:
        """Queues an API prompt as this tab's client, so the pack's messages come to this tab."""
        return self.evaluate("""async prompt => {
            const response = await window.comfyAPI.api.api.queuePrompt(0, {output: prompt, workflow: {}});
            return response.prompt_id; }""", prompt)

    def interrupt(self) -> None:
        self.evaluate("() => window.comfyAPI.api.api.interrupt()")

    def panel(self, node_id: str = TRAIN_ID) -> dict:
        """The Train node's panel: its state (from the messages) and the text it shows."""
        return self.evaluate("""id => {
            const state = window.LeanLoRA.shownState(id);
            const node = app.graph.getNodeById(id) ?? app.graph.getNodeById(Number(id));
            const root = node?.leanloraPanel?.root;
            const text = cls => root?.querySelector(cls)?.textContent ?? null;
            const gallery = [...(root?.querySelectorAll('.ll-gallery figure') ?? [])].map(f => ({
                caption: f.querySelector('figcaption')?.textContent, title: f.querySelector('img')?.title,
                loaded: (f.querySelector('img')?.naturalWidth ?? 0) > 0}));
            const plan = root?.querySelector('.ll-plan');
            const stop = root?.querySelector('.ll-stop');
            return {state, phase: text('.ll-phase'), stats: text('.ll-stats'), final: text('.ll-final'),
                    plan: text('.ll-plan'), gallery, stop: stop && !stop.hidden ? stop.textContent : null,
                    // the plan line shown whole: no text cut at its right edge or below it
                    plan_cut: !!plan && (plan.scrollWidth > plan.clientWidth + 1 || plan.scrollHeight > plan.clientHeight + 1
                              || getComputedStyle(plan).textOverflow === 'ellipsis'),
                    plan_lines: plan ? Math.round(plan.clientHeight / parseFloat(getComputedStyle(plan).lineHeight)) : 0,
                    // parts of the panel that do not fit in it (cut at its bottom edge)
                    clipped: root ? [...root.querySelectorAll('div, canvas, img, figure')].filter(e => {
                        const r = e.getBoundingClientRect(), p = root.getBoundingClientRect();
                        return r.height > 0 && r.bottom > p.bottom - 5; }).map(e => e.className || e.tagName) : []}; }""", node_id)

    def wait_panel(self, predicate, timeout_s: float = 300, node_id: str = TRAIN_ID) -> dict:
        return self._wait(lambda: self.panel(node_id), predicate, timeout_s, "the panel never got there")

    def _wait(self, read, predicate, timeout_s: float, failure: str) -> dict:
        """read() every 100 ms until predicate(what it read) holds; TimeoutError with the last reading if not."""
        deadline = time.monotonic() + timeout_s
        while True:
            shown = read()
            if predicate(shown):
                return shown
            if time.monotonic() > deadline:
                raise TimeoutError(f"{failure}: {json.dumps(shown)[:2000]}")
            self.page.wait_for_timeout(100)

    def covered(self) -> list[tuple]:
        """Nodes whose area on screen (title included) is under another node's DOM part (the Train panel, the
        Dataset preview): the DOM is drawn above the canvas, so an overflowing panel hides its neighbours."""
        return self.evaluate("""() => {
            const rect = app.canvas.canvas.getBoundingClientRect(), found = [];
            const screen = n => { const [x, y, w, h] = n.boundingRect;
                const [left, top] = app.canvas.ds.convertOffsetToCanvas([x, y]);
                return {left: rect.left + left, top: rect.top + top,
                        right: rect.left + left + w * app.canvas.ds.scale, bottom: rect.top + top + h * app.canvas.ds.scale}; };
            for (const owner of app.graph._nodes) {
                for (const part of [owner.leanloraPanel?.root, owner.leanloraDataset?.root].filter(Boolean)) {
                    const p = part.getBoundingClientRect();
                    if (!p.width || !p.height) continue;
                    for (const other of app.graph._nodes) {
                        if (other === owner) continue;
                        const o = screen(other);
                        if (p.left < o.right && o.left < p.right && p.top < o.bottom && o.top < p.bottom)
                            found.push([owner.id, owner.title, other.id, other.title]);
                    }
                }
            }
            return found; }""")

    def stop_button(self, node_id: str = TRAIN_ID) -> None:
        """A real mouse click on the panel's Stop button."""
        self.page.locator(".leanlora-panel .ll-stop:not([hidden])").first.click()

    def chart_pixels(self, node_id: str = TRAIN_ID) -> int:
        """Pixels of the panel's chart in the smoothed loss line's blue: 0 when no line was drawn."""
        return self.evaluate("""id => { const c = app.graph.getNodeById(id).leanloraPanel.parts.chart;
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let lit = 0;
            for (let i = 0; i < d.length; i += 4) if (d[i + 2] > 200 && d[i] < 120) lit++; return lit; }""", node_id)

    def click_widget(self, node_id: int, name: str) -> None:
        """A real mouse click in the middle of a node's widget, as a user picks from a list."""
        x, y = self.evaluate("""([id, name]) => { const n = app.graph.getNodeById(id);
            const w = n.widgets.find(w => w.name === name);
            const [cx, cy] = app.canvas.ds.convertOffsetToCanvas([n.pos[0] + n.size[0] / 2, n.pos[1] + w.y + 10]);
            const rect = app.canvas.canvas.getBoundingClientRect();
            return [rect.left + cx, rect.top + cy]; }""", [node_id, name])
        self.page.mouse.click(x, y)
        self.page.wait_for_timeout(300)

    def pick_menu_entry(self, text: str) -> None:
        """Clicks the entry of the open list menu (litegraph's context menu) that reads `text`."""
        self.page.locator(".litecontextmenu .litemenu-entry", has_text=text).first.click()
        self.page.wait_for_timeout(300)

    def dataset_preview(self, node_id: int) -> dict:
        """What the Dataset node shows under its widgets: the counts line and the thumbnails."""
        return self.evaluate("""id => { const n = app.graph.getNodeById(id); const p = n.leanloraDataset;
            return {folder: p.folder.value, counts: p.parts.counts.textContent,
                    thumbnails: [...p.parts.thumbs.querySelectorAll('img')].map(i => ({
                        title: i.title, loaded: i.naturalWidth > 0})),
                    values: [...p.folder.options.values]}; }""", node_id)

    def wait_dataset(self, node_id: int, predicate, timeout_s: float = 60) -> dict:
        return self._wait(lambda: self.dataset_preview(node_id), predicate, timeout_s,
                          "the Dataset node never showed it")

    def screenshot(self, path: Path) -> None:
        self.close_dialogs()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), type="jpeg", quality=70)  # small enough to keep in the repo

    def unknown_messages(self) -> list[str]:
        return [line for line in self.console if "Unknown message type" in line]


@contextmanager
def browser_page(url: str, width: int = 1600, height: int = 1000):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = Page(browser.new_page(viewport={"width": width, "height": height}), url)
            page.open()
            yield page
        finally:
            browser.close()


def overlapping(nodes: list[dict]) -> list[tuple]:
    """Pairs of nodes whose bounds (title included) overlap."""
    found = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            ax, ay, aw, ah = a["bounds"]
            bx, by, bw, bh = b["bounds"]
            if ax < bx + bw and bx < ax + aw and ay < by + bh and by < ay + ah:
                found.append((a["id"], a["title"], b["id"], b["title"]))
    return found


# two tiny samples at steps 15 and 30: the panel's gallery by step and prompt
SAMPLES = dict(sample_prompts="lnlr, a red circle\nlnlr, a blue square", sample_every_n_steps=15, sample_size=64,
               sample_steps=2, sample_cfg=5.0, sample_seed=1)


def train_prompt(**train_inputs) -> dict:
    """The twin's training half (checkpoint -> Dataset / Memory / LoRA Config -> Train) with these Train inputs."""
    api = json.loads(TWIN.read_text())
    prompt = {key: api[key] for key in ("1", "2", "3", "4", TRAIN_ID)}
    prompt[TRAIN_ID]["inputs"].update(train_inputs)
    return prompt


def whole_graph(page: Page, scale: float = 0.6) -> None:
    """The canvas at `scale` with the graph's top left corner at the window's top left (below the menu)."""
    x, y = page.evaluate("""() => [Math.min(...app.graph._nodes.map(n => n.boundingRect[0])),
                                   Math.min(...app.graph._nodes.map(n => n.boundingRect[1]))]""")
    page.view(x - 20 / scale, y - 60 / scale, scale)


def reload(page: Page) -> None:
    """The browser's reload: the frontend restores the open workflow."""
    page.page.reload()
    page.page.wait_for_function("window.app && window.app.graph && window.LeanLoRA", timeout=180_000)
    page.page.wait_for_timeout(1000)
    page.close_dialogs()


def training_states(page: Page, out: Path | None, output_name: str = "browser_run") -> dict:
    """On the template's Train node: one run to its end, the same prompt again (served from ComfyUI's cache), the
    template opened afresh, then a run reloaded mid-way and stopped with the panel's Stop; screenshots of each."""
    shots = {}
    page.load_template(PANEL_TEMPLATE)
    page.view(-80, 390)
    prompt = train_prompt(steps=30, output_name=output_name, warmup_steps=0, **SAMPLES)
    page.queue(prompt)
    training = page.wait_panel(lambda p: p["state"]["step"] >= 12)
    if out:
        page.screenshot(out / "train_panel_training.jpg")
    # the final samples come after the saved message: wait for both, and for the images to load
    done = page.wait_panel(lambda p: bool(p["final"]) and len(p["gallery"]) == 4 and all(g["loaded"] for g in p["gallery"]))
    if out:
        page.screenshot(out / "train_panel_saved.jpg")
    shots["training"], shots["done"], shots["chart_pixels"] = training, done, page.chart_pixels()
    shots["overlapping_after"] = overlapping(page.nodes())  # the gallery grew the panel: still inside its room
    whole_graph(page)
    shots["covered_after"] = page.covered()
    # the same prompt again: ComfyUI serves Train from its cache and it does not run
    page.queue(prompt)
    shots["cached"] = page.wait_panel(lambda p: p["phase"] == page.evaluate("() => window.LeanLoRA.CACHED"), 60)
    # a template opened afresh is a new graph: no earlier run on it
    page.load_template(PANEL_TEMPLATE)
    page.page.wait_for_timeout(500)
    shots["fresh"] = page.panel()
    page.queue(train_prompt(steps=100000, output_name=f"{output_name}_cancel"))
    page.wait_panel(lambda p: p["state"]["step"] >= 3 and not p["final"])
    # a page reloaded mid-run shows the run again, and the panel's own Stop stops it (ComfyUI's interrupt)
    reload(page)
    whole_graph(page)
    shots["reloaded"] = page.wait_panel(lambda p: p["state"]["step"] >= 3 and p["stop"] == "Stop", 60)
    page.stop_button()
    shots["cancelled"] = page.wait_panel(lambda p: bool(p["final"]))
    if out:
        page.view(-80, 390)
        page.screenshot(out / "train_panel_stopped.jpg")
    return shots


DATASET_TEMPLATE = "leanlora_train_then_generate"


def dataset_states(page: Page, out: Path | None, typed_path: str, folder: str = "tiny_dataset") -> dict:
    """The template's Dataset node as a user meets it: its folder not there yet, then `folder` picked from the list
    with the mouse (counts and thumbnails), then `typed_path` given through 'type a folder path…'."""
    nodes = page.load_template(DATASET_TEMPLATE)
    [node] = [n for n in nodes if n["type"] == "LeanLoRADataset"]
    states = {"start": page.wait_dataset(node["id"], lambda p: "does not exist" in p["counts"])}
    x, y = node["bounds"][:2]
    page.view(x - 500, y - 250)  # the node mid-screen, clear of the menus at the edges
    page.click_widget(node["id"], "folder")
    page.pick_menu_entry(folder)
    states["picked"] = page.wait_dataset(node["id"], lambda p: p["folder"] == folder and " images" in p["counts"]
                                         and p["thumbnails"] and all(t["loaded"] for t in p["thumbnails"]))
    if out:
        page.screenshot(out / "dataset_preview.jpg")
    page.click_widget(node["id"], "folder")
    page.pick_menu_entry("type a folder path…")
    page.page.keyboard.type(typed_path)
    page.page.keyboard.press("Enter")
    states["typed"] = page.wait_dataset(node["id"], lambda p: p["folder"] == typed_path and " images" in p["counts"])
    states["overlapping"] = overlapping(page.nodes())
    return states


def upload_states(page: Page, files: list[Path], folder: str) -> dict:
    """The template's Dataset node's 'upload images' button: `files` picked in the browser's file chooser, put
    into input/<folder> through ComfyUI's /upload/image, then shown as the picked folder."""
    nodes = page.load_template(DATASET_TEMPLATE)
    [node] = [n for n in nodes if n["type"] == "LeanLoRADataset"]
    x, y = node["bounds"][:2]
    page.view(x - 500, y - 250)
    with page.page.expect_file_chooser() as chooser:
        page.click_widget(node["id"], "upload images")
    chooser.value.set_files([str(f) for f in files])
    page.page.locator(".graphdialog input").fill(folder)  # the folder name, asked by the node
    page.page.keyboard.press("Enter")
    return page.wait_dataset(node["id"], lambda p: p["folder"] == folder and " images" in p["counts"]
                             and p["thumbnails"] and all(t["loaded"] for t in p["thumbnails"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--screenshots", type=Path, default=REPO / "docs" / "screenshots")
    args = parser.parse_args(argv)
    if missing():
        print(missing(), file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO / "scripts"))
    import tiny_assets
    from comfy_headless import ComfyServer
    with tempfile.TemporaryDirectory(prefix="leanlora_browser_") as base:
        base = Path(base)
        tiny_assets.build_tiny_sd15_checkpoint(base / "models/checkpoints/leanlora_tiny_sd15.safetensors")
        tiny_assets.build_tiny_dataset(base / "input/tiny_dataset")
        with ComfyServer(base) as server, browser_page(server.url) as page:
            for template in TEMPLATES:
                nodes = page.load_template(template.stem)
                page.view(-360, -20, 0.8)
                page.screenshot(args.screenshots / f"template_{template.stem}.jpg")
                print(template.stem, "overlaps:", overlapping(nodes) or "none")
            dataset_states(page, args.screenshots, str(base / "input" / "tiny_dataset"))
            training_states(page, args.screenshots)
            print("unknown messages:", page.unknown_messages() or "none")
    print(f"screenshots in {args.screenshots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
