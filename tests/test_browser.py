"""The UI as a user meets it (issue 33 item 7): ComfyUI 0.3.75's own web frontend (comfyui-frontend-package
1.32.9) in Debian's Chromium, driven by Playwright (scripts/browser_ui.py; scripts/setup_browser.sh installs
both, no browser download), against the session's real server with the tiny checkpoint. Screenshots of each
state go to docs/screenshots/ when LEANLORA_SCREENSHOTS names that folder (scripts/browser_ui.py refreshes them)."""
import os
import re
from pathlib import Path

import pytest
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
    memory = page.evaluate("""() => { const n = app.graph._nodes.find(n => n.type === 'LeanLoRAMemorySettings');
        return {card: n.widgets[0].value, shown: n.widgets.filter(w => n.isWidgetVisible(w)).map(w => w.name)}; }""")
    assert memory == {"card": "auto (this GPU)", "shown": ["card", "batch_size", "gradient_accumulation", "latent_cache"]}


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


def test_the_train_panel_shows_phases_progress_the_saved_file_and_a_stop(page, comfy_server):
    """One page, the template's Train node: the phase before step 1, step/loss/pace with a chart, samples by step
    and prompt, "Saved to models/loras/<file>" at the end; then a run stopped with Cancel: "stopped; partial saved
    ...; set resume"; after a page reload the panel shows that last state again."""
    states = browser_ui.training_states(page, SCREENSHOTS, output_name="browser_panel")
    training, done, cancelled = states["training"], states["done"], states["cancelled"]
    assert "caching latents and text embeddings" in training["state"]["phases"]  # before step 1
    assert any(p.startswith("measuring memory") for p in training["state"]["phases"])
    assert re.search(r"step \d+/30 · loss \d\.\d{4} \(smoothed \d\.\d{4}\)", training["stats"]), training["stats"]
    assert "s/step" in training["stats"] and "left" in training["stats"]
    assert len(done["state"]["losses"]) == 30 and done["phase"] == "finished"
    saved = done["final"]
    assert re.fullmatch(r"Saved to models/loras/browser_panel(_\d+)?\.safetensors", saved), saved
    assert (comfy_server.base_dir / saved.removeprefix("Saved to ")).is_file()
    final = cancelled["final"]
    assert re.fullmatch(r"stopped; partial saved to models/loras/browser_panel_cancel(_\d+)?_partial_step\d+"
                        r"\.safetensors; set resume to continue", final), final
    assert (comfy_server.base_dir / final.split(" to ", 1)[1].split(";")[0]).is_file()
    assert states["chart_pixels"] > 50, "the loss chart drew no line"  # blue pixels of the smoothed loss
    # samples by step and prompt, newest first, each image served by ComfyUI's /view
    assert [g["caption"] for g in done["gallery"]] == ["step 30 · lnlr, a red circle", "step 30 · lnlr, a blue square",
                                                       "step 15 · lnlr, a red circle", "step 15 · lnlr, a blue square"]
    assert not states["overlapping_after"], states["overlapping_after"]
    assert states["reloaded"]["final"] == final and states["reloaded"]["state"]["step"] == cancelled["state"]["step"]
    assert not page.unknown_messages(), page.unknown_messages()


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
