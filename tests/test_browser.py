"""The UI as a user meets it (issue 33 item 7): ComfyUI 0.3.75's own web frontend (comfyui-frontend-package
1.32.9) in Debian's Chromium, driven by Playwright (scripts/browser_ui.py; scripts/setup_browser.sh installs
both, no browser download), against the session's real server with the tiny checkpoint. Screenshots of each
state go to docs/screenshots/ when LEANLORA_SCREENSHOTS names that folder (scripts/browser_ui.py refreshes them)."""
import os
import re
from pathlib import Path

import pytest
import requests
from PIL import Image

import browser_ui

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(browser_ui.missing() is not None, reason=str(browser_ui.missing()))]
SCREENSHOTS = Path(os.environ["LEANLORA_SCREENSHOTS"]) if os.environ.get("LEANLORA_SCREENSHOTS") else None


@pytest.fixture(scope="module")
def page(comfy_server, tiny_assets):
    with browser_ui.browser_page(comfy_server.url) as page:
        yield page


@pytest.mark.parametrize("template", [t.stem for t in browser_ui.TEMPLATES])
def test_each_template_opens_clean(page, template):
    """No overlapping nodes at the sizes the frontend gives them (widgets, the Train panel), no missing node, and
    Memory Settings shows its simple widgets with the card on auto."""
    nodes = page.load_template(template)
    assert all(node["registered"] and not node["errors"] for node in nodes), nodes
    assert not browser_ui.overlapping(nodes)
    # as the template browser opens it: no dialog (e.g. "Missing Models"), no console error (e.g. the Dataset
    # preview of the folder the user has not made yet), at a zoom where the nodes are readable
    assert not page.load_dialogs and not page.load_errors, (page.load_dialogs, page.load_errors)
    assert page.evaluate("() => app.canvas.ds.scale") >= 0.6
    memory = page.evaluate("""() => { const n = app.graph._nodes.find(n => n.type === 'LeanLoRAMemorySettings');
        return {card: n.widgets[0].value, shown: n.widgets.filter(w => n.isWidgetVisible(w)).map(w => w.name)}; }""")
    assert memory == {"card": "auto (this GPU)",
                      "shown": ["card", "batch_size", "gradient_accumulation", "latent_cache", "ram"]}


def test_an_old_memory_settings_node_loads_as_manual_with_its_values(page):
    """A workflow saved before `card` existed stores mixed_precision first: it opens as manual, every value in its
    own widget, its auto_fit kept."""
    page.load_template("leanlora_train_then_generate")
    widgets = page.evaluate("""() => {
        const old = ['fp16', true, 2, 3, 'AdamW8bit', 'fp8', '6 GiB', 'RAM + disk', 'auto'];
        const n = LiteGraph.createNode('LeanLoRAMemorySettings');
        n.configure({id: 999, type: n.type, pos: [0, 0], size: [320, 400], flags: {}, order: 0, mode: 0,
                     inputs: [], outputs: [], properties: {}, widgets_values: old});
        return Object.fromEntries(n.widgets.map(w => [w.name, w.value])); }""")
    assert widgets["card"] == "manual" and widgets["mixed_precision"] == "fp16" and widgets["auto_fit"] == "6 GiB"
    assert (widgets["batch_size"], widgets["gradient_accumulation"], widgets["base_weights"]) == (2, 3, "fp8")


@pytest.fixture(scope="module")
def panel(page, comfy_server):
    """The runs on one page (browser_ui.training_states): finished, cached, a fresh template, stopped."""
    return browser_ui.training_states(page, SCREENSHOTS, output_name="browser_panel")


def test_the_train_panel_shows_phases_progress_the_saved_file_and_samples(panel, comfy_server):
    """The template's Train node: the phase before step 1, step/loss/pace with a chart, samples by step and
    prompt, "Saved to models/loras/<file>" at the end, "VRAM: no GPU" on this CPU server."""
    training, done = panel["training"], panel["done"]
    assert "caching latents and text embeddings" in training["state"]["phases"]  # before step 1
    assert any(p.startswith("measuring memory") for p in training["state"]["phases"])
    assert re.search(r"step \d+/30 · loss \d\.\d{4} \(smoothed \d\.\d{4}\)", training["stats"]), training["stats"]
    assert "s/step" in training["stats"] and "left" in training["stats"]
    assert "VRAM: no GPU" in training["stats"], training["stats"]
    assert len(done["state"]["losses"]) == 30 and done["phase"] == "finished" and done["stop"] is None
    saved = done["final"]
    assert re.fullmatch(r"Saved to models/loras/browser_panel(_\d+)?\.safetensors", saved), saved
    assert (comfy_server.base_dir / saved.removeprefix("Saved to ")).is_file()
    assert panel["chart_pixels"] > 50, "the loss chart drew no line"  # blue pixels of the smoothed loss
    # samples by step and prompt, newest first, each image served by ComfyUI's /view
    assert [g["caption"] for g in done["gallery"]] == ["step 30 · lnlr, a red circle", "step 30 · lnlr, a blue square",
                                                       "step 15 · lnlr, a red circle", "step 15 · lnlr, a blue square"]


def test_the_plan_line_wraps_instead_of_being_cut(panel):
    """The plan wraps; with it, the saved file and the samples, every part of the panel fits in it."""
    done = panel["done"]
    assert done["plan"].startswith("memory estimate") and len(done["plan"]) > 120, done["plan"]
    assert not done["plan_cut"] and done["plan_lines"] >= 2, done
    assert not done["clipped"], done["clipped"]


def test_samples_grow_no_node_over_another(panel):
    """The gallery takes its room inside the panel: no node's box overlaps another, and no node (the "Loss curve"
    below Train) is under the panel's DOM."""
    assert not panel["overlapping_after"], panel["overlapping_after"]
    assert not panel["covered_after"], panel["covered_after"]


def test_a_cached_rerun_says_comfyui_reused_its_result(panel):
    """The same prompt again: ComfyUI serves Train from its cache (it does not run); the panel says so and keeps
    the last run's chart and file."""
    cached, done = panel["cached"], panel["done"]
    assert cached["phase"] == "nothing changed since the last run: ComfyUI reused its result"
    assert cached["final"] == done["final"] and len(cached["state"]["losses"]) == 30 and cached["stop"] is None
    assert cached["state"]["run"] != done["state"]["run"]  # a run of its own, keyed by its prompt


def test_a_fresh_template_shows_no_earlier_run(panel):
    """The panel's state belongs to a run (prompt), not to the node id that every SD template's Train shares."""
    fresh = panel["fresh"]
    assert fresh["state"]["run"] is None and fresh["final"] == "" and not fresh["state"]["losses"], fresh
    assert fresh["phase"].startswith("idle") and fresh["gallery"] == []


def test_the_panels_stop_works_after_a_reload(panel, comfy_server, page):
    """A page reloaded mid-run shows the run again (its graph restored), and the panel's own Stop button (POST
    /interrupt for its prompt) stops it: "stopped; partial saved ...; set resume"."""
    reloaded, cancelled = panel["reloaded"], panel["cancelled"]
    assert reloaded["state"]["step"] >= 3 and reloaded["stop"] == "Stop"
    final = cancelled["final"]
    assert re.fullmatch(r"stopped; partial saved to models/loras/browser_panel_cancel(_\d+)?_partial_step\d+"
                        r"\.safetensors; set resume to continue", final), final
    assert (comfy_server.base_dir / final.split(" to ", 1)[1].split(";")[0]).is_file()
    assert cancelled["stop"] is None and cancelled["state"]["run"] == reloaded["state"]["run"]
    assert not page.unknown_messages(), page.unknown_messages()
    # Cancel is no error: the prompt ends as ComfyUI's interrupt where nodes were left to run (0.33 lists the job as
    # cancelled; both frontends' end-of-queue banner still counts a cancelled job with the failed ones), and as a
    # success where Train was the last node (as here)
    prompt_id = cancelled["state"]["run"].split(":")[0]
    history = page._wait(lambda: requests.get(f"{comfy_server.url}/api/history/{prompt_id}", timeout=30).json(),
                         lambda h: prompt_id in h, 60, "the stopped prompt never reached the history")
    events = [name for name, _ in history[prompt_id]["status"]["messages"]]
    assert "execution_error" not in events and {"execution_interrupted", "execution_success"} & set(events), events


def test_the_train_node_fits_a_1440x900_window_at_100_percent(page):
    """Title, widgets and panel of each template's Train node on one screen at 100%, below the menu bar."""
    page.page.set_viewport_size({"width": 1440, "height": 900})
    try:
        for template in (t.stem for t in browser_ui.TEMPLATES):
            nodes = page.load_template(template)
            [train] = [n for n in nodes if n["type"] == "LeanLoRATrain"]
            x, y, width, height = train["bounds"]
            page.view(x - 40, y - 100)  # under the menus and tabs (1.32.9: a banner, tabs; 1.49.6: tabs)
            shown = page.evaluate("""id => { const n = app.graph.getNodeById(id);
                const r = n.leanloraPanel.root.getBoundingClientRect();
                const hit = document.elementFromPoint(r.left + r.width / 2, r.top + 8);
                return {top: r.top, bottom: r.bottom, height: r.height, inner: window.innerHeight,
                        onTop: !!hit?.closest('.leanlora-panel')}; }""", train["id"])
            assert height + 100 <= 900 and shown["bottom"] <= shown["inner"] and shown["onTop"], (template, height, shown)
    finally:
        page.page.set_viewport_size({"width": 1600, "height": 1000})


def test_memory_settings_says_which_widgets_the_card_sets(page):
    """With a card set (auto or a size), auto_fit is not read: Show Advanced shows it as set by the card; manual
    gives it back."""
    page.load_template("leanlora_train_then_generate")
    read = """value => { const n = app.graph._nodes.find(n => n.type === 'LeanLoRAMemorySettings');
        const card = n.widgets.find(w => w.name === 'card'), fit = n.widgets.find(w => w.name === 'auto_fit');
        if (value) { card.value = value; card.callback?.(value); }
        return {label: fit.label ?? null, disabled: !!fit.disabled}; }"""
    assert page.evaluate(read) == {"label": "auto_fit: set by card (auto (this GPU))", "disabled": True}
    assert page.evaluate(read, "8 GiB") == {"label": "auto_fit: set by card (8 GiB)", "disabled": True}
    assert page.evaluate(read, "manual") == {"label": None, "disabled": False}


def test_a_missing_dataset_folder_stops_the_whole_prompt_with_the_error_dialog(page, comfy_server):
    """The template with a checkpoint picked and its folder not there: Run (the frontend's queue) is refused whole,
    with ComfyUI's error naming the folder, before anything loads: the "base, no LoRA" branch does not run."""
    page.load_template("leanlora_train_then_generate")
    history = len(requests.get(f"{comfy_server.url}/api/history", timeout=30).json())
    page.evaluate("""() => { const n = app.graph._nodes.find(n => n.type === 'CheckpointLoaderSimple');
        n.widgets[0].value = 'leanlora_tiny_sd15.safetensors'; }""")
    page.evaluate("() => app.queuePrompt(0, 1)")
    # ComfyUI's error: 1.32.9's dialog "Prompt outputs failed validation" naming the folder, 1.49.6's "Invalid
    # input" overlay naming the Dataset node's folder
    page._wait(lambda: page.evaluate("() => document.body.innerText"),
               lambda text: ("Prompt outputs failed validation" in text and "folder 'my_dataset' does not exist" in text)
               or "LeanLoRA Dataset (your image folder) rejected the value for folder" in text, 30, "no error shown")
    queue = requests.get(f"{comfy_server.url}/api/queue", timeout=30).json()
    assert not queue["queue_running"] and not queue["queue_pending"], queue
    assert len(requests.get(f"{comfy_server.url}/api/history", timeout=30).json()) == history
    page.close_dialogs()


def test_picking_a_dataset_folder_shows_its_counts_and_thumbnails_before_queue(page, comfy_server, tiny_assets):
    """The template's Dataset node names a folder the user does not have yet: the node says so. Picked from the
    list with the mouse, a folder of input/ shows its image and caption counts and thumbnails; 'type a folder
    path' takes an absolute path. The node grew: still no overlap."""
    states = browser_ui.dataset_states(page, SCREENSHOTS, str(tiny_assets["dataset"]))
    start, picked, typed = states["start"], states["picked"], states["typed"]
    assert start["counts"].startswith("folder 'my_dataset' does not exist"), start
    assert "tiny_dataset" in start["values"] and start["values"][-1] == "type a folder path…"
    assert picked["counts"] == "6 images · 6 captions" and len(picked["thumbnails"]) == 6, picked
    assert [t["title"] for t in picked["thumbnails"]] == [f"img_{i:03d}.png" for i in range(6)]
    assert typed["counts"] == "6 images · 6 captions" and len(typed["thumbnails"]) == 6, typed
    assert not states["overlapping"], states["overlapping"]
    # a folder added later shows up in the list with R (ComfyUI's refresh), the typed-path entry still last
    added = comfy_server.base_dir / "input" / "added_later"
    added.mkdir(exist_ok=True)
    Image.new("RGB", (64, 64), "teal").save(added / "one.png")
    values = page.evaluate("""async () => { await app.refreshComboInNodes();
        const n = app.graph._nodes.find(n => n.type === 'LeanLoRADataset');
        return [...n.widgets.find(w => w.name === 'folder').options.values]; }""")
    assert "added_later" in values and values[-1] == "type a folder path…", values


def test_images_uploaded_from_the_dataset_node_land_in_a_new_input_folder(page, comfy_server, tiny_assets):
    """'upload images' on the node: three images and their captions, picked in the browser's file chooser, go
    into input/uploaded_set through ComfyUI's own upload route; the node then shows that folder and its counts."""
    files = sorted(tiny_assets["dataset"].glob("img_00[0-2].*"))
    shown = browser_ui.upload_states(page, files, "uploaded_set")
    assert shown["counts"] == "3 images · 3 captions" and len(shown["thumbnails"]) == 3, shown
    uploaded = comfy_server.base_dir / "input" / "uploaded_set"
    assert sorted(p.name for p in uploaded.iterdir()) == sorted(f.name for f in files)
    assert all((uploaded / f.name).read_bytes() == f.read_bytes() for f in files)
    assert "uploaded_set" in shown["values"]
