"""Convert a ComfyUI UI-format workflow (what the frontend saves) into the API prompt format (what POST /prompt
takes), the way the frontend's graphToPrompt does, using a server's /object_info for input names and order.

    python scripts/workflow_convert.py UI.json --object-info http://127.0.0.1:8188   # or a saved object_info.json
    python scripts/workflow_convert.py example_workflows/leanlora_train_then_generate.json --object-info URL \
        --overrides workflows/api/train_then_generate.overrides.json > workflows/api/train_then_generate.json

--overrides replaces widget values after conversion ({"node id": {"input": value}}): the shipped template names
the user's files (their checkpoint, their folder) and the tests' twin names the tiny fixtures.

Supported: links (also links saved in the object form of schema version 1), widget inputs turned into sockets,
the extra value the frontend stores after seed-like widgets (control_after_generate) and after image/video
upload combos, Reroute and PrimitiveNode (followed/inlined), Note/MarkdownNote (skipped), muted nodes (dropped)
and bypassed nodes (dropped, links rerouted to their matching input). Subgraphs/group nodes are refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MUTED, BYPASSED = 2, 4
NOTE_TYPES = {"Note", "MarkdownNote"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# The frontend gives INT inputs with these names a "control after generate" widget unless the node says otherwise.
SEED_NAMES = {"seed", "noise_seed"}
UPLOAD_OPTIONS = ("image_upload", "video_upload", "animated_image_upload")


def widget_slots(info: dict) -> list[tuple[str | None, int]]:
    """(input name, number of values it takes in widgets_values) in the frontend's widget order: required then
    optional inputs that are drawn as widgets. A None name is a value with no backend input (the upload button)."""
    order = info.get("input_order") or {sec: list(inputs) for sec, inputs in info.get("input", {}).items()}
    slots: list[tuple[str | None, int]] = []
    for section in ("required", "optional"):
        has_upload = False
        for name in order.get(section, []):
            spec = info["input"][section][name]
            kind, opts = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
            is_combo = isinstance(kind, list) or kind == "COMBO"
            if opts.get("forceInput") or not (is_combo or kind in WIDGET_TYPES):
                continue
            control = opts.get("control_after_generate")
            if control is None:
                control = kind == "INT" and name in SEED_NAMES
            slots.append((name, 2 if control else 1))
            has_upload |= is_combo and any(opts.get(o) for o in UPLOAD_OPTIONS)
        if has_upload:  # the frontend appends an "upload" widget after the required inputs; its value is saved
            slots.append((None, 1))
    return slots


def widget_values(node: dict, info: dict) -> dict:
    raw = node.get("widgets_values") or []
    slots = widget_slots(info)
    if isinstance(raw, dict):  # some extensions save widgets by name
        return {name: raw[name] for name, _ in slots if name in raw}
    expected = sum(width for _, width in slots)
    if len(raw) > expected:
        raise ValueError(f"node {node['id']} ({node['type']}): {len(raw)} widget values but its object_info has "
                         f"{expected} ({[name for name, _ in slots]}); the workflow and the server disagree")
    values, i = {}, 0
    for name, width in slots:
        if i >= len(raw):  # saved by an older node version: the server's defaults/validation take over
            break
        if name is not None:
            values[name] = raw[i]
        i += width
    return values


class _Graph:
    def __init__(self, ui: dict):
        self.nodes = {n["id"]: n for n in ui["nodes"]}
        self.links = dict(self._link_table(ui.get("links", [])))

    @staticmethod
    def _link_table(links):
        for link in links:
            if isinstance(link, dict):
                yield link["id"], (link["origin_id"], link["origin_slot"])
            else:  # [link_id, from_node, from_slot, to_node, to_slot, type]
                yield link[0], (link[1], link[2])

    def source(self, link_id: int | None, want_type: str):
        """Where an input's value comes from: ("link", [node_id, slot]), ("value", literal), or None if nothing
        (unconnected Reroute, muted node, bypassed node without a matching input)."""
        while link_id is not None:
            origin_id, slot = self.links[link_id]
            origin = self.nodes[origin_id]
            if origin["type"] == "Reroute":
                link_id = origin["inputs"][0].get("link")
            elif origin["type"] == "PrimitiveNode":  # frontend-only: its value is written into the target
                return "value", origin["widgets_values"][0]
            elif origin.get("mode") == MUTED:
                return None
            elif origin.get("mode") == BYPASSED:
                link_id = self._bypass_link(origin, slot, want_type)
            else:
                return "link", [str(origin_id), slot]
        return None

    @staticmethod
    def _bypass_link(node: dict, out_slot: int, want_type: str) -> int | None:
        # Like the frontend: the input at the output's index if its type matches, else the first matching input.
        inputs = node.get("inputs", [])
        for i in [out_slot, *range(len(inputs))]:
            if i < len(inputs) and inputs[i].get("type") == want_type:
                return inputs[i].get("link")
        return None


def ui_to_api(ui: dict, object_info: dict) -> dict:
    """{str(node id): {"class_type", "inputs"}} for every active node of a UI-format workflow."""
    graph = _Graph(ui)
    subgraphs = {sg["id"] for sg in ui.get("definitions", {}).get("subgraphs", [])}
    prompt = {}
    for node in ui["nodes"]:
        node_type = node["type"]
        if node_type in NOTE_TYPES or node_type in ("Reroute", "PrimitiveNode") or node.get("mode") in (MUTED, BYPASSED):
            continue
        if node_type in subgraphs:
            raise ValueError(f"node {node['id']} is a subgraph; convert it to nodes (unpack) first")
        info = object_info.get(node_type)
        if info is None:
            raise ValueError(f"node {node['id']} has type {node_type!r}, which the server does not know")
        inputs = widget_values(node, info)
        for inp in node.get("inputs", []):
            src = graph.source(inp.get("link"), inp.get("type"))
            if src is not None:
                inputs[inp["name"]] = src[1]
        prompt[str(node["id"])] = {"class_type": node_type, "inputs": inputs}
    return prompt


# px that web/leanlora.js adds under a node's widgets: the Dataset node's upload button, counts and thumbnails
DRAWN_BELOW_WIDGETS = {"LeanLoRADataset": 134}


def api_to_ui(prompt: dict, object_info: dict, layout: dict[str, tuple[int, int]],
              titles: dict[str, str] | None = None, notes: list[dict] | None = None) -> dict:
    """The UI-format workflow of an API prompt, the inverse of ui_to_api: every node at layout[id] (x, y), its
    widget values in the frontend's order (widget_slots; "fixed" after seeds), its links, and `notes`
    ({"text", "pos", "size", optional "title"}) as Note nodes. Node sizes are the frontend's for their widget
    count (and what web/leanlora.js draws below them), so laid-out nodes do not overlap."""
    titles = titles or {}
    nodes, links = [], []
    link_id = 0
    incoming: dict[tuple[str, str], int] = {}
    outgoing: dict[tuple[str, int], list[int]] = {}
    for node_id, node in prompt.items():
        for name, value in node["inputs"].items():
            if isinstance(value, list):
                link_id += 1
                origin, slot = value
                output_type = object_info[prompt[origin]["class_type"]]["output"][slot]
                links.append([link_id, int(origin), slot, int(node_id), None, output_type])
                incoming[node_id, name] = link_id
                outgoing.setdefault((origin, slot), []).append(link_id)
    for order, (node_id, node) in enumerate(prompt.items()):
        info = object_info[node["class_type"]]
        values = []
        for name, width in widget_slots(info):
            if name is None:
                values.append("image")
                continue
            spec = info["input"].get("required", {}).get(name) or info["input"]["optional"][name]
            default = spec[1].get("default") if len(spec) > 1 and isinstance(spec[1], dict) else None
            if default is None and isinstance(spec[0], list):
                default = spec[0][0] if spec[0] else ""
            values.append(node["inputs"].get(name, default))
            values += ["fixed"] * (width - 1)
        inputs = []
        for section in ("required", "optional"):
            for name, spec in info["input"].get(section, {}).items():
                if (node_id, name) in incoming:
                    link = incoming[node_id, name]
                    links[link - 1][4] = len(inputs)
                    kind = spec[0] if isinstance(spec[0], str) else "COMBO"
                    inputs.append({"name": name, "type": kind, "link": link})
        outputs = [{"name": out_name, "type": out_type, "links": outgoing.get((node_id, slot), []), "slot_index": slot}
                   for slot, (out_name, out_type) in enumerate(zip(info["output_name"], info["output"]))]
        height = 46 + 24 * max(len(inputs), len(outputs)) + 26 * len(values)
        if node["class_type"] in ("SaveImage", "PreviewImage"):
            height = max(height, 300)
        height += DRAWN_BELOW_WIDGETS.get(node["class_type"], 0)
        entry = {"id": int(node_id), "type": node["class_type"], "pos": list(layout[node_id]),
                 "size": [340, height], "flags": {}, "order": order, "mode": 0, "inputs": inputs, "outputs": outputs,
                 "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": values}
        if node_id in titles:
            entry["title"] = titles[node_id]
        nodes.append(entry)
    next_id = max(int(i) for i in prompt) + 1
    for offset, note in enumerate(notes or []):
        nodes.append({"id": next_id + offset, "type": "Note", "pos": list(note["pos"]), "size": list(note["size"]),
                      "flags": {}, "order": len(nodes), "mode": 0, "inputs": [], "outputs": [],
                      "properties": {}, "widgets_values": [note["text"]], "color": "#432", "bgcolor": "#653"})
        if note.get("title"):
            nodes[-1]["title"] = note["title"]
    return {"last_node_id": max(n["id"] for n in nodes), "last_link_id": link_id, "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 0.7, "offset": [40, 40]}}, "version": 0.4}


def apply_overrides(prompt: dict, overrides: dict) -> dict:
    """A copy of an API prompt with {node id: {input: value}} replaced. Only existing literal inputs can be
    replaced, so an overrides file that no longer matches its workflow fails instead of adding dead inputs."""
    out = json.loads(json.dumps(prompt))
    for node_id, values in overrides.items():
        if node_id not in out:
            raise ValueError(f"override for node {node_id}: the workflow has no such node")
        inputs = out[node_id]["inputs"]
        for name, value in values.items():
            if name not in inputs or isinstance(inputs[name], list):
                raise ValueError(f"override {node_id}.{name}: node {node_id} ({out[node_id]['class_type']}) "
                                 f"has no widget input {name!r}")
            inputs[name] = value
    return out


def load_object_info(source: str) -> dict:
    if not source.startswith(("http://", "https://")):
        return json.loads(Path(source).read_text())
    import requests  # only the URL form needs it

    url = source if source.rstrip("/").endswith("/object_info") else source.rstrip("/") + "/object_info"
    r = requests.get(url, timeout=60)
    r.raise_for_status()
    return r.json()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workflow", type=Path, help="UI-format workflow JSON")
    p.add_argument("--object-info", required=True, help="server URL (…/object_info optional) or a saved JSON file")
    p.add_argument("--overrides", type=Path, help='JSON {"node id": {"input": value}} to replace after converting')
    args = p.parse_args(argv)
    api = ui_to_api(json.loads(args.workflow.read_text()), load_object_info(args.object_info))
    if args.overrides:
        api = apply_overrides(api, json.loads(args.overrides.read_text()))
    json.dump(api, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
