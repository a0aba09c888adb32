// The page of one slimen run: it polls the server's tail endpoints every few seconds and draws
// what is new, so a running run's steps appear without a reload and a finished run shows the same.
"use strict";

const POLL_MS = 2000;
const COLORS = ["#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#7f7f7f", "#8c564b", "#bcbd22", "#9467bd"];

const $ = (sel) => document.querySelector(sel);

// el makes an element: el("div", {class: "x"}, child, "text", …). Text is always set as text,
// never parsed as HTML: what a model wrote is shown, not run.
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of kids.flat()) {
    if (c === undefined || c === null || c === false) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

const SVGNS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...kids) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of kids.flat()) if (c !== undefined && c !== null) e.append(c instanceof Node ? c : String(c));
  return e;
}

async function getJSON(url) {
  const r = await fetch(url, { credentials: "same-origin" });
  if (!r.ok) throw new Error(url + ": " + r.status + " " + (await r.text()).trim());
  return r.json();
}

function fmt(x) {
  if (x === undefined || x === null) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return String(x);
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
  return x.toFixed(a < 1 ? 3 : 2);
}

// ---- policy colours: the same policy has the same colour in the charts and the rollouts ----

// The dataflow drawing's policies take its colours, in its order (/api/graph's policies); a
// policy it lacks takes the next colour when first seen.
const policyColor = new Map();
function colorOf(policy) {
  if (!policyColor.has(policy)) policyColor.set(policy, COLORS[policyColor.size % COLORS.length]);
  return policyColor.get(policy);
}

// ---- curves ----

// The curves of metrics.jsonl, merged from the chunks /api/curves sends: series by id, each a
// Map step → value, and the steps at which each source (and eval dataset) has a line.
const metrics = { gen: 0, offset: 0, series: new Map(), lines: new Map(), lastStep: null, changed: false };

function sid(source, dataset, key) { return source + "\u0000" + (dataset || "") + "\u0000" + key; }

async function pollCurves() {
  for (;;) {
    const r = await getJSON(`/api/curves?from=${metrics.offset}&gen=${metrics.gen}`);
    if (r.reset || r.gen !== metrics.gen) {
      metrics.series.clear();
      metrics.lines.clear();
      metrics.changed = true;
    }
    metrics.gen = r.gen;
    metrics.offset = r.offset;
    for (const s of r.series) {
      const id = sid(s.source, s.dataset, s.key);
      if (!metrics.series.has(id)) metrics.series.set(id, { source: s.source, dataset: s.dataset || "", key: s.key, pts: new Map() });
      const m = metrics.series.get(id).pts;
      for (const [step, v] of s.points) m.set(step, v); // a later line of a step wins
      metrics.changed = true;
    }
    for (const l of r.lines) {
      const id = l.source + "\u0000" + (l.dataset || "");
      if (!metrics.lines.has(id)) metrics.lines.set(id, new Set());
      const set = metrics.lines.get(id);
      for (const st of l.steps) {
        set.add(st);
        if (!l.source.startsWith("_eval") && (metrics.lastStep === null || st > metrics.lastStep)) metrics.lastStep = st;
      }
    }
    if (!r.more) break;
  }
  if (metrics.changed) {
    metrics.changed = false;
    drawCharts();
  }
}

// segmentsOf returns a series' points in step order, cut where its source has a line without
// the key (a policy not trained in a step): a gap, not a straight line across it.
function segmentsOf(s) {
  const pts = [...s.pts.entries()].sort((a, b) => a[0] - b[0]);
  const lines = [...(metrics.lines.get(s.source + "\u0000" + s.dataset) || [])].sort((a, b) => a - b);
  const out = [];
  let cur = [], k = 0;
  for (let i = 0; i < pts.length; i++) {
    if (i > 0) {
      while (k < lines.length && lines[k] <= pts[i - 1][0]) k++;
      if (k < lines.length && lines[k] < pts[i][0]) { out.push(cur); cur = []; }
    }
    cur.push(pts[i]);
  }
  if (cur.length) out.push(cur);
  return out;
}

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { const d = Math.abs(lo) || 1; lo -= d / 2; hi += d / 2; }
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let i = Math.ceil(lo / step); i * step <= hi + step * 1e-9; i++) ticks.push(Number((i * step).toPrecision(12)));
  return ticks;
}

// stepTicks are about 6 whole steps between x0 and x1, 1, 2 or 5 times a power of ten apart.
function stepTicks(x0, x1) {
  const raw = Math.max(1, (x1 - x0) / 6), mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  const ticks = [];
  for (let t = Math.ceil(x0 / step) * step; t <= x1; t += step) ticks.push(t);
  return ticks;
}

// chart draws lines [{label, color, series}] as an SVG with axes, a legend and a hover readout.
function chart(title, lines) {
  const W = 520, H = 230, L = 48, R = 10, T = 8, B = 26;
  const all = lines.flatMap((l) => [...l.series.pts.entries()]);
  const box = el("div", { class: "chart", "data-title": title }, el("h3", {}, title));
  if (!all.length) return null;
  let x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  let y0 = Math.min(...all.map((p) => p[1])), y1 = Math.max(...all.map((p) => p[1]));
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const yt = niceTicks(y0, y1, 4);
  y0 = Math.min(y0, yt[0]); y1 = Math.max(y1, yt[yt.length - 1]);
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const X = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - R);
  const Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  const g = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": title });
  for (const t of yt) {
    g.append(svg("line", { class: "grid", x1: L, x2: W - R, y1: Y(t), y2: Y(t) }));
    g.append(svg("text", { x: L - 4, y: Y(t) + 3, "text-anchor": "end" }, fmt(t)));
  }
  for (const t of stepTicks(x0, x1)) {
    g.append(svg("text", { x: X(t), y: H - B + 14, "text-anchor": "middle" }, String(t)));
  }
  g.append(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
  g.append(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
  g.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  for (const l of lines) {
    for (const seg of segmentsOf(l.series)) {
      if (seg.length === 1) {
        g.append(svg("circle", { cx: X(seg[0][0]), cy: Y(seg[0][1]), r: 2.5, fill: l.color }));
      } else {
        g.append(svg("polyline", { class: "curve", stroke: l.color, points: seg.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ") }));
      }
    }
  }
  const hover = svg("line", { class: "hover", y1: T, y2: H - B, visibility: "hidden" });
  g.append(hover);
  g.addEventListener("mousemove", (ev) => {
    const rect = g.getBoundingClientRect();
    const step = Math.round(x0 + ((ev.clientX - rect.left - L) / (W - L - R)) * (x1 - x0));
    const rows = lines.map((l) => l.series.pts.has(step) ? `${l.label}: ${fmt(l.series.pts.get(step))}` : null).filter(Boolean);
    if (!rows.length) { hover.setAttribute("visibility", "hidden"); hideTip(); return; }
    hover.setAttribute("x1", X(step)); hover.setAttribute("x2", X(step)); hover.setAttribute("visibility", "visible");
    showTip(ev, `step ${step}\n` + rows.join("\n"));
  });
  g.addEventListener("mouseleave", () => { hover.setAttribute("visibility", "hidden"); hideTip(); });
  box.append(g, el("div", { class: "legend-row" }, lines.map((l) => el("span", {}, el("span", { class: "swatch", style: `background:${l.color}` }), l.label))));
  return box;
}

function seriesWhere(pred) { return [...metrics.series.values()].filter(pred); }

function policyLines(key) {
  return seriesWhere((s) => s.key === key && !s.source.startsWith("_"))
    .sort((a, b) => a.source.localeCompare(b.source))
    .map((s) => ({ label: s.source, color: colorOf(s.source), series: s }));
}

// Eval keys that are scores, not counts or times.
function evalKey(k) { return !["tasks", "failed", "samples"].includes(k) && !k.endsWith("_s"); }

function drawCharts() {
  [...metrics.series.values()].map((s) => s.source).filter((p) => !p.startsWith("_")).sort().forEach(colorOf);
  const box = $("#charts");
  box.replaceChildren();
  const charts = [
    chart("reward_mean per policy", policyLines("reward_mean")),
    chart("held-out eval", seriesWhere((s) => s.source === "_eval" && evalKey(s.key)).sort((a, b) => (a.dataset + a.key).localeCompare(b.dataset + b.key))
      .map((s, i) => ({ label: (s.dataset ? s.dataset + " " : "") + s.key, color: COLORS[i % COLORS.length], series: s }))),
    chart("accuracy (training rollouts)", seriesWhere((s) => s.source === "_run" && /accuracy/.test(s.key)).map((s, i) => ({ label: s.key, color: COLORS[i % COLORS.length], series: s }))),
    chart("loss per policy", policyLines("loss")),
  ].filter(Boolean);
  if (!charts.length) box.append(el("p", { class: "muted" }, "no metrics yet"));
  box.append(...charts);
  // The picker lists every key; its chart shows that key for every source that has it.
  const pick = $("#metric-pick");
  const keys = [...new Set([...metrics.series.values()].map((s) => s.key))].sort();
  const was = pick.value;
  if (pick.options.length !== keys.length + 1) {
    pick.replaceChildren(el("option", { value: "" }, "—"), ...keys.map((k) => el("option", { value: k }, k)));
    pick.value = keys.includes(was) ? was : "";
  }
  drawPicked();
}

function drawPicked() {
  const key = $("#metric-pick").value;
  const box = $("#picked-chart");
  box.replaceChildren();
  if (!key) return;
  const lines = seriesWhere((s) => s.key === key).sort((a, b) => (a.source + a.dataset).localeCompare(b.source + b.dataset))
    .map((s, i) => ({ label: s.source + (s.dataset ? " " + s.dataset : ""), color: s.source.startsWith("_") ? COLORS[(i + 6) % COLORS.length] : colorOf(s.source), series: s }));
  const c = chart(key, lines);
  if (c) box.append(c);
}

// ---- the tooltip of tokens and charts ----

function showTip(ev, text) {
  const tip = $("#tip");
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = Math.min(ev.clientX + 12, window.innerWidth - tip.offsetWidth - 4) + "px";
  tip.style.top = ev.clientY + 14 + "px";
}
function hideTip() { $("#tip").hidden = true; }

// ---- events.log ----

// ended is the run's last word in events.log: "done: …" or "stop: …", until a resume starts it
// again ("loaded …"); "" while it runs.
const events = { gen: 0, offset: -1, lines: 0, ended: "" };
const MAX_EVENT_LINES = 5000;

async function pollEvents() {
  const pre = $("#event-log");
  for (;;) {
    const r = await getJSON(`/api/events?from=${events.offset}&gen=${events.gen}`);
    if (r.reset || (events.offset < 0 && events.lines === 0)) { pre.replaceChildren(); events.lines = 0; }
    if (r.cut && events.lines === 0) pre.append(el("span", { class: "muted" }, "… (the log's start is left out; it is in events.log)\n"));
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    events.gen = r.gen;
    events.offset = r.offset;
    for (const line of r.lines) {
      const m = /^\S+ (done|stop): (.*)$/.exec(line);
      if (m) events.ended = m[1] === "done" ? "finished" : "stopped: " + m[2];
      else if (/^\S+ loaded /.test(line)) events.ended = "";
      const bad = /failed|error|Traceback|panic/i.test(line);
      pre.append(bad ? el("span", { class: "fail" }, line + "\n") : line + "\n");
      events.lines++;
    }
    while (events.lines > MAX_EVENT_LINES && pre.firstChild) { pre.firstChild.remove(); events.lines--; }
    if (atEnd) pre.scrollTop = pre.scrollHeight;
    if (!r.more) break;
  }
}

// ---- rollouts ----

const browse = { page: 0, indexed: -1, key: "" };

function filterQuery() {
  const f = new FormData($("#filters"));
  const q = new URLSearchParams();
  for (const k of ["policy", "kind", "status", "min_step", "max_step", "min_reward", "max_reward", "order"]) {
    const v = f.get(k);
    if (v !== null && v !== "") q.set(k, v);
  }
  q.set("page", browse.page);
  q.set("per_page", 20);
  return q.toString();
}

async function pollRollouts(force) {
  const q = filterQuery();
  const follow = $("#filters").elements.follow.checked;
  if (!force && !(follow && browse.page === 0) && q === browse.key) return;
  const r = await getJSON("/api/rollouts?" + q);
  if (!force && q === browse.key && r.indexed === browse.indexed) return;
  browse.key = q;
  browse.indexed = r.indexed;
  const sel = $("#filters").elements.policy;
  const have = [...sel.options].map((o) => o.value).slice(1);
  if (have.join("\u0000") !== r.policies.join("\u0000")) {
    const was = sel.value;
    sel.replaceChildren(el("option", { value: "" }, "any"), ...r.policies.map((p) => el("option", { value: p }, p)));
    sel.value = was;
  }
  const pages = Math.max(1, Math.ceil(r.total / r.per_page));
  $("#page-info").textContent = !r.exists
    ? "this run keeps no rollouts.jsonl (run.save_rollouts is 0, or no step has finished yet)"
    : `${r.total} of ${r.indexed} rollouts match · page ${r.page + 1} of ${pages}` + (r.indexed ? ` · steps ${r.min_step}–${r.max_step}` : "") + (r.bad ? ` · ${r.bad} unreadable lines` : "");
  $("#prev").disabled = r.page === 0;
  $("#next").disabled = r.page + 1 >= pages;
  const list = $("#rollout-list");
  list.replaceChildren(...r.items.map(renderRollout));
}

function text(x) {
  if (x === undefined || x === null) return "";
  return typeof x === "string" ? x : JSON.stringify(x, null, 1);
}

function msgRow(role, content, cls) {
  return el("div", { class: "msg" + (cls ? " " + cls : "") }, el("div", { class: "role" }, role), el("div", { class: "content" }, content));
}

function renderMessages(msgs) {
  return msgs.map((m) => {
    let c = text(m.content);
    if (m.tool_calls) c += (c ? "\n" : "") + text(m.tool_calls);
    return msgRow(m.role + (m.name ? " " + m.name : ""), c);
  });
}

// tokensOf returns the tokens [from, to) of a call's record, whose per-token fields are parallel
// arrays (docs/observability.md, rollouts.jsonl).
function tokensOf(c, from, to) {
  const ids = c.token_ids || [];
  const out = [];
  for (let i = Math.max(0, from); i < Math.min(to, ids.length); i++) {
    out.push({
      id: ids[i],
      piece: c.pieces ? c.pieces[i] : undefined,
      mask: c.mask ? c.mask[i] : undefined,
      adv: c.advantage ? c.advantage[i] : undefined,
      logprob: c.logprob ? c.logprob[i] : undefined,
      ref: c.ref_logprob ? c.ref_logprob[i] : undefined,
      entropy: c.entropy ? c.entropy[i] : undefined,
    });
  }
  return out;
}

// tokenSpans draws tokens, each coloured by its loss mask and advantage (its strength relative to
// the rollout's largest); the numbers are in the tooltip.
function tokenSpans(toks, maxAdv) {
  const box = el("div", { class: "tokens" });
  for (const t of toks) {
    const mask = t.mask === undefined ? 1 : t.mask;
    let cls = "tok m" + (mask ? 1 : 0);
    let style;
    if (mask) {
      if (t.adv === undefined || t.adv === null) cls += " na"; // sampled, never trained
      else if (t.adv > 0) cls += " pos"; else if (t.adv < 0) cls += " neg"; else cls += " zero";
      if (t.adv) style = "--a:" + Math.min(1, Math.abs(t.adv) / (maxAdv || 1)).toFixed(3);
    }
    const piece = t.piece !== undefined ? t.piece : `‹${t.id}›`;
    const info = [
      `token ${JSON.stringify(piece)} (id ${t.id})`,
      `loss mask ${fmt(mask)}`,
      t.adv !== undefined && t.adv !== null ? `advantage ${fmt(t.adv)}` : "advantage – (not trained)",
      t.logprob !== undefined ? `log-prob ${fmt(t.logprob)}` : null,
      t.ref !== undefined ? `ref log-prob ${fmt(t.ref)}` : null,
      t.entropy !== undefined ? `entropy ${fmt(t.entropy)}` : null,
    ].filter(Boolean).join("\n");
    box.append(el("span", { class: cls, style, "data-tip": info }, piece));
  }
  return box;
}

function tokenRow(role, c, from, to, maxAdv, cls) {
  const toks = tokensOf(c, from, to);
  return el("div", { class: "msg " + cls }, el("div", { class: "role" }, role), toks.length ? tokenSpans(toks, maxAdv) : el("div", { class: "content" }, ""));
}

// renderCall draws one call: its prompt (messages, one a row), then its response's tokens; a
// conversation's sample (turns) is one row a turn, with the tokens injected between turns (tool
// results, the other side's messages) as rows of their own.
function renderCall(c, maxAdv) {
  const color = colorOf(c.policy || "?");
  const head = el("div", { class: "call-head" },
    el("span", { class: "policy" }, c.policy || "?"),
    el("span", { class: "muted" }, c.kind + (c.turns && c.turns.length ? ` · ${c.turns.length} turns` : "")),
    c.reward !== undefined && c.reward !== null ? el("span", {}, "reward " + fmt(c.reward)) : el("span", { class: "muted" }, "no reward"),
    el("span", { class: "muted" }, c.trained ? "trained" : "not trained"),
    c.finish_reason ? el("span", { class: "muted" }, "finish " + c.finish_reason) : null,
    c.prompt_tokens ? el("span", { class: "muted" }, `${c.prompt_tokens} prompt tokens`) : null,
    c.tokens_cut ? el("span", { class: "muted" }, `${c.tokens_cut} more tokens not kept`) : null);
  const body = [];
  const conversation = c.turns && c.turns.length;
  let msgs = c.messages || [];
  if (conversation) {
    // A conversation's messages are all of it; what follows its first assistant turn is in the
    // token rows below, each turn and each injected stretch a row.
    const k = msgs.findIndex((m) => m.role === "assistant");
    if (k >= 0) msgs = msgs.slice(0, k);
  }
  if (msgs.length) body.push(...renderMessages(msgs));
  else if (c.prompt) body.push(msgRow("prompt", c.prompt));
  const n = (c.token_ids || []).length;
  if (conversation) {
    let at = 0;
    c.turns.forEach((t, i) => {
      if (t.start > at) body.push(tokenRow("injected", c, at, t.start, maxAdv, "injected"));
      body.push(tokenRow(`${c.policy} · turn ${i + 1}`, c, t.start, t.end, maxAdv, "turn"));
      at = t.end;
    });
    if (at < n) body.push(tokenRow("injected", c, at, n, maxAdv, "injected"));
  } else if (n) {
    body.push(tokenRow(c.policy, c, 0, n, maxAdv, "turn"));
  } else {
    body.push(msgRow(c.policy, c.response || ""));
  }
  return el("div", { class: "call", style: `--pc:${color}` }, head, body);
}

function maxAdvantage(r) {
  let m = 0;
  for (const c of r.calls || []) {
    for (const [i, a] of (c.advantage || []).entries()) if (a && (!c.mask || c.mask[i])) m = Math.max(m, Math.abs(a));
  }
  return m;
}

// rewardsOf sums up a rollout's rewards by policy: "reward generator 1, 0 · critic 0".
function rewardsOf(r) {
  const by = new Map();
  for (const c of r.calls || []) {
    if (c.reward === undefined || c.reward === null) continue;
    if (!by.has(c.policy)) by.set(c.policy, []);
    by.get(c.policy).push(fmt(c.reward));
  }
  if (!by.size) return null;
  return el("span", {}, "reward " + [...by.entries()].map(([p, rs]) => `${p} ${rs.join(", ")}`).join(" · "));
}

function renderRollout(r) {
  const task = r.task || {};
  const failed = !!r.error;
  const maxAdv = maxAdvantage(r);
  const head = el("div", { class: "rollout-head" },
    el("span", { class: "title" }, `step ${r.step}`),
    r.eval ? el("span", { class: "badge eval" }, "eval" + (r.dataset ? " " + r.dataset : "")) : null,
    task.id !== undefined ? el("span", {}, "task " + task.id) : null,
    r.index !== undefined ? el("span", { class: "muted" }, "rollout " + r.index) : null,
    r.group ? el("span", { class: "muted" }, "group " + r.group) : null,
    rewardsOf(r),
    failed ? el("span", { class: "badge fail" }, "failed") : null,
    el("span", { class: "muted" }, `${(r.calls || []).length} calls`));
  const parts = [head];
  const prompt = task.messages ? task.messages.map((m) => `${m.role}: ${m.content}`).join("\n") : text(task.prompt);
  parts.push(el("details", { class: "task" }, el("summary", {}, "task" + (task.label !== undefined && task.label !== null ? " · label " + text(task.label) : " · no label")), el("pre", {}, prompt)));
  if (failed) parts.push(el("pre", { class: "error" }, r.error));
  if (r.result) parts.push(el("div", { class: "muted" }, "returned " + r.result));
  for (const c of r.calls || []) parts.push(renderCall(c, maxAdv));
  return el("article", { class: "rollout" + (failed ? " failed" : "") }, parts);
}

// ---- run, graph, config ----

async function loadRun() {
  const r = await getJSON("/api/run");
  document.title = "slimen view · " + r.name;
  $("#run-name").textContent = r.name;
  $("#run-dir").textContent = r.dir;
}

async function loadGraph() {
  const g = await getJSON("/api/graph");
  const box = $("#graph");
  if (g.error) {
    box.textContent = "no dataflow graph: " + g.error;
    return;
  }
  for (const p of g.policies) colorOf(p);
  // The SVG comes from the server's own drawing code (host/graph), which escapes every text.
  box.classList.remove("muted");
  box.innerHTML = g.svg;
  $("#mermaid").textContent = g.mermaid;
}

async function loadText(file, where) {
  const r = await fetch("/api/text?file=" + encodeURIComponent(file), { credentials: "same-origin" });
  $(where).textContent = r.ok ? await r.text() : (await r.text()).trim();
}

// ---- the loop ----

let lastChange = Date.now(), lastSeen = "";

async function tick() {
  try {
    await Promise.all([pollCurves(), pollEvents(), pollRollouts(false)]);
    const seen = `${metrics.offset}/${events.offset}/${browse.indexed}`;
    if (seen !== lastSeen) { lastSeen = seen; lastChange = Date.now(); }
    const ago = Math.round((Date.now() - lastChange) / 1000);
    const live = $("#live");
    const state = events.ended ? events.ended : ago < 10 ? "updating" : `no change for ${ago} s`;
    live.textContent = (metrics.lastStep !== null ? `step ${metrics.lastStep} · ` : "") + state;
    live.title = state;
    live.className = !events.ended && ago < 10 ? "on muted" : "muted";
  } catch (e) {
    $("#live").textContent = "the server does not answer: " + e.message;
    $("#live").className = "muted";
  }
  setTimeout(tick, POLL_MS);
}

// fromAddress applies the page's address: ?only=rollouts,curves shows those sections alone, and
// the filters' names (?policy=critic&status=failed…) preset the rollout browser, so a view can
// be linked to.
function fromAddress() {
  const q = new URLSearchParams(location.search);
  const only = (q.get("only") || "").split(",").filter(Boolean);
  if (only.length) {
    for (const sec of document.querySelectorAll("main > section")) sec.hidden = !only.includes(sec.id);
  }
  const form = $("#filters");
  for (const [k, v] of q) {
    const f = form.elements[k];
    if (!f || k === "follow") continue;
    if (f.tagName === "SELECT" && ![...f.options].some((o) => o.value === v)) f.append(el("option", { value: v }, v));
    f.value = v;
  }
}

function main() {
  fromAddress();
  document.addEventListener("mouseover", (ev) => {
    const t = ev.target.closest && ev.target.closest("[data-tip]");
    if (t) showTip(ev, t.getAttribute("data-tip"));
  });
  document.addEventListener("mouseout", (ev) => {
    if (ev.target.closest && ev.target.closest("[data-tip]")) hideTip();
  });
  $("#metric-pick").addEventListener("change", drawPicked);
  $("#filters").addEventListener("submit", (ev) => { ev.preventDefault(); browse.page = 0; pollRollouts(true).catch(showError); });
  $("#filters").addEventListener("change", (ev) => { if (ev.target.name !== "follow") { browse.page = 0; pollRollouts(true).catch(showError); } });
  $("#prev").addEventListener("click", () => { browse.page = Math.max(0, browse.page - 1); pollRollouts(true).catch(showError); });
  $("#next").addEventListener("click", () => { browse.page++; pollRollouts(true).catch(showError); });
  loadRun().catch(showError);
  const graph = loadGraph().catch((e) => { $("#graph").textContent = "no dataflow graph: " + e.message; });
  loadText("config.yaml", "#config-text");
  loadText("script.star", "#script-text");
  // The first drawing waits a little for the graph, whose order gives policies their colours.
  Promise.race([graph, new Promise((ok) => setTimeout(ok, 3000))]).then(tick);
}

function showError(e) { $("#page-info").textContent = e.message; }

main();
