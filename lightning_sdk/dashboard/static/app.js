// lightning dashboard: plain JavaScript, no build step.
// Everything an agent or a model wrote is untrusted: it reaches the page only as text nodes (el() below),
// never as markup; the server's Content-Security-Policy forbids inline script besides.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const PAGE = 50;

// ------------------------------------------------------------------------------------------------ helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  return add(node, children);
}

function add(node, children) {
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fill(node, ...children) {
  node.replaceChildren();
  return add(node, children);
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

async function api(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v !== null && v !== undefined) q.set(k, v);
  const r = await fetch(`/api/${path}?${q}`, { credentials: "same-origin" });
  if (!r.ok) throw new Error(`${r.status}: ${await r.text()}`);
  return r.json();
}

const href = (...parts) => "#/" + parts.map(encodeURIComponent).join("/");
// series colours: a run's (or a policy's) curve, its band and its eval lines share one
const PALETTE = ["#3b6fd8", "#d2691e", "#2e9b57", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#b8860b"];
const color = (n) => PALETTE[n % PALETTE.length];
const num = (v, d = 3) => (v === null || v === undefined ? "" : Number(v).toFixed(d));
const sig = (v) => (v === null || v === undefined ? "" : String(Number(Number(v).toPrecision(3))));
const ms = (v) => (v === null || v === undefined ? "" : v < 1000 ? `${v.toFixed(1)} ms` : `${(v / 1000).toFixed(2)} s`);
const iterLabel = (r) => (r.phase === "eval" ? (r.iteration === 0 ? "eval before" : "eval after") : r.iteration);
const text = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));
// An eval score: its mean ± its standard error, over its tasks, and how many of its rollouts failed (each scored 0,
// so a score made mostly of failures does not read as the policy's); what it is in words (e.words) is the server's.
const scoreText = (e) => `${num(e.mean)}${finite(e.stderr) ? ` ± ${num(e.stderr)}` : ""}` +
  (e.tasks ? ` (${e.tasks} task${e.tasks === 1 ? "" : "s"})` : "") +
  (e.failed ? `; ${e.failed} of ${e.tasks} rollouts FAILED and scored 0: ${e.failures || "no reason logged"}` : "");
// A rollout's address, in the run's store or (`store`) one of its evals/ stores.
const rolloutHref = (run, id, store) => href("run", run, "rollout", id) + (store ? "?" + new URLSearchParams({ store }) : "");

function table(headers, rows) {
  return el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, headers.map(([h, cls]) => el("th", { class: cls }, h)))),
    el("tbody", {}, rows)));
}

function badge(status) { return el("span", { class: `badge ${status}` }, status); }

// ------------------------------------------------------------------------------------------------ routing

let current = null; // the view on screen: { refresh }; polled while the page is visible

// The address: #/<view>/<args>?<the view's state>; the state part (a list's filters) is the view's to read.
function parseHash() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(query || "") };
}

function route() {
  const { parts, query } = parseHash();
  const key = parts.join("/");
  // Same view, other state (Back after a filter change): the view takes the state, the page is not rebuilt.
  if (current && current.key === key && current.restore) {
    current.restore(query);
    tick();
    return;
  }
  // Each view draws into its own box: a slow answer for a view left behind lands in a detached box.
  const box = el("div");
  fill(document.getElementById("view"), box);
  if (parts[0] === "run" && parts[2] === "rollout") current = rolloutView(box, parts[1], parts[3], query.get("store") || "");
  else if (parts[0] === "run") current = runView(box, parts[1], query);
  else if (parts[0] === "compare") current = compareView(box, parts[1], parts[2]);
  else current = runsView(box);
  current.key = key;
  current.busy = false;
  tick();
}

async function tick() {
  const view = current;
  if (!view) return;
  if (view.busy) { view.again = true; return; } // a state change during a refresh: refresh once more after it
  view.busy = true;
  try {
    do {
      view.again = false;
      await view.refresh();
    } while (view.again && view === current);
    if (view === current) document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (e) {
    if (view === current) document.getElementById("updated").textContent = `error: ${e.message}`;
  } finally {
    view.busy = false;
  }
}

// A view redraws only when its data changed, so that polling leaves open details and the scroll position alone.
function differ() {
  let last = "";
  return (data) => {
    const s = JSON.stringify(data);
    if (s === last) return false;
    last = s;
    return true;
  };
}

// ------------------------------------------------------------------------------------------------ runs

function runsView(main) {
  const changed = differ();
  const chosen = { a: null, b: null }; // the two runs picked for comparing, kept across redraws
  return {
    async refresh() {
      const data = await api("runs");
      document.getElementById("root").textContent = data.root;
      if (!changed(data)) return;
      const ids = data.runs.map((r) => r.id);
      if (!ids.includes(chosen.a)) chosen.a = ids[0];
      if (!ids.includes(chosen.b)) chosen.b = ids[Math.min(1, ids.length - 1)];
      const pick = (name) => el("select", { name, onchange: (e) => { chosen[name] = e.target.value; } },
        ids.map((id) => el("option", { value: id, selected: id === chosen[name] }, id)));
      const a = pick("a"), b = pick("b");
      fill(main,
        el("h2", {}, "Runs"),
        data.runs.length === 0 ? el("p", { class: "muted" }, "No run here yet (a run directory holds store.sqlite, metrics.jsonl or checkpoints/).") :
          table([["run", "l"], ["status", "l"], ["iterations"], ["last reward"], ["last eval pass", "l"], ["rollouts"], ["running"], ["failed"], ["updated", "l"]],
            data.runs.map((r) => el("tr", { "data-run": r.id },
              el("td", { class: "l" }, el("a", { href: href("run", r.id) }, r.id)),
              el("td", { class: "l status" }, outcomeBadge(r.outcome), r.outcome && r.outcome.status !== "finished" && r.outcome.reason ? el("span", { class: `reason ${r.outcome.status}` }, ` ${r.outcome.reason}`) : null),
              el("td", {}, r.iterations), el("td", {}, num(r.last_reward)),
              el("td", { class: "l eval-score" }, r.eval ? `${r.eval.words} ${r.eval.label}: ${scoreText(r.eval)}` : ""),
              el("td", {}, r.rollouts),
              el("td", {}, r.running),
              el("td", {}, r.failed),
              el("td", { class: "l" }, r.modified ? new Date(r.modified * 1000).toLocaleString() : "")))),
        ids.length > 1 ? el("div", { class: "filters" }, el("label", {}, "run A", a), el("label", {}, "run B", b),
          el("button", { id: "compare", onclick: () => { location.hash = href("compare", a.value, b.value); } }, "compare side by side")) : null,
      );
    },
  };
}

// ------------------------------------------------------------------------------------------------ one run

// Exponential moving average (TensorBoard's smoothing): 0 leaves the values as they are; nulls stay gaps.
function ema(values, weight) {
  let last = null;
  return values.map((v) => {
    if (v === null || v === undefined || !Number.isFinite(v)) return null;
    last = last === null || weight <= 0 ? v : weight * last + (1 - weight) * v;
    return last;
  });
}

const finite = (v) => typeof v === "number" && Number.isFinite(v);

// An axis from lo to hi in steps of 1, 2 or 5 x 10^k, widened to whole steps; each tick labelled with the decimals
// its step needs (tiny or huge values in exponent form), so that every label is short and none repeats.
function niceScale(lo, hi, count = 4) {
  if (!(hi > lo)) { const pad = Math.abs(lo) * 0.1 || 0.5; lo -= pad; hi += pad; }
  const raw = (hi - lo) / count, mag = 10 ** Math.floor(Math.log10(raw)), f = raw / mag;
  const step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
  const a = Math.floor(lo / step + 1e-9) * step, b = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let k = 0; a + k * step <= b + step / 2; k++) ticks.push(Math.abs(a + k * step) < step / 1e6 ? 0 : a + k * step);
  const exp = step < 1e-3 || Math.max(Math.abs(a), Math.abs(b)) >= 1e6;
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const label = (v) => (v === 0 ? "0" : exp
    ? v.toExponential(Math.max(0, Math.floor(Math.log10(Math.abs(v)) + 1e-9) - Math.floor(Math.log10(step) + 1e-9))).replace("e+", "e").replace(/(\.\d*?)0+e/, "$1e").replace(".e", "e")
    : v.toFixed(decimals));
  // the left margin fits the longest label (about 6.5 px a character at the axis' font size)
  const width = 12 + 6.5 * Math.max(...ticks.map((v) => label(v).length));
  return { lo: a, hi: b, ticks, label, width };
}

function axes(g, { W, H, L, R, T, B, scale, x0, x1, x, y, xlabel }) {
  for (const v of scale.ticks) {
    g.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }), svg("text", { class: "tick", x: L - 6, y: y(v) + 4, "text-anchor": "end" }, scale.label(v)));
  }
  const step = Math.max(1, Math.ceil((x1 - x0) / 8));
  for (let i = x0; i <= x1; i += step) g.append(svg("text", { x: x(i), y: H - B + 14, "text-anchor": "middle" }, i));
  g.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }), svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  if (xlabel) g.append(svg("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle" }, xlabel));
}

const pathOf = (pts) => pts.map((p, i) => `${i ? "L" : "M"}${p[0].toFixed(1)},${p[1].toFixed(1)}`).join("");

// Runs of consecutive finite points, so that a missing value breaks the line instead of bridging it.
function segments(xs, ys) {
  const out = [];
  let cur = [];
  xs.forEach((xv, i) => {
    if (finite(ys[i])) cur.push([xv, ys[i]]);
    else if (cur.length) { out.push(cur); cur = []; }
  });
  if (cur.length) out.push(cur);
  return out;
}

function rewardChart(runs, smoothing = 0) {
  // runs: [{ name, history, evals }]; x counts iterations as the run's table does (1..N), evals at 0 and N.
  // The band is reward_mean ± reward_std of each iteration's training rollouts.
  const evalLabel = (r, e) => `${runs.length > 1 ? r.name + " " : ""}${e.words} ${e.iteration === 0 ? "before" : "after"}: ${scoreText(e)}`;
  const trainLabel = (r) => (runs.length > 1 ? `${r.name}: train reward ± std` : "train rollouts (mean ± std)");
  // the legend's column is as wide as its longest line (an eval score's name and numbers can be long)
  const longest = Math.max(...runs.flatMap((r) => [trainLabel(r), ...r.evals.map((e) => evalLabel(r, e))]).map((t) => t.length));
  // mean ± std, kept within the rewards the run's rollouts got (0/1 rewards: a band within 0 and 1)
  const band = (r, h) => {
    const [a, b] = r.range || [-Infinity, Infinity], sd = h["rollout/reward_std"] || 0;
    return [Math.max(a, h["rollout/reward_mean"] - sd), Math.min(b, h["rollout/reward_mean"] + sd)];
  };
  const ys = [0, 1];
  let maxX = 1;
  for (const r of runs) {
    r.history.forEach((h) => { if (finite(h["rollout/reward_mean"])) ys.push(...band(r, h)); });
    r.evals.forEach((e) => { if (finite(e.mean)) ys.push(e.mean); });
    maxX = Math.max(maxX, r.history.length, ...r.evals.map((e) => e.iteration));
  }
  const scale = niceScale(Math.min(...ys), Math.max(...ys), 5), lo = scale.lo, hi = scale.hi;
  const R = Math.max(250, 46 + Math.ceil(6 * longest)), W = 650 + R, H = 260, L = scale.width, T = 14, B = 30;
  const x = (i) => L + (i / maxX) * (W - L - R);
  const y = (v) => T + (1 - (v - lo) / (hi - lo || 1)) * (H - T - B);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "reward per iteration" });
  axes(g, { W, H, L, R, T, B, scale, x0: 0, x1: maxX, x, y, xlabel: "iteration" });
  let ly = T + 6;
  const legend = (stroke, label, dash) => {
    g.append(svg("line", { stroke, "stroke-width": 2, "stroke-dasharray": dash || "none", x1: W - R + 12, x2: W - R + 34, y1: ly, y2: ly }),
      svg("text", { class: "legend", x: W - R + 40, y: ly + 4 }, label));
    ly += 18;
  };
  runs.forEach((r, n) => {
    const c = color(n);
    const pts = r.history.map((h, i) => [i + 1, h["rollout/reward_mean"], ...(finite(h["rollout/reward_mean"]) ? band(r, h) : [])]).filter((p) => finite(p[1]));
    if (pts.length) {
      const upper = pts.map(([i, , , top]) => [x(i), y(top)]), lower = pts.map(([i, , bottom]) => [x(i), y(bottom)]).reverse();
      g.append(svg("path", { class: "band", "data-run": r.name, fill: c, d: pathOf([...upper, ...lower]) + "Z" },
        svg("title", {}, `${r.name}: reward mean ± std`)));
    }
    const sm = ema(r.history.map((h) => h["rollout/reward_mean"]), smoothing);
    if (pts.length) g.append(svg("polyline", { class: "line", stroke: c, points: r.history.map((h, i) => finite(sm[i]) ? `${x(i + 1)},${y(sm[i])}` : "").filter(Boolean).join(" ") }));
    r.history.forEach((h, i) => { if (finite(h["rollout/reward_mean"])) g.append(svg("circle", { fill: c, cx: x(i + 1), cy: y(h["rollout/reward_mean"]), r: 3 },
      svg("title", {}, `${r.name} iteration ${i + 1}: reward ${num(h["rollout/reward_mean"])} ± ${num(h["rollout/reward_std"])}`))); });
    legend(c, trainLabel(r));
    for (const e of r.evals) {
      if (!finite(e.mean)) continue;
      const dash = e.iteration === 0 ? "6 4" : "2 3";
      const label = evalLabel(r, e);
      g.append(svg("line", { class: "eval-line", stroke: c, "stroke-dasharray": dash, "data-run": r.name, "data-when": e.iteration === 0 ? "before" : "after",
        x1: L, x2: W - R, y1: y(e.mean), y2: y(e.mean) }, svg("title", {}, `${r.name} ${e.words} ${e.label}: ${scoreText(e)}`)));
      legend(c, label, dash);
    }
  });
  return g;
}

// What each logged key is, in words; a key not named here is charted under its own name.
const METRIC_NAMES = {
  "train/loss": "loss", "train/kl": "KL to the reference", "train/grad_norm": "gradient norm", "train/entropy": "entropy",
  "train/clip_frac": "clip fraction", "train/zero_variance_frac": "zero-variance groups (fraction)",
  "train/logprob_gap": "logprob gap (trainer − sampler)", "train/lr": "learning rate", "tokens_per_completion": "tokens per completion",
  "rollout/completion_tokens": "completion tokens (all calls)", "time/collect_s": "collect seconds", "time/update_s": "update seconds",
  "time/hotload_s": "hot-load seconds", "rollout/transitions": "transitions (trained calls)", "rollout/rollouts": "rollouts", "rollout/failed": "failed rollouts",
  "rollout/failed_trained": "failed rollouts trained on (rollout.failed_reward)", "time/elapsed_s": "elapsed seconds",
  "train/ratio": "importance ratio (mean)", "train/adv_mean": "advantage mean", "train/adv_std": "advantage std",
  "train/num_transitions": "calls trained", "train/num_tokens": "completion tokens trained",
  "train/num_input_tokens": "tokens the update reads (prompt + completion)", "train/episode_reward_mean": "episode reward of the trained calls",
  "train/shaping_mean": "intermediate rewards (mean)", "train/num_skipped": "calls left out (no baseline or no signal)",
  "train/skipped_steps": "optimizer steps skipped (non-finite gradient)", "train/num_masked_truncated": "calls masked as truncated",
  "train/dual_clip_frac": "dual-clip fraction", "train/is_weight": "importance-sampling weight (sampler)", "train/step": "optimizer steps",
  "train/seconds": "trainer seconds", "train/max_memory_allocated": "peak GPU memory (bytes)",
};
// A key not named above, in words all the same: "train/foo_bar" -> "foo bar".
const readable = (k) => METRIC_NAMES[k] || k.replace(/^(train|rollout|time|eval)\//, "").replace(/[/_]/g, " ");
const FIRST = ["train/loss", "train/kl", "train/grad_norm", "train/entropy", "train/clip_frac", "train/zero_variance_frac",
  "train/logprob_gap", "tokens_per_completion", "time/collect_s", "time/update_s", "time/hotload_s"];
// metric_names.group names each key's section (the summary's `sections`): what comes before its "/"
const SECTIONS = [["train", "The update"], ["rollout", "Collection"], ["time", "Time"], ["eval", "Eval"], ["policy", "Per policy"]];

// One chart per numeric key of the metrics rows (reward_mean and reward_std are the reward chart above), plus
// tokens per completion; with [policies], a policy's keys (rollout/transitions/<p>, train/<p>/<key>) share one chart.
function chartSpecs(runs) {
  const specs = new Map();
  const policies = new Set(runs.flatMap((r) => r.policies || []));
  const spec = (id, title, section) => specs.get(id) || specs.set(id, { id, title, section, series: [] }).get(id);
  runs.forEach((r, n) => {
    const keys = new Set();
    r.history.forEach((h) => Object.entries(h).forEach(([k, v]) => { if (typeof v === "number") keys.add(k); }));
    if (keys.has("rollout/completion_tokens") && keys.has("rollout/transitions")) keys.add("tokens_per_completion");
    for (const k of keys) {
      if (k === "iteration" || k === "rollout/reward_mean" || k === "rollout/reward_std") continue;
      const value = k === "tokens_per_completion" ? (h) => (h["rollout/transitions"] ? h["rollout/completion_tokens"] / h["rollout/transitions"] : null) : (h) => h[k];
      const t = k.match(/^rollout\/transitions\/(.+)$/), p = k.match(/^train\/([^/]+)\/(.+)$/);
      let s, label = runs.length > 1 ? r.name : k;
      if (t && policies.has(t[1])) { s = spec("rollout/transitions/*", "transitions per policy", "policy"); label = `${runs.length > 1 ? r.name + " " : ""}${t[1]}`; }
      else if (p && policies.has(p[1])) { s = spec(`train/*/${p[2]}`, `${readable("train/" + p[2])} per policy`, "policy"); label = `${runs.length > 1 ? r.name + " " : ""}${p[1]}`; }
      else s = spec(k, readable(k), (r.sections || {})[k] || "rollout");
      s.series.push({ label, run: n, value, xs: r.history.map((h) => h.iteration) });
    }
  });
  const rank = (id) => (FIRST.includes(id) ? FIRST.indexOf(id) : FIRST.length);
  return [...specs.values()].sort((a, b) => rank(a.id) - rank(b.id) || a.id.localeCompare(b.id));
}

function smallChart(spec, runs, smoothing) {
  const lines = spec.series.map((s, n) => {
    const raw = runs[s.run].history.map((h) => { const v = s.value(h); return finite(v) ? v : null; });
    return { ...s, raw, smooth: ema(raw, smoothing), c: color(spec.series.length > runs.length ? n : s.run) };
  });
  // a series' band (mean ± standard error): [low, high] per row, drawn under its line
  const bands = lines.map((l) => (l.band ? runs[l.run].history.map((h) => l.band(h)) : []));
  const all = [...lines.flatMap((l) => l.raw.filter(finite)), ...bands.flat(2).filter(finite)];
  const xs = lines.flatMap((l) => l.xs.filter(finite));
  const scale = all.length ? niceScale(Math.min(...all), Math.max(...all)) : niceScale(0, 1), lo = scale.lo, hi = scale.hi;
  const W = 420, H = 170, L = scale.width, R = 10, T = 10, B = 22;
  const x0 = xs.length ? Math.min(...xs) : 0, x1 = xs.length ? Math.max(...xs, x0 + 1) : 1;
  const x = (i) => L + ((i - x0) / (x1 - x0)) * (W - L - R);
  const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": spec.title });
  axes(g, { W, H, L, R, T, B, scale, x0, x1, x, y });
  lines.forEach((l, n) => {
    const pts = l.xs.map((i, k) => [i, ...(bands[n][k] || [])]).filter((p) => finite(p[1]) && finite(p[2]));
    if (pts.length) g.append(svg("path", { class: "band", fill: l.c, d: pathOf([...pts.map(([i, , top]) => [x(i), y(top)]), ...pts.map(([i, bottom]) => [x(i), y(bottom)]).reverse()]) + "Z" }));
  });
  for (const l of lines) {
    if (smoothing > 0) for (const seg of segments(l.xs, l.raw)) g.append(svg("path", { class: "raw", stroke: l.c, d: pathOf(seg.map(([i, v]) => [x(i), y(v)])) }));
    for (const seg of segments(l.xs, l.smooth)) g.append(svg("path", { class: "line", stroke: l.c, d: pathOf(seg.map(([i, v]) => [x(i), y(v)])) }));
    l.xs.forEach((i, k) => { if (finite(l.raw[k])) g.append(svg("circle", { fill: l.c, cx: x(i), cy: y(l.raw[k]), r: 2 }, svg("title", {}, `${l.label} ${spec.x || "iteration"} ${i}: ${sig(l.raw[k])}`))); });
  }
  const legend = lines.length > 1 ? el("div", { class: "legend" }, lines.map((l) => el("span", { class: "key", "data-color": l.c }, svgSwatch(l.c), l.label))) : null;
  return el("div", { class: "chart", "data-key": spec.id }, el("div", { class: "title", title: spec.id }, spec.title), g, legend);
}

function svgSwatch(c) {
  return svg("svg", { width: 14, height: 8, class: "swatch" }, svg("line", { x1: 0, x2: 14, y1: 4, y2: 4, stroke: c, "stroke-width": 3 }));
}

// The grid of metric charts, by section, with the smoothing control; `state.smoothing` survives redraws.
// A chart for each metric that moved; one that never changed is said in a line (its value), one never measured
// (no finite value) is left out.
function metricCharts(runs, state, redraw) {
  const all = chartSpecs(runs), constants = [];
  const specs = all.filter((s) => {
    const values = s.series.flatMap((l) => runs[l.run].history.map(l.value).filter(finite));
    if (values.length && values.every((v) => v === values[0])) constants.push([s, values[0]]);
    return new Set(values).size > 1;
  });
  if (!specs.length && !constants.length) return null;
  const slider = el("input", { type: "range", name: "smoothing", min: 0, max: 0.95, step: 0.05, value: state.smoothing });
  const shown = el("span", { class: "muted" }, state.smoothing.toFixed(2));
  slider.addEventListener("input", () => { state.smoothing = Number(slider.value); shown.textContent = state.smoothing.toFixed(2); redraw(); });
  return el("div", { class: "metrics" },
    el("div", { class: "filters" }, el("label", {}, "smoothing (moving average)", slider), shown),
    SECTIONS.map(([id, title]) => {
      const mine = specs.filter((s) => s.section === id);
      return mine.length ? [el("h4", {}, title), el("div", { class: "charts" }, mine.map((s) => smallChart(s, runs, state.smoothing)))] : null;
    }),
    constants.length ? el("p", { class: "constants" }, el("b", {}, "The same every iteration: "),
      constants.map(([s, v], i) => [i ? " · " : "", el("span", { class: "constant", "data-key": s.id, title: s.id }, `${s.title} ${sig(v)}`)])) : null);
}

// [header, class, cell of a history row]; a compact table (two runs side by side) keeps the marked ones
const num1 = (v) => num(v, 1);
const ITER_COLS = [
  ["iter", "", (h) => h.iteration, true], ["policy", "l", (h) => h.policy, true],
  ["reward", "", (h) => num(h["rollout/reward_mean"]), true], ["± std", "", (h) => num(h["rollout/reward_std"])],
  ["rollouts", "", (h) => h["rollout/rollouts"]], ["failed", "", (h) => h["rollout/failed"], true], ["transitions", "", (h) => h["rollout/transitions"]],
  ["tokens", "", (h) => h["rollout/completion_tokens"] ?? ""], ["loss", "", (h) => sig(h["train/loss"]), true],
  ["KL", "", (h) => sig(h["train/kl"]), true], ["logprob gap", "", (h) => sig(h["train/logprob_gap"])],
  ["grad norm", "", (h) => sig(h["train/grad_norm"])], ["collect s", "", (h) => num1(h["time/collect_s"]), true],
  ["update s", "", (h) => num1(h["time/update_s"]), true], ["hot-load s", "", (h) => num(h["time/hotload_s"], 2)],
];

// trainedOn(iteration): show the rollouts that iteration's update (its checkpoint) trained on; absent when compact
function iterationTable(s, compact, trainedOn) {
  const link = (h) => (h.checkpoint ? el("a", { href: "#", class: "trained-on", title: "the rollouts this checkpoint's update trained on", onclick: (e) => { e.preventDefault(); trainedOn(h.iteration); } }, h.checkpoint) : "");
  // a column no iteration has a value for (KL with train.beta = 0: never measured) is left out; the first two
  // stay (an eval row writes its label there)
  const any = (cell) => s.history.some((h) => { const v = cell(h); return v !== "" && v !== null && v !== undefined; });
  const cols = [...ITER_COLS.filter((c) => (!compact || c[3]) && (!s.history.length || ["iter", "policy", "reward"].includes(c[0]) || any(c[2]))), ...(trainedOn ? [["checkpoint", "l", link]] : [])];
  const evalRow = (e) => el("tr", { class: "eval", "data-iteration": e.iteration }, cols.map(([name], i) => el("td", { class: i === 1 ? "l words" : "" },
    i === 0 ? "eval" : i === 1 ? `${e.words}, ${e.label}` :
      name === "reward" ? [num(e.mean), finite(e.stderr) ? el("span", { class: "stderr", title: "standard error" }, ` ± ${num(e.stderr)}`) : null] :
        name === "rollouts" ? (e.running ? `${e.finished} + ${e.running} running` : e.tasks ?? "") : "")));
  const rows = [
    ...s.evals.filter((e) => e.iteration === 0).map(evalRow),
    ...s.history.map((h) => el("tr", {}, cols.map(([, cls, cell]) => el("td", { class: cls }, cell(h))))),
    ...s.evals.filter((e) => e.iteration !== 0).map(evalRow),
  ];
  return el("div", {}, rows.length ? table(cols, rows) : null,
    s.history.length ? null : el("p", { class: "muted" }, "No iteration finished yet."));
}

function outcomeBadge(o) {
  // a running run's badge is the live one (it is polled)
  return o ? el("span", { class: `badge outcome ${o.status}${o.status === "running" ? " live" : ""}`, title: o.reason || "" }, o.status) : null;
}

function countsLine(s) {
  const c = s.counts, o = s.outcome;
  return el("div", { class: "counts" },
    el("p", {}, el("span", { class: "k" }, "run "), outcomeBadge(o),
      o && o.reason && o.status !== "finished" ? el("span", { class: `reason ${o.status}` }, ` ${o.reason}`) : null),
    el("p", {}, el("span", { class: "k" }, "rollouts: "), Object.entries(c).map(([k, v], i) => [i ? ", " : "", badge(k), ` ${v}`])));
}

// The run's effective configuration, as a table of dotted keys; `filterBox` narrows it by key or value.
function configCard(s) {
  if (!s.config) return el("p", { class: "muted" }, "No configuration recorded: the run has no config.json and no lightning.toml beside it names it.");
  const rows = Object.entries(s.config).map(([k, v]) => el("tr", { "data-key": k }, el("td", { class: "l" }, k), el("td", { class: "l" }, text(v))));
  const box = el("input", { type: "search", name: "config-filter", placeholder: "filter keys" });
  box.addEventListener("input", () => rows.forEach((r) => { r.hidden = !r.textContent.toLowerCase().includes(box.value.toLowerCase()); }));
  return el("details", { class: "card config" }, el("summary", {}, `Configuration: ${rows.length} values, defaults included, from ${s.config_source}`),
    box, table([["key", "l"], ["value", "l"]], rows));
}

// The list's state as it goes into the address (and back): only what differs from the default.
const LIST_DEFAULTS = { store: "", status: "", phase: "", component: "", min_reward: "", max_reward: "", iteration: "", q: "", sort: "started", desc: "1", offset: "0" };
function listState(query) {
  const out = {};
  for (const [k, d] of Object.entries(LIST_DEFAULTS)) out[k] = query.get(k) ?? d;
  return out;
}

// [header, class, sort key, cell]: every column sorts (trained into follows the iteration it was collected in)
function rolloutCols(run, store) {
  return [
    ["rollout", "l", "rollout", (r) => el("a", { href: rolloutHref(run, r.rollout_id, store) }, r.rollout_id)],
    ["task", "l preview", "task", (r) => r.task_preview],
    ["output", "l preview", "output", (r) => r.output_preview],
    ["phase", "l", "phase", (r) => r.phase], ["iter", "", "iteration", iterLabel],
    ["status", "l", "status", (r) => badge(r.status)], ["reward", "", "reward", (r) => num(r.reward)],
    ["LLM calls", "", "calls", (r) => r.calls], ["spans", "", "spans", (r) => r.spans],
    ["seconds", "", "seconds", (r) => num(r.seconds, 2)], ["model", "l", "model", (r) => r.model ?? ""],
    ["trained into", "l", "iteration", (r) => r.checkpoint ?? ""], ["error", "l err", "error", (r) => r.error ?? ""],
  ];
}

// The stores `lightning eval` kept in the run's evals/: each one's score, and its rollouts a click away.
function evalStores(s, browse) {
  if (!s.eval_stores.length) return null;
  return el("div", { class: "eval-stores" }, el("h3", {}, `Evals of this run's checkpoints (lightning eval): ${s.eval_stores.length}`),
    table([["file", "l"], ["iteration"], ["score", "l"], ["mean"], ["± stderr"], ["tasks"], ["", "l"]],
      s.eval_stores.map((e) => el("tr", { "data-store": e.name },
        el("td", { class: "l" }, `evals/${e.name}`), el("td", {}, e.iteration), el("td", { class: "l" }, e.words),
        el("td", {}, num(e.mean)), el("td", { class: "stderr" }, finite(e.stderr) ? `± ${num(e.stderr)}` : ""),
        el("td", {}, e.running ? `${e.tasks} + ${e.running} running` : e.tasks),
        el("td", { class: "l" }, el("a", { href: "#", class: "browse", onclick: (ev) => { ev.preventDefault(); browse(e.name); } }, "its rollouts"))))));
}

// A `lightning serve` directory's versions: each update's candidate, the gate's numbers, its canary's, what became of
// it and when, and the live reward of each version that served (mean ± standard error over rewarded episodes).
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
const liveText = (l) => (l ? `${num(l.mean)}${finite(l.stderr) ? ` ± ${num(l.stderr)}` : ""} (${l.episodes} episode${l.episodes === 1 ? "" : "s"})` : "no reward yet");
const bound = (e) => `${num(e.mean_difference, 4)} ± ${num(e.stderr, 4)} (se), lower bound ${num(e.lower_bound, 4)} ${e.promoted ? "≥" : "<"} −margin ${num(-e.margin, 4)}`;
function gateText(g) {
  if (!g) return "";
  if (!finite(g.mean_difference)) return [badge(g.promoted ? "promoted" : "rejected"), ` ${g.reason}`];
  return [badge(g.promoted ? "passed" : "rejected"), ` ${bound(g)} over ${g.tasks} eval tasks (${num(g.candidate_mean)} against ${num(g.serving_mean)} for ${g.serving})`];
}
function canaryText(c) {
  if (!c) return "";
  if (c.promoted === undefined) return [badge("running"), ` on ${Math.round(c.share * 100)}% of new episodes since ${when(c.started_at)}`];
  return [badge(c.promoted ? "promoted" : "rolled back"), ` live ${bound(c)}: ${c.canary_rewards} against ${c.serving_rewards} rewarded episodes (${num(c.canary_mean)} against ${num(c.serving_mean)}), ${Math.round(c.share * 100)}% of new episodes`];
}
function versionsCard(v) {
  const served = v.versions.filter((r) => r.live);
  const chart = served.length ? smallChart({ id: "live", x: "version", title: `live ${v.reward_name} by version: mean ± standard error over rewarded episodes`,
    series: [{ label: "live reward", run: 0, value: (h) => h.live.mean, band: (h) => (finite(h.live.stderr) ? [h.live.mean - h.live.stderr, h.live.mean + h.live.stderr] : []), xs: served.map((r) => r.version) }] },
  [{ history: served }], 0) : null;
  return el("div", { class: "card versions" },
    el("h3", {}, `Versions (lightning serve): ${v.versions.length}`),
    el("p", {}, "serving now: ", el("b", { id: "serving" }, v.serving ?? (v.versions[0] ? v.versions[0].adapter : "the base model"))),
    table([["version"], ["adapter", "l"], ["outcome", "l"], [`live ${v.reward_name}`, "l"], ["gate (eval tasks)", "l"], ["canary (live)", "l"], ["trained on"], ["made", "l"], ["decided", "l"]],
      v.versions.map((r) => el("tr", { "data-version": r.version, "data-adapter": r.adapter },
        el("td", {}, r.version), el("td", { class: "l" }, r.adapter), el("td", { class: "l outcome" }, r.outcome),
        el("td", { class: "l live", "data-episodes": r.live ? r.live.episodes : 0 }, liveText(r.live)),
        el("td", { class: "l gate" }, gateText(r.gate)), el("td", { class: "l canary" }, canaryText(r.canary)),
        el("td", {}, r.calls === null ? "" : `${r.calls} calls, ${r.rewards} rewards` + (r.parent === null ? "" : `, from v${r.parent}`)),
        el("td", { class: "l" }, when(r.made_at)), el("td", { class: "l" }, when(r.decided_at))))),
    chart);
}

function runView(main, run, query) {
  const filters = listState(query);
  const state = { smoothing: 0 };
  const head = el("div"), chart = el("div", { class: "card" }), charts = el("div"), config = el("div"), iters = el("div"), list = el("div");
  const evals = el("div"), versions = el("div");
  const comp = el("select", { name: "component" }, el("option", { value: "" }, "any"));
  const stores = el("select", { name: "store" }, el("option", { value: "" }, "the run's (store.sqlite)"));
  const controls = {};
  // A change of the list's state is a new history entry: Back returns to the list as it was.
  const push = () => {
    const q = new URLSearchParams();
    for (const [k, d] of Object.entries(LIST_DEFAULTS)) if (String(filters[k]) !== d) q.set(k, filters[k]);
    const target = href("run", run) + (q.toString() ? "?" + q : "");
    if (location.hash !== target) history.pushState(null, "", target);
    tick();
  };
  const field = (name, node) => {
    controls[name] = node;
    node.addEventListener("change", () => { filters[name] = node.value; filters.offset = "0"; push(); });
    return node;
  };
  const choose = (name, values) => field(name, el("select", { name }, el("option", { value: "" }, "any"), values.map((v) => el("option", { value: v }, v))));
  const box = (name, ph) => field(name, el("input", { name, type: "number", step: "any", placeholder: ph }));
  const search = field("q", el("input", { name: "q", type: "search", placeholder: "task or output text", class: "search" }));
  let typing = null; // search as one types, once a pause says the word is whole
  search.addEventListener("input", () => { clearTimeout(typing); typing = setTimeout(() => { if (filters.q !== search.value) { filters.q = search.value; filters.offset = "0"; push(); } }, 300); });
  const bar = el("div", { class: "filters" },
    el("label", {}, "rollouts of", field("store", stores)),
    el("label", {}, "search", search),
    el("label", {}, "status", choose("status", ["succeeded", "failed", "abandoned", "running", "untrained"])),
    el("label", {}, "phase", choose("phase", ["train", "eval"])),
    el("label", {}, "component", field("component", comp)),
    el("label", {}, "min reward", box("min_reward", "≥")), el("label", {}, "max reward", box("max_reward", "≤")),
    el("label", {}, "iteration", box("iteration", "from 1")));
  // the component and store lists come with the summary: a value they do not hold yet is set when they do
  const has = (select, v) => [...select.options].some((o) => o.value === v);
  const showControls = () => { for (const [k, c] of Object.entries(controls)) if ((c !== comp && c !== stores) || has(c, filters[k])) c.value = filters[k]; };
  showControls();
  fill(main, el("p", {}, el("a", { href: "#/" }, "← runs")), head, versions, chart, charts, config, el("h3", {}, "Iterations"), iters,
    evals, el("h3", {}, "Rollouts"), bar, list);
  let components = "", storeNames = "";
  const browse = (name) => {
    Object.assign(filters, { ...LIST_DEFAULTS, store: name });
    showControls();
    push();
  };
  const changed = differ();
  let summary = null;
  const drawCharts = () => {
    chart.hidden = Boolean(summary.serve) && !summary.history.length; // a serve directory: no iterations
    fill(chart, el("b", {}, "Reward per iteration"), el("br"), rewardChart([{ name: run, history: summary.history, evals: summary.evals, range: summary.reward_range }], state.smoothing));
    fill(charts, metricCharts([{ name: run, history: summary.history, policies: summary.policies, sections: summary.sections }], state, drawCharts));
  };
  // What checkpoint iter-N trained on: iteration N's succeeded train rollouts (train/checkpoint.trained_into).
  const trainedOn = (n) => {
    Object.assign(filters, { status: "succeeded", phase: "train", iteration: String(n), offset: "0" });
    showControls();
    push();
  };
  const sortBy = (key) => {
    filters.desc = filters.sort === key ? (filters.desc === "1" ? "0" : "1") : "1";
    filters.sort = key;
    filters.offset = "0";
    push();
  };
  return {
    restore(q) { Object.assign(filters, listState(q)); showControls(); },
    async refresh() {
      const params = { ...filters, desc: filters.desc === "1" ? "true" : "false" };
      const [s, page] = await Promise.all([api("summary", { run }), api("rollouts", { run, limit: PAGE, ...params })]);
      if (!changed([s, page, filters])) return;
      const fresh = JSON.stringify(s) !== JSON.stringify(summary);
      summary = s;
      if (fresh) {
        fill(head, el("h2", {}, run), el("div", { class: "muted" }, s.path), countsLine(s));
        drawCharts();
        fill(config, configCard(s));
        fill(iters, iterationTable(s, false, trainedOn));
        fill(evals, evalStores(s, browse));
        fill(versions, s.serve ? versionsCard(s.serve) : null);
      }
      if (components !== JSON.stringify(s.components)) {
        components = JSON.stringify(s.components);
        fill(comp, el("option", { value: "" }, "any"), s.components.map((c) => el("option", { value: c, selected: c === filters.component }, c)));
      }
      const names = [...new Set(s.eval_stores.map((e) => e.name))];
      if (storeNames !== JSON.stringify(names)) {
        storeNames = JSON.stringify(names);
        fill(stores, el("option", { value: "" }, "the run's (store.sqlite)"), names.map((n) => el("option", { value: n, selected: n === filters.store }, `evals/${n}`)));
      }
      const go = (d) => { filters.offset = String(Math.max(0, Number(filters.offset) + d)); push(); };
      const cols = rolloutCols(run, filters.store);
      const arrow = (key) => (filters.sort === key ? (filters.desc === "1" ? " ▼" : " ▲") : "");
      fill(list,
        el("div", { class: "scroll" }, el("table", { class: "rollouts" },
          el("thead", {}, el("tr", {}, cols.map(([h, cls, key]) => el("th", { class: `${cls} sortable`, "data-sort": key, title: `sort by ${h}`, onclick: () => sortBy(key) }, h + arrow(key))))),
          el("tbody", {}, page.rows.map((r) => el("tr", { class: "click", "data-rollout": r.rollout_id, onclick: (e) => { if (e.target.tagName !== "A") location.hash = rolloutHref(run, r.rollout_id, filters.store); } },
            cols.map(([h, cls, , cell]) => el("td", { class: cls, title: h === "error" ? r.error ?? "" : h === "task" ? r.task_preview : h === "output" ? r.output_preview : null }, cell(r)))))))),
        el("div", { class: "pager" },
          el("button", { disabled: Number(filters.offset) === 0, onclick: () => go(-PAGE) }, "← previous"),
          el("span", { class: "muted" }, page.total ? `${page.offset + 1}–${page.offset + page.rows.length} of ${page.total}` : "no rollout matches"),
          el("button", { disabled: page.offset + page.rows.length >= page.total, onclick: () => go(PAGE) }, "next →")));
    },
  };
}

// ------------------------------------------------------------------------------------------------ one rollout

function messagesBlock(title, msgs) {
  // gen_ai message parts: text parts as their text, anything else (tool calls, images) as its JSON
  const partText = (p) => (p.type === "text" || (p.type === undefined && typeof p.content === "string") ? text(p.content ?? "") : text(p));
  return el("div", {}, el("div", { class: "muted" }, title), (msgs || []).map((m) => el("div", { class: `msg ${m.role}` },
    el("div", { class: "role" }, m.role ?? "?"),
    (Array.isArray(m.parts) ? m.parts : [{ content: m.content ?? "" }]).map((p) => el("pre", {}, partText(p))))));
}

function kv(obj) {
  const entries = Object.entries(obj || {});
  if (!entries.length) return null;
  return el("div", { class: "kv" }, entries.map(([k, v]) => [el("span", { class: "k" }, k), el("span", {}, text(v))]));
}

function spanCard(s) {
  const err = s.status === "ERROR";
  const head = el("div", { class: "head" }, el("b", {}, s.kind === "llm" ? "LLM call" : s.kind === "reward" ? "reward" : s.kind === "tool" ? "tool" : "span"),
    el("span", {}, s.name), s.component ? el("span", { class: "badge" }, s.component) : null,
    s.kind === "llm" ? el("span", {}, `${s.prompt_tokens ?? "?"} → ${s.completion_tokens ?? "?"} tokens`) : null,
    el("span", { class: "muted" }, `at +${ms(s.start_ms)}, took ${ms(s.duration_ms)}`),
    s.kind === "llm" ? el("span", { class: "credited" }, s.credited_reward === null || s.credited_reward === undefined ? "not credited" : `credited reward ${num(s.credited_reward)}`) : null,
    s.kind === "reward" ? el("span", {}, `${s.reward_name} = ${num(s.reward_value)}`) : null,
    err ? badge("ERROR") : null, s.model ? el("span", { class: "muted" }, s.model) : null);
  const body = [];
  const raised = (s.events || []).map((e) => e.attributes || {}).filter((a) => a["exception.message"] !== undefined);
  // The status message is usually "Type: message" of the exception event below; show it once.
  if (err && s.status_message && !raised.some((a) => s.status_message === `${a["exception.type"]}: ${a["exception.message"]}`))
    body.push(el("pre", { class: "errtext" }, s.status_message));
  if (s.kind === "llm") body.push(advantageBox(s.advantage), constraintBox(s.constraint), el("div", { class: "cols" }, messagesBlock("prompt", s.input), messagesBlock("completion", s.output)), logprobStrip(s));
  for (const e of s.events || []) {
    const a = e.attributes || {};
    body.push(el("div", { class: e.name === "exception" ? "errtext" : "" }, el("div", {}, `event: ${e.name}`),
      a["exception.type"] || a["exception.message"] ? el("pre", {}, `${a["exception.type"] ?? ""}: ${a["exception.message"] ?? ""}`) : kv(a),
      a["exception.stacktrace"] ? el("details", {}, el("summary", {}, "stack trace"), el("pre", {}, a["exception.stacktrace"])) : null));
  }
  if (s.kind !== "reward") {
    const attrs = kv(s.attributes);
    // a tool's attributes are its input and output: open; an LLM call's are the instrumentor's details
    if (attrs) body.push(el("details", { open: s.kind !== "llm" }, el("summary", { class: "muted" }, "attributes"), attrs));
  }
  return el("div", { class: `card span ${s.kind}${err ? " error" : ""}`, id: `span-${s.span_id}`, "data-kind": s.kind }, head, body);
}

// How the call's advantage was made: the sentence, then its numbers (the trainer's, from lightning_sdk.advantage).
function advantageBox(a) {
  if (!a) return el("div", { class: "advantage muted" }, "Not trained on: no advantage.");
  const cell = (k, label, v) => [el("span", { class: "k" }, label), el("span", { "data-field": k, "data-value": v }, v === null || v === undefined ? "none" : sig(v))];
  return el("div", { class: "advantage" }, el("p", { class: "adv-sentence" }, a.sentence),
    el("div", { class: "kv" }, cell("value", "advantage trained with", a.value), cell("outcome", "outcome (rollout reward)", a.outcome),
      cell("group_mean", "group mean", a.group_mean), cell("group_std", "group std", a.group_std), cell("group_size", "rollouts in group", a.group_size),
      cell("divisor", "divided by", a.divisor), cell("rollout_advantage", "rollout advantage", a.rollout_advantage),
      cell("credit", "credit weight", a.credit), cell("shaping", "intermediate rewards", a.shaping), cell("shaping_term", "shaping term", a.shaping_term)));
}

// The grammar a constrained call was sampled under (its log-probs are renormalised over what it allowed).
function constraintBox(c) {
  if (!c) return null;
  return el("div", { class: "constraint", "data-constraint": c.label }, el("span", { class: "badge" }, `constrained: ${c.label}`),
    el("span", { class: "muted" }, ` from ${c.param}; sampled and trained over the tokens it allowed`),
    el("details", {}, el("summary", { class: "muted" }, "constraint"), el("pre", {}, c.spec)));
}

// The completion's tokens, each coloured by the probability the sampler gave it; hover for the token and its log-prob.
function logprobStrip(s) {
  const lps = s.completion_logprobs, ids = s.completion_ids || [], texts = s.completion_token_texts;
  if (!lps || !lps.length) return el("div", { class: "muted" }, "No per-token log-probs recorded for this call.");
  return el("div", {}, el("div", { class: "muted" }, `per-token log-probs: ${lps.length} tokens, darker = less likely`),
    el("div", { class: "logprobs" }, lps.map((lp, i) => {
      const tok = texts ? texts[i] : `#${ids[i]}`;
      const p = Math.exp(lp);
      return el("span", { class: `tok p${Math.min(9, Math.floor(p * 10))}`, title: `token ${JSON.stringify(tok)} (id ${ids[i]}): logprob ${lp.toFixed(4)}, p ${p.toFixed(3)}`, "data-logprob": lp },
        tok === "" ? "∅" : tok.replace(/\n/g, "⏎"));
    })));
}

// The credit settings as one sentence.
function creditLine(c) {
  const scale = c.scale === "group" ? "divided by their group's std" : c.scale === "batch" ? "divided by the batch's std" : "not divided";
  return `${c.note}. Credit rule ${c.rule}, each failed span after a call costs ${c.error_reward}, advantages ${scale}; ` +
    `these settings come from ${c.source}.`;
}

// The other rollouts of its group (same task, same iteration) with their rewards and outputs, side by side.
function groupCard(run, d, store) {
  if (!d.group.length) return null;
  return el("div", {}, el("h3", {}, `Its group: ${d.group.length} rollout(s) of this task`),
    el("div", { class: "group" }, d.group.map((g) => el("div", { class: `card member${g.self ? " self" : ""}`, "data-rollout": g.rollout_id },
      el("div", { class: "head" }, g.self ? el("b", {}, "this rollout") : el("a", { href: rolloutHref(run, g.rollout_id, store) }, g.rollout_id), " ", badge(g.status)),
      el("div", { class: "kv" }, el("span", { class: "k" }, "reward"), el("span", { "data-field": "reward" }, g.reward === null ? "none" : num(g.reward)),
        el("span", { class: "k" }, "rollout advantage"), el("span", { "data-field": "rollout_advantage", "data-value": g.rollout_advantage }, g.rollout_advantage === null || g.rollout_advantage === undefined ? "none" : sig(g.rollout_advantage))),
      el("pre", { class: "out" }, g.output ?? "")))));
}

function timeline(spans) {
  const W = 900, row = 16, L = 170, H = spans.length * row + 22;
  const end = Math.max(1, ...spans.map((s) => s.start_ms + s.duration_ms));
  const x = (t) => L + (t / end) * (W - L - 10);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "timeline" });
  spans.forEach((s, i) => {
    const yy = i * row + 4;
    g.append(svg("text", { x: 4, y: yy + 10 }, `${s.kind === "llm" ? "LLM" : s.kind} ${s.name}`.slice(0, 28)));
    const bar = svg("rect", { class: s.status === "ERROR" ? "error" : s.kind, x: x(s.start_ms), y: yy, height: row - 4, rx: 2,
      width: Math.max(2, x(s.start_ms + s.duration_ms) - x(s.start_ms)) }, svg("title", {}, `${s.name}: ${ms(s.duration_ms)}`));
    bar.addEventListener("click", () => document.getElementById(`span-${s.span_id}`)?.scrollIntoView({ behavior: "smooth" }));
    g.append(bar);
  });
  g.append(svg("text", { x: L, y: H - 4 }, "0"), svg("text", { x: W - 10, y: H - 4, "text-anchor": "end" }, ms(end)));
  return g;
}

// `store`: the name of one of the run's evals/ stores, or "" for the run's own.
function rolloutView(main, run, id, store) {
  const changed = differ();
  return {
    async refresh() {
      const d = await api("rollout", { run, id, store });
      if (!changed(d)) return;
      const r = d.rollout;
      fill(main,
        el("p", {}, el("a", { href: href("run", run) + (store ? "?" + new URLSearchParams({ store }) : "") }, `← ${run}`)),
        el("h2", {}, `rollout ${r.rollout_id}`),
        store ? el("p", { class: "muted", id: "store" }, `from evals/${store}, kept by lightning eval`) : null,
        el("div", { class: "card" }, el("div", { class: "kv" },
          el("span", { class: "k" }, "status"), el("span", {}, badge(r.status)),
          el("span", { class: "k" }, "reward"), el("span", { id: "reward" }, r.reward === null ? "none" : num(r.reward)),
          el("span", { class: "k" }, "phase / iteration"), el("span", {}, `${r.phase} / ${iterLabel(r)}`),
          el("span", { class: "k" }, "attempt"), el("span", {}, r.attempt),
          el("span", { class: "k" }, "model"), el("span", {}, r.model ?? ""),
          el("span", { class: "k" }, "seconds"), el("span", {}, num(r.seconds, 2)),
          el("span", { class: "k" }, "credit"), el("span", { id: "credit" }, creditLine(d.credit))),
          el("h3", {}, "task"), el("pre", {}, text(d.task)),
          d.expected ? [el("h3", {}, `expected answer (the task's ${d.expected.field})`), el("pre", { id: "expected" }, text(d.expected.value))] : null,
          el("h3", {}, "output"), el("pre", { id: "output" }, text(r.output)),
          r.error ? [el("h3", { class: "errtext" }, "error"), el("pre", { class: "errtext" }, r.error)] : null,
          r.traceback ? el("details", {}, el("summary", {}, "traceback"), el("pre", {}, r.traceback)) : null),
        groupCard(run, d, store),
        el("h3", {}, `Timeline: ${d.spans.length} span(s)`),
        d.spans.length ? el("div", { class: "card scroll" }, timeline(d.spans)) : el("p", { class: "muted" }, "No span recorded."),
        el("div", { id: "spans" }, d.spans.map(spanCard)));
    },
  };
}

// ------------------------------------------------------------------------------------------------ two runs

// Two runs' configurations: the keys whose values differ first, the rest folded away.
function configDiff(a, b, sa, sb) {
  if (!sa.config && !sb.config) return el("p", { class: "muted" }, "Neither run recorded its configuration.");
  const ca = sa.config || {}, cb = sb.config || {};
  const keys = [...new Set([...Object.keys(ca), ...Object.keys(cb)])].sort();
  const show = (c, k) => (k in c ? text(c[k]) : "(not set)");
  const row = (k) => el("tr", { "data-key": k }, el("td", { class: "l" }, k), el("td", { class: "l" }, show(ca, k)), el("td", { class: "l" }, show(cb, k)));
  // run.name and run.dir differ between any two runs: said, but after what was chosen
  const own = (k) => k === "run.name" || k === "run.dir";
  const differ = keys.filter((k) => JSON.stringify(ca[k]) !== JSON.stringify(cb[k]));
  const chosen = differ.filter((k) => !own(k)), same = keys.filter((k) => !differ.includes(k));
  const settings = (n) => `${n} setting${n === 1 ? "" : "s"}`;
  const named = differ.filter(own);
  return el("div", { class: "card" },
    el("b", { class: "diff-count" }, chosen.length ? `${settings(chosen.length)} ${chosen.length === 1 ? "differs" : "differ"}` : "The same settings"),
    chosen.length ? el("div", { class: "config-diff" }, table([["key", "l"], [a, "l"], [b, "l"]], chosen.map(row))) : null,
    named.length ? el("p", { class: "muted own" }, `Besides ${named.join(" and ")}, which differ between any two runs: `,
      named.map((k, i) => [i ? "; " : "", `${k} ${show(ca, k)} / ${show(cb, k)}`])) : null,
    el("details", {}, el("summary", { class: "muted" }, `${settings(same.length)} the same`), table([["key", "l"], [a, "l"], [b, "l"]], same.map(row))));
}

function compareView(main, a, b) {
  const changed = differ();
  const state = { smoothing: 0 };
  const diff = el("div"), top = el("div", { class: "card" }), charts = el("div"), cols = el("div", { class: "cols" });
  fill(main, el("p", {}, el("a", { href: "#/" }, "← runs")), el("h2", {}, `${a}  vs  ${b}`), diff, top, charts, cols);
  let runs = null;
  const drawCharts = () => {
    fill(top, el("b", {}, "Reward per iteration"), el("br"), rewardChart(runs, state.smoothing));
    fill(charts, metricCharts(runs, state, drawCharts));
  };
  return {
    async refresh() {
      const [sa, sb] = await Promise.all([api("summary", { run: a }), api("summary", { run: b })]);
      if (!changed([sa, sb])) return;
      fill(diff, configDiff(a, b, sa, sb));
      runs = [[a, sa], [b, sb]].map(([name, s]) => ({ name, history: s.history, evals: s.evals, policies: s.policies, range: s.reward_range, sections: s.sections }));
      drawCharts();
      fill(cols, [[a, sa], [b, sb]].map(([name, s]) => el("div", { class: "side" },
        el("h3", {}, el("a", { href: href("run", name) }, name)), countsLine(s), iterationTable(s, true))));
    },
  };
}

window.addEventListener("hashchange", route);
document.addEventListener("DOMContentLoaded", () => {
  route();
  setInterval(() => { if (!document.hidden) tick(); }, POLL_MS);
});
