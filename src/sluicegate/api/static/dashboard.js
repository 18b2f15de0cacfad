// The live dashboard: polls GET /v1/stats once a second and draws the last two minutes.
//
// Each card and chart reads its numbers from the snapshot and stays hidden until the
// server reports them, so a server with fewer fields (or a newer one with more) works.

import { ApiError, authHeaders, errorFromResponse } from "./api.js";
import { LineChart, PALETTE, compact } from "./chart.js";

const POLL_MS = 1000;
const WINDOW_MS = 120_000; // history kept and shown
const MIN_WINDOW_MS = 20_000; // a fresh page shows its first 20 s, then grows to WINDOW_MS
const BREAKER_STATES = ["closed", "shed_batch", "open"]; // by severity, as the server's enum
const TTFT = ["ttft", "time_to_first_token"];
const TPOT = ["tpot", "time_per_output_token"];
const QUEUE_WAIT = ["queue_wait"];
const NONE_COLOR = "#9aa5b1"; // the "none so far" placeholder line

// --- reading a snapshot ---

const num = (v) => (typeof v === "number" && Number.isFinite(v) ? v : undefined);
const at = (obj, path) => path.split(".").reduce((o, k) => (o == null ? undefined : o[k]), obj);

function firstNum(stats, paths) {
  for (const path of paths) {
    const v = num(at(stats, path));
    if (v !== undefined) return v;
  }
  return undefined;
}

/** A latency percentile in ms, from `ttft_seconds.p50`, `ttft.p50_ms` and the like. */
function latencyMs(stats, names, q) {
  for (const n of names) {
    // A bare `ttft.p50` is in seconds, the server's unit for every duration.
    const s = firstNum(stats, [
      `${n}_seconds.${q}`, `${n}.${q}_seconds`, `${n}_${q}_seconds`, `${n}.${q}`,
    ]);
    if (s !== undefined) return s * 1000;
    const ms = firstNum(stats, [`${n}_ms.${q}`, `${n}.${q}_ms`, `${n}_${q}_ms`]);
    if (ms !== undefined) return ms;
  }
  return undefined;
}

function batchSize(s) {
  return firstNum(s, ["batch_size", "batch_size.last", "batch_size.current", "batch_size.mean"]);
}

function kvPercent(s) {
  const ratio = firstNum(s, ["kv_cache.usage_ratio", "kv_cache_usage_ratio"]);
  return ratio === undefined ? undefined : ratio * 100;
}

/** {reason: count} from the first of `keys` that holds one (a bare number counts as "all"). */
function countsByReason(s, keys) {
  for (const key of keys) {
    const v = s[key];
    if (num(v) !== undefined) return { all: v };
    if (v && typeof v === "object") {
      const out = {};
      for (const [reason, count] of Object.entries(v)) {
        if (num(count) !== undefined) out[reason] = count;
      }
      return out;
    }
  }
  return undefined;
}
const rejections = (s) =>
  countsByReason(s, ["rejections_by_reason", "rejections", "rejections_total"]);
const preemptions = (s) => countsByReason(s, ["preemptions_by_reason", "preemptions_total"]);

function breakerState(s) {
  const v = at(s, "breaker.state") ?? s.breaker_state ?? s.breaker;
  if (typeof v === "number") return BREAKER_STATES[v] ?? String(v);
  return typeof v === "string" ? v.toLowerCase() : undefined;
}

/** Per-second rate of a counter between two samples (0 across a server restart). */
function phaseTotals(stats) {
  const phases = stats.prefill?.tokens_by_phase;
  const total = (phase) =>
    Object.values(phases?.[phase] ?? {}).reduce((a, b) => a + (num(b) ?? 0), 0);
  return { prefill: total("prefill"), decode: total("decode") };
}

function rate(cur, prev, read) {
  if (!prev) return undefined;
  const a = read(prev.stats);
  const b = read(cur.stats);
  const dt = (cur.t - prev.t) / 1000;
  if (a === undefined || b === undefined || dt <= 0) return undefined;
  return Math.max(0, (b - a) / dt);
}

/** Rate per reason; while the server reports the counts but none is set yet, one flat line. */
function ratesByReason(cur, prev, read) {
  const counts = read(cur.stats);
  if (counts === undefined) return {};
  const reasons = Object.keys(counts);
  if (reasons.length === 0) return { none: ["none so far", prev ? 0 : undefined] };
  const out = {};
  for (const reason of reasons) {
    out[reason] = [reason, rate(cur, prev, (s) => read(s)?.[reason] ?? 0)];
  }
  return out;
}

const sum = (counts) => (counts ? Object.values(counts).reduce((a, b) => a + b, 0) : undefined);

// --- formatting ---

// Each returns undefined for undefined, so "not reported" passes through.
const fmtCount = (v) => (v === undefined ? undefined : String(Math.round(v * 10) / 10));
const fmtRate = (v) => (v === undefined ? undefined : v < 10 ? v.toFixed(1) : `${Math.round(v)}`);
const fmtPercent = (v) =>
  v === undefined ? undefined : `${v < 10 ? v.toFixed(1) : Math.round(v)}%`;
function fmtMs(v) {
  if (v === undefined) return undefined;
  if (v >= 1000) return `${(v / 1000).toFixed(2)} s`;
  return `${v < 10 ? v.toFixed(1) : Math.round(v)} ms`;
}
const axisMs = (v) => (v >= 1000 ? `${compact(v / 1000)} s` : `${compact(v)} ms`);
function topReasons(counts) {
  const entries = Object.entries(counts ?? {}).filter(([, c]) => c > 0).sort((x, y) => y[1] - x[1]);
  return entries.slice(0, 3).map(([r, c]) => `${r} ${c}`).join(" · ");
}

// --- what is shown: value(cur, prev) returns undefined while the server does not report it ---

function latencyCard(id, label, names) {
  return {
    id,
    label,
    value: (c) => fmtMs(latencyMs(c.stats, names, "p50")),
    sub: (c) => {
      const p99 = latencyMs(c.stats, names, "p99");
      return p99 === undefined ? "" : `p99 ${fmtMs(p99)}`;
    },
  };
}

function latencyChart(id, title, names) {
  return {
    id,
    title,
    format: fmtMs,
    options: { format: axisMs },
    series: (c) => ({
      p50: ["p50", latencyMs(c.stats, names, "p50")],
      p99: ["p99", latencyMs(c.stats, names, "p99")],
    }),
  };
}

const CARDS = [
  { id: "running", label: "Running", value: (c) => fmtCount(num(c.stats.requests_running)) },
  {
    id: "waiting",
    label: "Waiting",
    value: (c) => fmtCount(num(c.stats.requests_waiting)),
    sub: (c) => {
      // The admission queue is part of the waiting count: the rest waits in the engine.
      const queued = num(at(c.stats, "queue.queued"));
      return queued === undefined ? "" : `${queued} in the admission queue`;
    },
  },
  {
    id: "paused",
    label: "Paused sequences",
    value: (c) => fmtCount(num(c.stats.requests_paused)),
    sub: (c) => {
      const streams = num(c.stats.streams_paused);
      return streams === undefined ? "" : `${streams} streams paused`;
    },
  },
  { id: "batch", label: "Batch size", value: (c) => fmtCount(batchSize(c.stats)) },
  {
    id: "kv",
    label: "KV cache",
    value: (c) => fmtPercent(kvPercent(c.stats)),
    sub: (c) => {
      const kv = c.stats.kv_cache;
      if (!kv || num(kv.used_blocks) === undefined) return "";
      return `${kv.used_blocks} / ${kv.total_blocks} blocks`;
    },
  },
  {
    id: "prefix",
    label: "Prefix cache hits",
    value: (c) => {
      const ratio = num(c.stats.prefix_cache?.hit_rate);
      return fmtPercent(ratio === undefined ? undefined : ratio * 100);
    },
    sub: (c) => {
      const p = c.stats.prefix_cache;
      if (!p || num(p.cached_slots) === undefined) return "";
      return `of prompt tokens · ${p.cached_slots} cached slots`;
    },
  },
  {
    id: "speculation",
    label: "Draft tokens accepted",
    value: (c) => {
      const ratio = num(c.stats.speculation?.acceptance_rate);
      return fmtPercent(ratio === undefined ? undefined : ratio * 100);
    },
    sub: (c) => {
      const s = c.stats.speculation;
      if (!s || num(s.proposed_tokens) === undefined) return "";
      return `${s.accepted_tokens} of ${s.proposed_tokens} drafted`;
    },
  },
  {
    // Stall-free prefill (docs/stall-free.md): the engine's tokens, prompt against decode.
    id: "prefill",
    label: "Prompt tokens",
    value: (c) => {
      const { prefill, decode } = phaseTotals(c.stats);
      const all = prefill + decode;
      return fmtPercent(all > 0 ? (100 * prefill) / all : undefined);
    },
    sub: (c) => {
      const split = c.stats.prefill?.tokens_by_phase?.prefill;
      const long = num(c.stats.prefill?.lanes?.long?.tokens);
      const { prefill } = phaseTotals(c.stats);
      if (!split || long === undefined || prefill === 0) return "of the engine's tokens";
      const batch = Math.round((100 * (num(split.batch) ?? 0)) / prefill);
      return `of tokens · ${Math.round((100 * long) / prefill)}% long prompts · ${batch}% batch`;
    },
  },
  latencyCard("ttft", "TTFT p50", TTFT),
  latencyCard("tpot", "TPOT p50", TPOT),
  {
    id: "rejections",
    label: "Rejections",
    value: (c) => fmtCount(sum(rejections(c.stats))),
    sub: (c) => topReasons(rejections(c.stats)),
  },
  { id: "breaker", label: "Circuit breaker", badge: true, value: (c) => breakerState(c.stats) },
  {
    id: "preemptions",
    label: "Preemptions",
    value: (c) => fmtCount(num(c.stats.preemptions_total) ?? sum(preemptions(c.stats))),
    sub: (c) => topReasons(c.stats.preemptions_by_reason),
  },
  {
    id: "steps",
    label: "Engine steps / s",
    value: (c, p) => fmtRate(rate(c, p, (s) => num(s.engine_steps_total))),
  },
];

const CHARTS = [
  {
    id: "requests",
    title: "Requests",
    format: fmtCount,
    options: { minMax: 2 },
    series: (c) => ({
      running: ["running", num(c.stats.requests_running)],
      waiting: ["waiting", num(c.stats.requests_waiting)],
      paused: ["paused sequences", num(c.stats.requests_paused)],
      streams_paused: ["paused streams", num(c.stats.streams_paused)],
    }),
  },
  {
    id: "batch",
    title: "Batch size (sequences per engine step)",
    format: fmtCount,
    options: { minMax: 2 },
    series: (c) => ({ batch: ["batch size", batchSize(c.stats)] }),
  },
  {
    id: "kv",
    title: "KV cache usage",
    format: fmtPercent,
    options: { fixedMax: 100, format: (v) => `${v}%` },
    series: (c) => ({ kv: ["blocks in use", kvPercent(c.stats)] }),
  },
  latencyChart("ttft", "Time to first token", TTFT),
  latencyChart("tpot", "Time per output token", TPOT),
  latencyChart("queue-wait", "Queue wait (arrival to first scheduled)", QUEUE_WAIT),
  {
    id: "rejections",
    title: "Rejections / s by reason",
    format: fmtRate,
    options: { minMax: 1 },
    series: (c, p) => ratesByReason(c, p, rejections),
  },
  {
    id: "preemptions",
    title: "Preemptions / s by reason",
    format: fmtRate,
    options: { minMax: 1 },
    series: (c, p) => ratesByReason(c, p, preemptions),
  },
  {
    id: "steps",
    title: "Engine steps / s",
    format: fmtRate,
    options: { minMax: 10 },
    series: (c, p) => ({ steps: ["steps", rate(c, p, (s) => num(s.engine_steps_total))] }),
  },
];

// --- the DOM ---

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function buildCard(def, parent) {
  const card = el("div", "panel card");
  card.hidden = true;
  const value = el("div", "value", "–");
  value.dataset.testid = `stat-${def.id}`;
  const sub = el("div", "sub");
  card.append(el("div", "label", def.label), value, sub);
  parent.append(card);
  return { def, card, value, sub };
}

function buildChart(def, parent) {
  const panel = el("div", "panel chart");
  panel.hidden = true;
  panel.dataset.testid = `chart-${def.id}`;
  const canvas = el("canvas");
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", def.title);
  const legend = el("div", "legend");
  panel.append(el("h3", "", def.title), canvas, legend);
  parent.append(panel);
  // key -> {label, color, points: [[timeMs, value], ...]}, in order of first appearance
  const chart = new LineChart(canvas, def.options);
  return { def, panel, legend, chart, history: new Map(), numColors: 0 };
}

export function initDashboard() {
  const root = document.getElementById("dashboard");
  const status = document.getElementById("dash-status");
  const cards = CARDS.map((def) => buildCard(def, document.getElementById("cards")));
  const charts = CHARTS.map((def) => buildChart(def, document.getElementById("charts")));
  let previous = null; // the sample before the latest, for rates
  let firstT = null; // time of the first sample: the charts span from it until they are full
  let active = false;
  let timer = null; // the next poll, when one is scheduled
  let inflight = false;
  let polls = 0;

  function record(cur) {
    for (const card of cards) {
      const value = card.def.value(cur, previous);
      if (value === undefined) continue; // keep the last known value (a rate needs 2 samples)
      card.card.hidden = false;
      if (card.def.badge) {
        card.value.replaceChildren(el("span", `badge ${value}`, value.replace("_", " ")));
      } else {
        card.value.textContent = value;
      }
      card.sub.textContent = card.def.sub?.(cur, previous) ?? "";
    }
    for (const c of charts) {
      const current = c.def.series(cur, previous);
      for (const [key, [label, value]] of Object.entries(current)) {
        if (value === undefined) continue;
        if (!c.history.has(key)) {
          // Palette colours are never reused within a chart; the placeholder line is grey.
          const color = key === "none" ? NONE_COLOR : PALETTE[c.numColors++ % PALETTE.length];
          c.history.set(key, { label, color, points: [] });
        }
        c.history.get(key).points.push([cur.t, value]);
      }
      for (const [key, series] of c.history) {
        const points = series.points;
        while (points.length && points[0][0] < cur.t - WINDOW_MS) points.shift();
        // A series the snapshot no longer has ("none so far" once a reason appears) goes.
        if (points.length === 0 || !(key in current)) c.history.delete(key);
      }
    }
  }

  function draw() {
    const now = Date.now();
    const span = Math.min(WINDOW_MS, Math.max(MIN_WINDOW_MS, now - (firstT ?? now)));
    for (const c of charts) {
      if (c.history.size === 0) continue;
      c.panel.hidden = false;
      const series = [...c.history.values()];
      c.chart.draw(series, now, span);
      c.legend.replaceChildren(
        ...series.map((s) => {
          const item = el("span");
          const swatch = el("span", "swatch");
          swatch.style.background = s.color;
          const last = s.points[s.points.length - 1];
          item.append(swatch, `${s.label} `, el("b", "", last ? c.def.format(last[1]) : "–"));
          return item;
        }),
      );
    }
  }

  async function poll() {
    timer = null;
    inflight = true;
    const started = performance.now();
    try {
      const response = await fetch("/v1/stats", {
        headers: authHeaders(),
        cache: "no-store",
        signal: AbortSignal.timeout(2500),
      });
      if (!response.ok) throw await errorFromResponse(response);
      const cur = { t: Date.now(), stats: await response.json() };
      firstT ??= cur.t;
      record(cur);
      previous = cur;
      draw();
      const state = cur.stats.ready === false ? "engine loading" : cur.stats.model ?? "";
      status.textContent = `live · ${state} · updated ${new Date(cur.t).toLocaleTimeString()}`;
      status.classList.remove("down");
    } catch (err) {
      let why = String(err);
      if (err instanceof ApiError) why = err.describe();
      else if (err?.name === "TimeoutError") why = "no answer in 2.5 s";
      status.textContent = `cannot read /v1/stats: ${why}`;
      status.classList.add("down");
    } finally {
      inflight = false;
      root.dataset.polls = String(++polls); // lets a test see that polling goes on
      // One request at a time, started once a second whatever the last one took.
      if (active && timer === null) {
        timer = setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
      }
    }
  }

  window.addEventListener("resize", draw);
  return {
    /** Poll only while the dashboard is on screen. */
    setActive(on) {
      active = on;
      if (on && timer === null && !inflight) timer = setTimeout(poll, 0);
      if (!on && timer !== null) {
        clearTimeout(timer);
        timer = null;
      }
    },
  };
}
