// LeanLoRA's browser side (plain JS, no build step; ComfyUI serves it from WEB_DIRECTORY):
// - Memory Settings: `card` leads; the widgets the card plans are "advanced" (right-click > Show Advanced, shown by
//   themselves with card = manual); a workflow saved before `card` existed loads as manual with its values.
// - Train: its less used inputs are "advanced" like those of Memory Settings; a live panel drawn from the pack's
//   websocket messages (leanlora.progress / .saved / .partial_saved, each with its prompt id) and ComfyUI's
//   (execution_cached: "ComfyUI reused its result"): the phase before step 1, step / loss / s/step / time left /
//   VRAM, a loss chart, the plan, samples by step and prompt, where the file went, and a Stop button. One state per
//   run (prompt), kept in localStorage: a page reloaded mid-run redraws it, a template opened afresh shows none.
// - Memory Settings: auto_fit says when the card sets it. A LeanLoRA workflow opens at its saved view.
// - Dataset: the folder list (input/ subfolders, from the server) gains a "type a folder path" entry for any other
//   path, an "upload images" button puts files into a folder of input/ (ComfyUI's /upload/image), and the node
//   shows the picked folder's image and caption counts and a few thumbnails before Queue.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const LiteGraph = window.LiteGraph;

const MEMORY = "LeanLoRAMemorySettings";
const TRAIN = "LeanLoRATrain";
const DATASET = "LeanLoRADataset";
const TYPE_PATH = "type a folder path…"; // the folder list's last entry: opens a text prompt
const PREVIEW_HEIGHT = 104;
const OLD_FIRST_VALUES = ["bf16", "fp16", "no"]; // mixed_precision led Memory Settings before `card`
const PANEL_HEIGHT = 350; // px at 100% zoom; samples take their room from the chart, so the node never grows
const OLD_STORE_KEY = "leanlora.panel."; // the panel's state by node id, before runs (removed when seen)
const SMOOTHING = 0.9; // exponential moving average of the loss, as the server's chart draws it

// ---- Memory Settings -------------------------------------------------------------------------------------------

function setupMemoryNode(node) {
  markAdvanced(node);
  const card = node.widgets?.find((w) => w.name === "card");
  if (!card) return;
  const callback = card.callback;
  card.callback = function (value, ...rest) {
    if (value === "manual" && !node.showAdvanced) node.toggleAdvanced?.();
    const result = callback?.apply(this, [value, ...rest]);
    markCardOverrides(node);
    return result;
  };
  markCardOverrides(node);
}

function markCardOverrides(node) {
  // a card other than manual sets auto_fit (nodes/labels.py memory_values): the widget says so and takes no edit
  const card = node.widgets?.find((w) => w.name === "card");
  const autoFit = node.widgets?.find((w) => w.name === "auto_fit");
  if (!card || !autoFit) return;
  const overridden = card.value !== "manual";
  autoFit.label = overridden ? `auto_fit: set by card (${card.value})` : undefined;
  autoFit.disabled = overridden;
  if (autoFit.options) autoFit.options.disabled = overridden;
  node.setDirtyCanvas?.(true, true);
}

function markAdvanced(node) {
  // inputs the server marks {advanced: true} (Memory Settings' planned widgets, Train's timesteps and loss)
  for (const widget of node.widgets ?? []) {
    if (!widget.options?.advanced) continue;
    widget.advanced = true; // litegraph draws it only with showAdvanced (right-click > Show Advanced)
    // ...but frontend 1.32's widget layout still counts hidden widgets: take no room while hidden
    const computeSize = widget.computeSize;
    widget.computeSize = function (width) {
      if (!node.showAdvanced) return [0, -4];
      return computeSize ? computeSize.call(this, width) : [width, LiteGraph.NODE_WIDGET_HEIGHT];
    };
  }
  const toggle = node.toggleAdvanced;
  node.toggleAdvanced = function () {
    const result = toggle?.apply(this, arguments);
    fitHeight(this);
    return result;
  };
  fitHeight(node);
}

function fitHeight(node) {
  // the node's height for the widgets shown (hidden advanced ones take no room)
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), size[1]]);
}

function migrateMemoryValues(node, info) {
  // Positions are how a UI workflow stores widget values: an old one's first value is mixed_precision.
  const values = info?.widgets_values;
  if (!Array.isArray(values) || !OLD_FIRST_VALUES.includes(values[0])) return;
  const widgets = (node.widgets ?? []).filter((w) => w.serialize !== false);
  if (widgets[0]?.name !== "card") return;
  widgets[0].value = "manual"; // what the old workflow meant: every widget as given, auto_fit included
  for (let i = 0; i < values.length && i + 1 < widgets.length; i++) widgets[i + 1].value = values[i];
  node.showAdvanced = true; // manual: the widgets it set are its settings, so they stay in view
}

// ---- Train: the live panel, one state per run ---------------------------------------------------------------------
// A run is one prompt's Train node, keyed `${prompt id}:${node id}`: the pack's messages carry both. A Train node on
// the canvas shows the run queued from its graph (`${graph id}:${node id}` -> run key, kept with the runs), so a
// template opened afresh (a new graph id) shows no earlier run, and a page reloaded mid-run (its graph restored,
// the same id) shows it again.

const runs = new Map(); // run key -> state
const RUN_STORE = "leanlora.run."; // localStorage: one entry per run
const SHOWN_STORE = "leanlora.shown"; // localStorage: {graph node key: run key}, newest last
const KEEP_RUNS = 20;
const CACHED = "nothing changed since the last run: ComfyUI reused its result";
let shown = null; // graph node key -> run key

function shownRuns() {
  if (shown) return shown;
  try { shown = new Map(Object.entries(JSON.parse(localStorage.getItem(SHOWN_STORE) ?? "{}"))); } catch { shown = new Map(); }
  return shown;
}

function emptyState() {
  return { phase: "idle: press Run to train", phases: [], step: 0, total: 0, losses: [], validation: [], sPerStep: null,
           etaS: null, vram: null, plan: [], samples: [], prompts: [], final: null, stopped: false, failed: false,
           lastSave: null, started: false, cached: false, previous: null, promptId: null, updated: Date.now() };
}

function runState(key, create = false) {
  if (!key) return null;
  if (!runs.has(key)) {
    let state = null;
    try { state = JSON.parse(localStorage.getItem(RUN_STORE + key) ?? "null"); } catch { state = null; }
    if (!state && !create) return null;
    if (!state) state = { ...emptyState(), phase: "queued", promptId: key.split(":")[0] };
    runs.set(key, state);
  }
  return runs.get(key);
}

function graphKey(node) {
  const graph = node.graph?.rootGraph ?? node.graph ?? app.graph;
  return `${graph?.id ?? "graph"}:${node.id}`;
}

function runShownBy(node) {
  return shownRuns().get(graphKey(node)) ?? null;
}

function show(node, key) {
  // the node shows run `key` from now on; the run remembers what the node showed before (for a cached re-run)
  const map = shownRuns(), where = graphKey(node), before = map.get(where) ?? null;
  if (before === key) return;
  const s = runState(key, true);
  if (s.previous === null) s.previous = before;
  map.delete(where);
  map.set(where, key);
  while (map.size > 200) map.delete(map.keys().next().value);
  try { localStorage.setItem(SHOWN_STORE, JSON.stringify(Object.fromEntries(map))); } catch { /* full: skip */ }
  persist(key, true);
}

function stateShownBy(node) {
  // what the node's panel draws: its run, or for a cached re-run the run it repeats
  const s = runState(runShownBy(node));
  if (!s) return emptyState();
  if (s.cached && !s.started) {
    const earlier = runState(s.previous);
    return { ...(earlier && earlier.started ? earlier : emptyState()), phase: CACHED, cachedView: true };
  }
  return s;
}

function trainNodes(id) {
  // this tab's Train nodes with that id (the active graph's)
  const node = app.graph?.getNodeById?.(id) ?? app.graph?.getNodeById?.(Number(id));
  return node?.type === TRAIN ? [node] : [];
}

const saveTimers = new Map();
function persist(key, now = false) {
  // steps come many a second: kept at most every 500 ms; a start or an end at once; the newest KEEP_RUNS runs only
  clearTimeout(saveTimers.get(key));
  const save = () => {
    try {
      localStorage.setItem(RUN_STORE + key, JSON.stringify(runs.get(key)));
      const order = JSON.parse(localStorage.getItem(RUN_STORE + "order") ?? "[]").filter((k) => k !== key);
      order.push(key);
      for (const old of order.splice(0, Math.max(0, order.length - KEEP_RUNS))) localStorage.removeItem(RUN_STORE + old);
      localStorage.setItem(RUN_STORE + "order", JSON.stringify(order));
    } catch { /* storage full: skip */ }
  };
  if (now) save();
  else saveTimers.set(key, setTimeout(save, 500));
}

function claimQueued(promptId, output) {
  // a prompt queued from this tab: its Train nodes on the canvas show its runs from now on
  if (!promptId || !output) return;
  for (const [id, entry] of Object.entries(output)) {
    if (entry?.class_type !== TRAIN) continue;
    for (const node of trainNodes(id)) {
      show(node, `${promptId}:${id}`);
      render(node);
    }
  }
}

function duration(seconds) {
  seconds = Math.max(0, Math.round(seconds));
  const h = Math.floor(seconds / 3600), m = Math.floor((seconds % 3600) / 60), s = seconds % 60;
  return h ? `${h}:${String(m).padStart(2, "0")}:${String(s).padStart(2, "0")}` : `${m}:${String(s).padStart(2, "0")}`;
}

function smoothed(values) {
  const out = [];
  let ema = null;
  for (const v of values) { ema = ema === null ? v : SMOOTHING * ema + (1 - SMOOTHING) * v; out.push(ema); }
  return out;
}

function runKey(e) {
  if (e.node === undefined || e.node === null) return null;
  return `${e.prompt_id ?? "prompt"}:${e.node}`;
}

function onProgress(event) {
  const e = event.detail ?? {};
  const key = runKey(e);
  if (!key) return;
  const s = runState(key, true);
  switch (e.kind) {
    case "start":
      Object.assign(s, { ...emptyState(), previous: s.previous, promptId: e.prompt_id ?? null, started: true,
                         total: e.total, prompts: e.prompts ?? [], phase: "starting" });
      // queued another way (not through this tab's api.queuePrompt): the active graph's Train node of that id
      if (![...shownRuns().values()].includes(key)) for (const node of trainNodes(e.node)) show(node, key);
      break;
    case "phase":
      s.phase = e.text;
      s.phases = [...(s.phases ?? []), e.text].slice(-30);
      if (/^(auto-fit|recovered)/.test(e.text)) s.plan.push(e.text);
      break;
    case "cache":
      s.phase = `caching latents and text ${e.done}/${e.total}`;
      break;
    case "estimate":
      s.plan.push(String(e.text).split("\n")[0]);
      break;
    case "step":
      s.step = e.step; s.total = e.total; s.sPerStep = e.s_per_step; s.etaS = e.eta_s;
      s.prodigyD = e.d ?? null; // Prodigy's estimated step size (other optimizers: none)
      s.losses.push(e.loss);
      if (s.losses.length > 5000) s.losses = s.losses.filter((_, i) => i % 2 === 0); // keeps the shape, bounded
      if (e.vram) s.vram = e.vram;
      s.phase = "training";
      break;
    case "validation":
      s.validation.push([e.step, e.loss]);
      break;
    case "saved":
      s.lastSave = e.path;
      break;
    case "sample":
      s.samples.push({ step: e.step, images: e.images ?? [] });
      if (s.samples.length > 12) s.samples.shift();
      break;
  }
  s.started = true;
  s.updated = Date.now();
  redraw(key, e.kind === "start");
}

function onFinished(stopped) {
  return (event) => {
    const e = event.detail ?? {};
    const key = runKey(e);
    if (!key) return;
    const s = runState(key, true);
    s.final = e.text ?? (stopped ? `stopped; partial saved to ${e.shown ?? e.lora_name}; set resume to continue`
                                 : `Saved to ${e.shown ?? e.lora_name}`);
    s.stopped = stopped;
    s.started = true;
    s.phase = stopped ? "stopped" : "done";
    s.updated = Date.now();
    redraw(key, true);
  };
}

function onCached(event) {
  // ComfyUI served these nodes from its cache: a Train node among them did not train again
  const e = event.detail ?? {};
  for (const id of e.nodes ?? []) {
    const key = `${e.prompt_id}:${id}`;
    const s = runs.get(key) ?? (trainNodes(id).length ? runState(key, true) : null);
    if (!s || s.started) continue;
    s.cached = true;
    redraw(key, true);
  }
}

function onEnded(failed) {
  // the prompt stopped at a node (an error, or Cancel before the Train node answered): a run left mid-way says so
  return (event) => {
    const e = event.detail ?? {};
    for (const [key, s] of runs) {
      if (!key.startsWith(`${e.prompt_id}:`) || s.final || s.cached || s.stopped) continue;
      const here = String(e.node_id) === key.slice(key.indexOf(":") + 1);
      if (failed && (here || s.started)) {
        s.final = `failed: ${e.exception_message ?? "see ComfyUI's error"}`;
        s.failed = true;
      } else {
        s.phase = failed ? `not run: ${e.node_type ?? "a node"} failed before it` :
                  s.started ? "stopped" : "stopped before it started";
        s.stopped = true;
      }
      redraw(key, true);
    }
  };
}

async function stopRun(node) {
  // the panel's Stop: ComfyUI's own interrupt of this run's prompt (and out of the queue if it waits there)
  const s = runState(runShownBy(node));
  const promptId = s?.promptId ?? runShownBy(node)?.split(":")[0];
  if (!promptId) return;
  node.leanloraPanel.parts.stop.disabled = true;
  node.leanloraPanel.parts.stop.textContent = "stopping…";
  const post = (route, body) => api.fetchApi(route, { method: "POST", headers: { "Content-Type": "application/json" },
                                                      body: JSON.stringify(body) });
  try {
    await post("/queue", { delete: [promptId] });
    await post("/interrupt", { prompt_id: promptId });
  } catch (error) {
    console.warn("LeanLoRA: stop", error);
  }
}

function el(tag, className, parent) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  parent?.appendChild(e);
  return e;
}

const STYLE = `
.leanlora-panel { box-sizing: border-box; width: 100%; height: 100%; padding: 6px 8px; overflow: hidden;
  display: flex; flex-direction: column; gap: 2px;
  font: 13px/1.35 system-ui, sans-serif; color: #ddd; background: #1b1b1f; border-radius: 6px; }
.leanlora-panel .ll-head { display: flex; gap: 8px; align-items: flex-start; flex: none; }
.leanlora-panel .ll-phase { font-weight: 600; flex: 1; overflow-wrap: anywhere; }
.leanlora-panel .ll-stop { flex: none; font: 600 12px system-ui, sans-serif; color: #fff; background: #a33;
  border: 0; border-radius: 4px; padding: 2px 10px; cursor: pointer; }
.leanlora-panel .ll-stop:disabled { background: #555; cursor: default; }
.leanlora-panel .ll-bar { height: 6px; background: #333; border-radius: 3px; margin: 2px 0; flex: none; }
.leanlora-panel .ll-bar > div { height: 100%; background: #4a9eff; border-radius: 3px; width: 0; }
.leanlora-panel .ll-stats { color: #ccc; font-size: 12px; flex: none; }
.leanlora-panel .ll-chart { flex: 1 1 0; min-height: 48px; position: relative; }
.leanlora-panel .ll-chart canvas { position: absolute; inset: 0; width: 100%; height: 100%; display: block; }
.leanlora-panel .ll-plan { color: #aaa; font-size: 11px; flex: none; overflow-wrap: anywhere; }
.leanlora-panel .ll-final { font-weight: 600; font-size: 12px; color: #7fd37f; overflow-wrap: anywhere; flex: none; }
.leanlora-panel .ll-final.stopped { color: #f0c060; }
.leanlora-panel .ll-final.failed { color: #f07070; }
.leanlora-panel .ll-gallery { display: flex; gap: 6px; overflow-x: auto; overflow-y: hidden; flex: none; }
.leanlora-panel .ll-gallery:empty { display: none; }
.leanlora-panel .ll-gallery figure { margin: 0; flex: none; text-align: center; font-size: 10px; line-height: 1.2; color: #aaa; }
.leanlora-panel .ll-gallery img { height: 60px; display: block; border-radius: 3px; }
.leanlora-dataset { box-sizing: border-box; width: 100%; height: 100%; padding: 4px 6px; overflow: hidden;
  font: 13px/1.35 system-ui, sans-serif; color: #ddd; background: #1b1b1f; border-radius: 6px; }
.leanlora-dataset .ll-counts { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.leanlora-dataset .ll-counts.ll-problem { color: #f0c060; white-space: normal; font-size: 12px; max-height: 94px;
  overflow-y: auto; }
.leanlora-dataset .ll-thumbs { display: flex; gap: 4px; margin-top: 4px; overflow: hidden; }
.leanlora-dataset .ll-thumbs img { height: 56px; width: 56px; object-fit: cover; border-radius: 3px; flex: none; }
`;

function ensureStyle() {
  if (document.getElementById("leanlora-style")) return;
  const style = el("style", null, document.head);
  style.id = "leanlora-style";
  style.textContent = STYLE;
}

function drawChart(canvas, s) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 300, height = canvas.clientHeight || 100;
  canvas.width = Math.round(width * ratio); canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.fillStyle = "#111"; ctx.fillRect(0, 0, width, height);
  const losses = s.losses;
  ctx.font = "12px system-ui, sans-serif";
  if (losses.length < 2) {
    ctx.fillStyle = "#888"; ctx.fillText("the loss chart starts at step 2", 8, height / 2);
    return;
  }
  const left = 44, right = 6, top = 6, bottom = 18;
  const finite = losses.filter(Number.isFinite).concat(s.validation.map((v) => v[1]).filter(Number.isFinite));
  let lo = Math.min(...finite), hi = Math.max(...finite);
  if (hi - lo < 1e-9) { hi += 1e-3; lo -= 1e-3; }
  const firstStep = Math.max(1, s.step - losses.length + 1);
  const x = (i) => left + (i / (losses.length - 1)) * (width - left - right);
  const y = (v) => top + (1 - (v - lo) / (hi - lo)) * (height - top - bottom);
  ctx.fillStyle = "#aaa"; ctx.textAlign = "right";
  ctx.fillText(hi.toPrecision(3), left - 4, top + 10);
  ctx.fillText(lo.toPrecision(3), left - 4, height - bottom);
  ctx.textAlign = "left"; ctx.fillText(`step ${firstStep}`, left, height - 4);
  ctx.textAlign = "right"; ctx.fillText(`step ${s.step}`, width - right, height - 4);
  const line = (values, color, widthPx) => {
    ctx.strokeStyle = color; ctx.lineWidth = widthPx; ctx.beginPath();
    values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
    ctx.stroke();
  };
  line(losses, "rgba(74,158,255,0.35)", 1);
  line(smoothed(losses), "#4a9eff", 2);
  if (s.validation.length) {
    ctx.fillStyle = "#5fd35f";
    for (const [step, value] of s.validation) {
      const i = Math.min(losses.length - 1, Math.max(0, step - firstStep));
      ctx.beginPath(); ctx.arc(x(i), y(value), 3, 0, 2 * Math.PI); ctx.fill();
    }
  }
}

function viewUrl(image) {
  const query = new URLSearchParams({ filename: image.filename, subfolder: image.subfolder ?? "", type: image.type ?? "output" });
  return api.apiURL(`/view?${query}`);
}

function vramText(vram) {
  if (!vram) return null;
  if (vram.device === "cpu") return "VRAM: no GPU";
  return `VRAM ${vram.used_gib.toFixed(1)}/${vram.total_gib.toFixed(1)} GiB`;
}

function render(node) {
  const panel = node.leanloraPanel;
  if (!panel) return;
  const s = stateShownBy(node);
  const p = panel.parts;
  p.phase.textContent = s.cachedView ? CACHED : s.final ? (s.failed ? "failed" : s.stopped ? "stopped" : "finished")
                                                        : s.phase;
  const active = s.started !== undefined && runShownBy(node) !== null && !s.final && !s.stopped && !s.cachedView;
  p.stop.hidden = !active;
  if (active && p.stop.dataset.run !== runShownBy(node)) { // a new run: the button ready again
    p.stop.dataset.run = runShownBy(node);
    p.stop.disabled = false;
    p.stop.textContent = "Stop";
  }
  p.bar.style.width = s.total ? `${(100 * s.step) / s.total}%` : "0";
  const stats = [];
  if (s.step) {
    const last = s.losses[s.losses.length - 1];
    const smooth = smoothed(s.losses).pop();
    stats.push(`step ${s.step}/${s.total}`, `loss ${last.toFixed(4)} (smoothed ${smooth.toFixed(4)})`);
    if (s.validation.length) stats.push(`validation ${s.validation[s.validation.length - 1][1].toFixed(4)}`);
    if (s.prodigyD != null) stats.push(`Prodigy d ${s.prodigyD.toPrecision(3)}`);
    if (s.sPerStep) stats.push(`${s.sPerStep.toFixed(3)} s/step`, `${duration(s.etaS)} left`);
  }
  const vram = vramText(s.vram);
  if (vram) stats.push(vram);
  p.stats.textContent = stats.join(" · ") || " ";
  p.plan.textContent = s.plan.length ? s.plan[s.plan.length - 1] : "";
  p.plan.title = s.plan.join("\n");
  p.final.textContent = s.final ?? "";
  p.final.className = "ll-final" + (s.failed ? " failed" : s.stopped ? " stopped" : "");
  drawChart(p.chart, s);
  const gallery = JSON.stringify(s.samples.map((sample) => sample.step));
  if (gallery !== p.gallery.dataset.shown) { // the gallery takes its room from the chart: the node keeps its size
    p.gallery.replaceChildren();
    for (const sample of [...s.samples].reverse()) {
      sample.images.forEach((image, i) => {
        if (!image) return;
        const figure = el("figure", null, p.gallery);
        const img = el("img", null, figure);
        img.src = viewUrl(image);
        const prompt = s.prompts[i] ?? "";
        img.title = `step ${sample.step}: ${prompt}`;
        el("figcaption", null, figure).textContent = `step ${sample.step} · ${prompt.slice(0, 24)}`;
      });
    }
    p.gallery.dataset.shown = gallery;
    requestAnimationFrame(() => drawChart(p.chart, s)); // the chart's room changed
  }
  node.setDirtyCanvas(true, true);
}

function redraw(key, now = false) {
  persist(key, now);
  for (const node of app.graph?._nodes ?? []) if (node.leanloraPanel && runShownBy(node) === key) render(node);
  // a cached run shows its previous run: redraw those too
  for (const node of app.graph?._nodes ?? []) {
    if (node.leanloraPanel && runState(runShownBy(node))?.previous === key) render(node);
  }
}

function setupTrainNode(node) {
  ensureStyle();
  markAdvanced(node); // before the panel: it is no input widget
  const root = el("div", "leanlora-panel");
  const head = el("div", "ll-head", root);
  const parts = {
    phase: el("div", "ll-phase", head), stop: el("button", "ll-stop", head),
    bar: el("div", null, el("div", "ll-bar", root)), stats: el("div", "ll-stats", root),
    chart: el("canvas", null, el("div", "ll-chart", root)), plan: el("div", "ll-plan", root),
    final: el("div", "ll-final", root), gallery: el("div", "ll-gallery", root),
  };
  parts.stop.textContent = "Stop";
  parts.stop.title = "Stop this training (ComfyUI's interrupt): the LoRA learned so far is saved";
  parts.stop.hidden = true;
  parts.stop.addEventListener("click", (event) => { event.stopPropagation(); stopRun(node); });
  const panel = { root, parts, height: PANEL_HEIGHT };
  const widget = node.addDOMWidget("leanlora_panel", "leanlora_panel", root, {
    serialize: false, hideOnZoom: false, getValue: () => "", setValue: () => {},
    getMinHeight: () => panel.height, getMaxHeight: () => panel.height,
  });
  widget.serialize = false; // not a widget value: a saved workflow's positions stay the inputs'
  node.leanloraPanel = panel;
  // the panel draws the loss chart and the samples: the server's PNG previews (for frontends without this file)
  // would only grow the node over its neighbours
  Object.defineProperty(node, "imgs", { configurable: true, get: () => undefined, set: () => {} });
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
  requestAnimationFrame(() => render(node));
}

// ---- Dataset: folder list + preview ----------------------------------------------------------------------------

function setupDatasetNode(node) {
  ensureStyle();
  const folder = node.widgets?.find((w) => w.name === "folder");
  if (!folder) return;
  // the server's list (object_info, or a refresh with R) plus the entry for a typed path, whoever sets the list
  let listed = folder.options.values ?? [];
  Object.defineProperty(folder.options, "values", {
    configurable: true, enumerable: true,
    get: () => [...listed.filter((v) => v !== TYPE_PATH), TYPE_PATH],
    set: (values) => { listed = values ?? []; },
  });
  const callback = folder.callback;
  let previous = folder.value;
  folder.callback = function (value, canvas, ...rest) {
    if (value !== TYPE_PATH) {
      previous = value;
      previewDataset(node);
      return callback?.apply(this, [value, canvas, ...rest]);
    }
    folder.value = previous; // the entry is not a folder: keep the last one until a path is given
    const ask = canvas ?? app.canvas;
    const typed = typeof previous === "string" && !listed.includes(previous) ? previous : "";
    ask.prompt("Folder path", typed, (text) => {
      text = String(text ?? "").trim();
      if (!text) return;
      folder.value = previous = text;
      previewDataset(node);
      callback?.apply(folder, [text, canvas, ...rest]);
      node.setDirtyCanvas(true, true);
    }, rest[2]); // rest: node, position, event
  };
  addUploadButton(node, folder);
  const root = el("div", "leanlora-dataset");
  const parts = { counts: el("div", "ll-counts", root), thumbs: el("div", "ll-thumbs", root) };
  const widget = node.addDOMWidget("leanlora_dataset_preview", "leanlora_dataset_preview", root, {
    serialize: false, hideOnZoom: false, getValue: () => "", setValue: () => {},
    getMinHeight: () => PREVIEW_HEIGHT, getMaxHeight: () => PREVIEW_HEIGHT,
  });
  widget.serialize = false; // not an input: a saved workflow's widget values stay the inputs', by position
  node.leanloraDataset = { root, parts, folder, answer: null };
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
  previewDataset(node);
}

function addUploadButton(node, folder) {
  // images (and their .txt captions or a metadata.csv) into a folder of input/, through ComfyUI's own upload route
  const picker = el("input", null, document.body);
  Object.assign(picker, { type: "file", multiple: true, accept: "image/*,.txt,.csv" });
  picker.style.display = "none";
  const button = node.addWidget("button", "upload images", null, () => picker.click(), { serialize: false });
  button.serialize = false; // not an input: a saved workflow's widget values stay the inputs', by position
  picker.addEventListener("change", () => {
    const files = [...picker.files];
    picker.value = ""; // the same files can be picked again
    if (!files.length) return;
    const current = String(folder.value ?? "");
    const suggested = /^[^/\\]+$/.test(current) && current !== TYPE_PATH ? current : "my_dataset";
    app.canvas.prompt("Upload into this folder of input/", suggested, (name) => {
      name = String(name ?? "").trim();
      if (name) uploadInto(node, folder, name, files);
    });
  });
  const removed = node.onRemoved;
  node.onRemoved = function () { picker.remove(); return removed?.apply(this, arguments); };
}

async function uploadInto(node, folder, name, files) {
  const counts = node.leanloraDataset?.parts.counts;
  if (/[/\\]|^\.+$/.test(name)) { // one folder directly inside input/, as the list shows them
    if (counts) counts.textContent = `'${name}' is not a folder name: give a name without / or \\`;
    return;
  }
  for (const [i, file] of files.entries()) {
    if (counts) counts.textContent = `uploading ${i + 1}/${files.length} into input/${name}…`;
    const body = new FormData();
    body.append("image", file);
    body.append("subfolder", name);
    body.append("type", "input");
    body.append("overwrite", "true"); // an edited caption replaces the old one instead of becoming "x (1).txt"
    const response = await api.fetchApi("/upload/image", { method: "POST", body });
    if (!response.ok) {
      if (counts) counts.textContent = `upload of ${file.name} failed (${response.status} ${response.statusText})`;
      return;
    }
  }
  folder.value = name;
  folder.callback?.(name, app.canvas, node); // previews the folder and refreshes the list
  node.setDirtyCanvas(true, true);
}

async function previewDataset(node) {
  const preview = node.leanloraDataset;
  if (!preview) return;
  const value = preview.folder.value;
  const asked = (preview.asked = (preview.asked ?? 0) + 1); // a later pick wins over a slow earlier answer
  preview.parts.counts.textContent = "reading the folder…";
  let answer;
  try {
    const response = await api.fetchApi(`/leanlora/dataset_preview?${new URLSearchParams({ folder: value ?? "" })}`);
    answer = await response.json();
  } catch (error) {
    answer = { error: `no preview (${error})` };
  }
  if (asked !== preview.asked) return;
  preview.answer = answer;
  if (Array.isArray(answer.folders)) preview.folder.options.values = answer.folders; // a new folder shows up
  const p = preview.parts;
  p.thumbs.replaceChildren();
  p.counts.title = answer.error ?? answer.problem ?? answer.path ?? "";
  if (answer.error) {
    p.counts.textContent = answer.error;
    p.counts.className = "ll-counts ll-problem";
  } else {
    const counts = [`${answer.images} images`, `${answer.captions} captions`];
    if (answer.skipped) counts.push(`${answer.skipped} skipped`);
    p.counts.textContent = answer.problem ?? counts.join(" · ");
    p.counts.className = "ll-counts" + (answer.problem || !answer.images ? " ll-problem" : "");
    for (const image of answer.thumbnails ?? []) {
      const img = el("img", null, p.thumbs);
      img.src = viewUrl(image);
      img.title = image.filename;
    }
  }
  node.setDirtyCanvas(true, true);
}

// for the browser tests (tests/test_browser.py) and the console: the runs, and what a Train node of the active graph
// shows (by node id)
function shownState(id) {
  const [node] = trainNodes(id);
  return node ? { ...stateShownBy(node), run: runShownBy(node) } : null;
}
window.LeanLoRA = { runs, shownState, TYPE_PATH, CACHED };

// Runs `extra(node, ...arguments)` after a node class's own `hook` (litegraph's onNodeCreated, onConfigure), keeping
// its result: the frontend's and other packs' handlers still run first.
function after(nodeType, hook, extra) {
  const own = nodeType.prototype[hook];
  nodeType.prototype[hook] = function () {
    const result = own?.apply(this, arguments);
    extra(this, ...arguments);
    return result;
  };
}

// The messages, heard from when this file loads: a page reloaded mid-run gets them before the extensions' setup
api.addEventListener("execution_cached", onCached);
api.addEventListener("execution_error", onEnded(true));
api.addEventListener("execution_interrupted", onEnded(false));
api.addEventListener("leanlora.progress", onProgress);
api.addEventListener("leanlora.saved", onFinished(false));
api.addEventListener("leanlora.partial_saved", onFinished(true));

// A workflow of this pack opens at its saved view: frontend 1.49.6 fits a template (or a view it finds empty) to the
// window instead, where the templates' nodes are grey boxes at 32-39%.
const READABLE_SCALE = 0.6;
let savedView = null;

function restoreSavedView() {
  const view = savedView;
  savedView = null;
  if (!view) return;
  const apply = () => {
    const ds = app.canvas?.ds;
    if (!ds || ds.scale >= READABLE_SCALE) return;
    ds.scale = view.scale;
    ds.offset = [...view.offset];
    app.canvas.setDirty(true, true);
  };
  apply();
  requestAnimationFrame(() => { apply(); requestAnimationFrame(apply); }); // after the frontend's own fit
}

app.registerExtension({
  name: "LeanLoRA.panel",
  beforeConfigureGraph(graphData) {
    const ds = graphData?.extra?.ds;
    const ours = (graphData?.nodes ?? []).some((n) => String(n?.type ?? "").startsWith("LeanLoRA"));
    savedView = ours && ds?.scale >= READABLE_SCALE && ds.offset?.length === 2
      ? { scale: ds.scale, offset: [Number(ds.offset[0]), Number(ds.offset[1])] } : null;
  },
  afterConfigureGraph() {
    restoreSavedView();
  },
  async setup() {
    for (const key of Object.keys(localStorage)) if (key.startsWith(OLD_STORE_KEY)) localStorage.removeItem(key);
    const queuePrompt = api.queuePrompt;
    api.queuePrompt = async function (number, data, ...rest) { // this tab's prompts: their Train nodes show them
      const response = await queuePrompt.call(this, number, data, ...rest);
      try { claimQueued(response?.prompt_id, data?.output); } catch (error) { console.warn("LeanLoRA:", error); }
      return response;
    };
  },
  loadedGraphNode(node) {
    // after a workflow loads: a saved Memory Settings or Train node takes the height of the widgets it shows (and
    // Train's panel), so Train fits a 1440x900 window at 100%; Show Advanced grows it again
    if ((node.type === MEMORY || node.type === TRAIN) && !node.showAdvanced) fitHeight(node);
  },
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name === MEMORY) {
      after(nodeType, "onNodeCreated", (node) => setupMemoryNode(node));
      after(nodeType, "onConfigure", (node, info) => { migrateMemoryValues(node, info); markCardOverrides(node); });
    }
    if (nodeData.name === DATASET) {
      after(nodeType, "onNodeCreated", (node) => setupDatasetNode(node));
      after(nodeType, "onConfigure", (node) => previewDataset(node)); // a loaded workflow's folder
    }
    if (nodeData.name === TRAIN) {
      after(nodeType, "onNodeCreated", (node) => setupTrainNode(node));
      // a reloaded page: the panel from the last state kept
      after(nodeType, "onConfigure", (node) => requestAnimationFrame(() => render(node)));
    }
  },
});
