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
const num = (v, d = 3) => (v === null || v === undefined ? "" : Number(v).toFixed(d));
const sig = (v) => (v === null || v === undefined ? "" : String(Number(Number(v).toPrecision(3))));
const ms = (v) => (v === null || v === undefined ? "" : v < 1000 ? `${v.toFixed(1)} ms` : `${(v / 1000).toFixed(2)} s`);
const iterLabel = (r) => (r.phase === "eval" ? (r.iteration === 0 ? "eval before" : "eval after") : r.iteration);
const text = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));

function table(headers, rows) {
  return el("div", { class: "scroll" }, el("table", {},
    el("thead", {}, el("tr", {}, headers.map(([h, cls]) => el("th", { class: cls }, h)))),
    el("tbody", {}, rows)));
}

function badge(status) { return el("span", { class: `badge ${status}` }, status); }

// ------------------------------------------------------------------------------------------------ routing

let current = null; // the view on screen: { refresh }; polled while the page is visible

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  // Each view draws into its own box: a slow answer for a view left behind lands in a detached box.
  const box = el("div");
  fill(document.getElementById("view"), box);
  if (parts[0] === "run" && parts[2] === "rollout") current = rolloutView(box, parts[1], parts[3]);
  else if (parts[0] === "run") current = runView(box, parts[1]);
  else if (parts[0] === "compare") current = compareView(box, parts[1], parts[2]);
  else current = runsView(box);
  current.busy = false;
  tick();
}

async function tick() {
  const view = current;
  if (!view || view.busy) return;
  view.busy = true;
  try {
    await view.refresh();
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
          table([["run", "l"], ["iterations"], ["last reward"], ["rollouts"], ["running"], ["failed"], ["updated", "l"]],
            data.runs.map((r) => el("tr", {},
              el("td", { class: "l" }, el("a", { href: href("run", r.id) }, r.id)),
              el("td", {}, r.iterations), el("td", {}, num(r.last_reward)), el("td", {}, r.rollouts),
              el("td", {}, r.running ? el("span", { class: "badge live" }, `${r.running} live`) : "0"),
              el("td", {}, r.failed),
              el("td", { class: "l" }, r.modified ? new Date(r.modified * 1000).toLocaleString() : "")))),
        ids.length > 1 ? el("div", { class: "filters" }, el("label", {}, "run A", a), el("label", {}, "run B", b),
          el("button", { id: "compare", onclick: () => { location.hash = href("compare", a.value, b.value); } }, "compare side by side")) : null,
      );
    },
  };
}

// ------------------------------------------------------------------------------------------------ one run

function rewardChart(runs) {
  // runs: [{ name, history, evals }]; x counts iterations as the run's table does (1..N), evals at 0 and N.
  const W = 900, H = 260, L = 44, R = 250, T = 14, B = 30;
  const ys = [0, 1];
  let maxX = 1;
  for (const r of runs) {
    r.history.forEach((h) => ys.push(h.reward_mean));
    r.evals.forEach((e) => ys.push(e.mean));
    maxX = Math.max(maxX, r.history.length, ...r.evals.map((e) => e.iteration));
  }
  const lo = Math.min(...ys.filter((v) => v !== null)), hi = Math.max(...ys.filter((v) => v !== null));
  const x = (i) => L + (i / maxX) * (W - L - R);
  const y = (v) => T + (1 - (v - lo) / (hi - lo || 1)) * (H - T - B);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "reward per iteration" });
  for (let k = 0; k <= 4; k++) {
    const v = lo + ((hi - lo) * k) / 4;
    g.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: y(v), y2: y(v) }), svg("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end" }, v.toFixed(2)));
  }
  const step = Math.max(1, Math.ceil(maxX / 10));
  for (let i = 0; i <= maxX; i += step) g.append(svg("text", { x: x(i), y: H - B + 16, "text-anchor": "middle" }, i));
  g.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }), svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  g.append(svg("text", { x: (L + W - R) / 2, y: H - 2, "text-anchor": "middle" }, "iteration"));
  let ly = T + 6;
  const legend = (cls, label, dash) => {
    g.append(svg("line", { class: dash || cls, x1: W - R + 12, x2: W - R + 34, y1: ly, y2: ly }), svg("text", { class: "legend", x: W - R + 40, y: ly + 4 }, label));
    ly += 18;
  };
  runs.forEach((r, n) => {
    const cls = `s${n}`;
    const pts = r.history.map((h, i) => [x(i + 1), y(h.reward_mean)]);
    if (pts.length) g.append(svg("polyline", { class: cls, points: pts.map((p) => p.join(",")).join(" ") }));
    r.history.forEach((h, i) => g.append(svg("circle", { class: cls, cx: x(i + 1), cy: y(h.reward_mean), r: 3 },
      svg("title", {}, `${r.name} iteration ${i + 1}: reward ${num(h.reward_mean)} ± ${num(h.reward_std)}`))));
    legend(cls, runs.length > 1 ? `${r.name}: train reward` : "train rollouts (mean)");
    for (const e of r.evals) {
      if (e.mean === null) continue;
      const c = e.iteration === 0 ? "before" : `after${n ? " s1e" : ""}`;
      g.append(svg("line", { class: c, x1: L, x2: W - R, y1: y(e.mean), y2: y(e.mean) }, svg("title", {}, `${r.name} eval ${e.label}: ${num(e.mean)}`)));
      legend(cls, `${runs.length > 1 ? r.name + " " : ""}eval ${e.iteration === 0 ? "before" : "after"}: ${num(e.mean)}`, c);
    }
  });
  return g;
}

// [header, class, cell of a history row]; a compact table (two runs side by side) keeps the marked ones
const num1 = (v) => num(v, 1);
const ITER_COLS = [
  ["iter", "", (h) => h.iteration, true], ["policy", "l", (h) => h.policy, true],
  ["reward", "", (h) => num(h.reward_mean), true], ["± std", "", (h) => num(h.reward_std)],
  ["rollouts", "", (h) => h.rollouts], ["failed", "", (h) => h.failed, true], ["transitions", "", (h) => h.transitions],
  ["tokens", "", (h) => h.completion_tokens ?? ""], ["loss", "", (h) => sig(h["train.loss"]), true],
  ["KL", "", (h) => sig(h["train.kl"]), true], ["logprob gap", "", (h) => sig(h["train.logprob_gap"])],
  ["grad norm", "", (h) => sig(h["train.grad_norm"])], ["collect s", "", (h) => num1(h.collect_s), true],
  ["update s", "", (h) => num1(h.update_s), true], ["hot-load s", "", (h) => num(h.hotload_s, 2)],
];

// trainedOn(iteration): show the rollouts that iteration's update (its checkpoint) trained on; absent when compact
function iterationTable(s, compact, trainedOn) {
  const link = (h) => (h.checkpoint ? el("a", { href: "#", class: "trained-on", title: "the rollouts this checkpoint's update trained on", onclick: (e) => { e.preventDefault(); trainedOn(h.iteration); } }, h.checkpoint) : "");
  const cols = [...ITER_COLS.filter((c) => !compact || c[3]), ...(trainedOn ? [["checkpoint", "l", link]] : [])];
  const evalRow = (e) => el("tr", { class: "eval" }, cols.map(([name], i) => el("td", { class: i === 1 ? "l" : "" },
    i === 0 ? "eval" : i === 1 ? e.label : name === "reward" ? num(e.mean) :
      name === "rollouts" ? (e.running ? `${e.finished} + ${e.running} running` : e.finished ?? "") : "")));
  const rows = [
    ...s.evals.filter((e) => e.iteration === 0).map(evalRow),
    ...s.history.map((h) => el("tr", {}, cols.map(([, cls, cell]) => el("td", { class: cls }, cell(h))))),
    ...s.evals.filter((e) => e.iteration !== 0).map(evalRow),
  ];
  return el("div", {}, rows.length ? table(cols, rows) : null,
    s.history.length ? null : el("p", { class: "muted" }, "No iteration finished yet."));
}

function countsLine(s) {
  const c = s.counts;
  return el("p", {}, Object.entries(c).map(([k, v]) => [badge(k), ` ${v}  `]),
    c.running ? el("span", { class: "badge live" }, "live") : null);
}

function runView(main, run) {
  const filters = { status: "", phase: "", component: "", min_reward: "", max_reward: "", iteration: "", offset: 0 };
  const head = el("div"), chart = el("div", { class: "card" }), iters = el("div"), list = el("div");
  const comp = el("select", { name: "component" }, el("option", { value: "" }, "any"));
  const controls = {};
  const field = (name, node) => {
    controls[name] = node;
    node.addEventListener("change", () => { filters[name] = node.value; filters.offset = 0; tick(); });
    return node;
  };
  const choose = (name, values) => field(name, el("select", { name }, el("option", { value: "" }, "any"), values.map((v) => el("option", { value: v }, v))));
  const box = (name, ph) => field(name, el("input", { name, type: "number", step: "any", placeholder: ph }));
  const bar = el("div", { class: "filters" },
    el("label", {}, "status", choose("status", ["succeeded", "failed", "abandoned", "running", "untrained"])),
    el("label", {}, "phase", choose("phase", ["train", "eval"])),
    el("label", {}, "component", field("component", comp)),
    el("label", {}, "min reward", box("min_reward", "≥")), el("label", {}, "max reward", box("max_reward", "≤")),
    el("label", {}, "iteration", box("iteration", "from 1")));
  fill(main, el("p", {}, el("a", { href: "#/" }, "← runs")), head, chart, el("h3", {}, "Iterations"), iters,
    el("h3", {}, "Rollouts"), bar, list);
  let components = "";
  const changed = differ();
  // What checkpoint iter-N trained on: iteration N's succeeded train rollouts (train/checkpoint.trained_into).
  const trainedOn = (n) => {
    Object.assign(filters, { status: "succeeded", phase: "train", iteration: String(n), offset: 0 });
    for (const k of ["status", "phase", "iteration"]) controls[k].value = filters[k];
    tick();
  };
  return {
    async refresh() {
      const [s, page] = await Promise.all([api("summary", { run }), api("rollouts", { run, limit: PAGE, ...filters })]);
      if (!changed([s, page, filters])) return;
      fill(head, el("h2", {}, run), el("div", { class: "muted" }, s.path), countsLine(s));
      fill(chart, el("b", {}, "Reward per iteration"), el("br"), rewardChart([{ name: run, history: s.history, evals: s.evals }]));
      fill(iters, iterationTable(s, false, trainedOn));
      if (components !== JSON.stringify(s.components)) {
        components = JSON.stringify(s.components);
        fill(comp, el("option", { value: "" }, "any"), s.components.map((c) => el("option", { value: c, selected: c === filters.component }, c)));
      }
      const go = (d) => { filters.offset = Math.max(0, filters.offset + d); tick(); };
      fill(list,
        table([["rollout", "l"], ["phase", "l"], ["iter"], ["status", "l"], ["reward"], ["LLM calls"], ["spans"], ["seconds"], ["model", "l"], ["trained into", "l"], ["error", "l"]],
          page.rows.map((r) => el("tr", { class: "click", "data-rollout": r.rollout_id, onclick: () => { location.hash = href("run", run, "rollout", r.rollout_id); } },
            el("td", { class: "l" }, el("a", { href: href("run", run, "rollout", r.rollout_id) }, r.rollout_id)),
            el("td", { class: "l" }, r.phase), el("td", {}, iterLabel(r)), el("td", { class: "l" }, badge(r.status)),
            el("td", {}, num(r.reward)), el("td", {}, r.calls), el("td", {}, r.spans), el("td", {}, num(r.seconds, 2)), el("td", { class: "l" }, r.model ?? ""),
            el("td", { class: "l" }, r.checkpoint ?? ""), el("td", { class: "err", title: r.error ?? "" }, r.error ?? "")))),
        el("div", { class: "pager" },
          el("button", { disabled: filters.offset === 0, onclick: () => go(-PAGE) }, "← newer"),
          el("span", { class: "muted" }, page.total ? `${page.offset + 1}–${page.offset + page.rows.length} of ${page.total}` : "no rollout matches"),
          el("button", { disabled: page.offset + page.rows.length >= page.total, onclick: () => go(PAGE) }, "older →")));
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
  if (s.kind === "llm") body.push(el("div", { class: "cols" }, messagesBlock("prompt", s.input), messagesBlock("completion", s.output)));
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

function rolloutView(main, run, id) {
  const changed = differ();
  return {
    async refresh() {
      const d = await api("rollout", { run, id });
      if (!changed(d)) return;
      const r = d.rollout;
      fill(main,
        el("p", {}, el("a", { href: href("run", run) }, `← ${run}`)),
        el("h2", {}, `rollout ${r.rollout_id}`),
        el("div", { class: "card" }, el("div", { class: "kv" },
          el("span", { class: "k" }, "status"), el("span", {}, badge(r.status)),
          el("span", { class: "k" }, "reward"), el("span", { id: "reward" }, r.reward === null ? "none" : num(r.reward)),
          el("span", { class: "k" }, "phase / iteration"), el("span", {}, `${r.phase} / ${iterLabel(r)}`),
          el("span", { class: "k" }, "attempt"), el("span", {}, r.attempt),
          el("span", { class: "k" }, "model"), el("span", {}, r.model ?? ""),
          el("span", { class: "k" }, "seconds"), el("span", {}, num(r.seconds, 2)),
          el("span", { class: "k" }, "credit"), el("span", {}, `${d.credit.note} (rule ${d.credit.rule}, ${d.credit.source})`)),
          el("h3", {}, "task"), el("pre", {}, text(d.task)),
          el("h3", {}, "output"), el("pre", { id: "output" }, text(r.output)),
          r.error ? [el("h3", { class: "errtext" }, "error"), el("pre", { class: "errtext" }, r.error)] : null,
          r.traceback ? el("details", {}, el("summary", {}, "traceback"), el("pre", {}, r.traceback)) : null),
        el("h3", {}, `Timeline: ${d.spans.length} span(s)`),
        d.spans.length ? el("div", { class: "card scroll" }, timeline(d.spans)) : el("p", { class: "muted" }, "No span recorded."),
        el("div", { id: "spans" }, d.spans.map(spanCard)));
    },
  };
}

// ------------------------------------------------------------------------------------------------ two runs

function compareView(main, a, b) {
  const changed = differ();
  const top = el("div", { class: "card" }), cols = el("div", { class: "cols" });
  fill(main, el("p", {}, el("a", { href: "#/" }, "← runs")), el("h2", {}, `${a}  vs  ${b}`), top, cols);
  return {
    async refresh() {
      const [sa, sb] = await Promise.all([api("summary", { run: a }), api("summary", { run: b })]);
      if (!changed([sa, sb])) return;
      fill(top, rewardChart([{ name: a, history: sa.history, evals: sa.evals }, { name: b, history: sb.history, evals: sb.evals }]));
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
