// tierflow operations console: the view of any pipeline, read from the gateway that served
// this page. `/v1/console` (every 2 s) gives the tiers, streams and jobs; a stream's tail,
// its dead letters and a job's results come over one WebSocket (docs/contracts.md); the
// SQL box posts to `/v1/sql`. Charts are uPlot (vendored). No build step, no CDN.

const POLL_MS = 2000;
const HISTORY = 150; // points per chart: 5 minutes at one view per 2 s
const TAIL_ROWS = 30;
const RESULT_ROWS = 50;
const TIER_TITLES = {
  collector: "Collectors",
  logger: "Message loggers",
  bridge: "Broker bridges",
  jetstream: "JetStream streams",
  analysis: "Analysis jobs",
  results: "Results & KV",
  gateway: "Gateways",
};

const $ = (id) => document.getElementById(id);
const fmt = (n, digits = 0) =>
  n === null || n === undefined || Number.isNaN(n)
    ? "–"
    : Number(n).toLocaleString(undefined, { maximumFractionDigits: digits });

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// ------------------------------------------------------------------------------ the token

/** The consumer token: `?token=` or the one entered once (kept for this tab's session). */
const auth = {
  get token() {
    return new URLSearchParams(location.search).get("token") || sessionStorage.getItem("tierflow.token") || "";
  },
  set(token) {
    sessionStorage.setItem("tierflow.token", token);
  },
  headers(extra = {}) {
    return this.token ? { ...extra, Authorization: `Bearer ${this.token}` } : extra;
  },
};

function askForToken(why) {
  $("token-form").hidden = false;
  feed("refused", why);
}

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  auth.set($("token-input").value.trim());
  $("token-form").hidden = true;
  socket.restart();
  poll();
});

function feed(state, text) {
  $("feed").dataset.state = state;
  $("feed").textContent = text;
}

// ------------------------------------------------------------------------------ tabs

for (const button of document.querySelectorAll("nav [data-tab]")) {
  button.addEventListener("click", () => showTab(button.dataset.tab));
}

function showTab(name) {
  for (const b of document.querySelectorAll("nav [data-tab]")) {
    b.setAttribute("aria-pressed", String(b.dataset.tab === name));
  }
  for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== `tab-${name}`;
  if (name === "pipeline") throughput.resize();
}

// ------------------------------------------------------------------------------ charts

/** A uPlot line chart of named series over time, fed one point per view. */
class TimeChart {
  constructor(node, names) {
    this.node = node;
    this.names = names;
    this.data = [[], ...names.map(() => [])];
    this.plot = null;
  }

  push(at, values) {
    this.data[0].push(at);
    this.names.forEach((n, i) => this.data[i + 1].push(values[n] ?? null));
    if (this.data[0].length > HISTORY) this.data.forEach((d) => d.shift());
    this.draw();
  }

  draw() {
    if (typeof uPlot === "undefined" || this.node.offsetParent === null) return;
    if (!this.plot) {
      const colors = ["#2563eb", "#16a34a", "#db2777", "#ea580c", "#7c3aed"];
      this.plot = new uPlot(
        {
          width: Math.max(300, this.node.clientWidth),
          height: 180,
          series: [{}, ...this.names.map((n, i) => ({ label: n, stroke: colors[i % colors.length], width: 2 }))],
          axes: [{}, { size: 60 }],
        },
        this.data,
        this.node,
      );
    } else {
      this.plot.setData(this.data);
    }
  }

  resize() {
    if (this.plot) this.plot.setSize({ width: Math.max(300, this.node.clientWidth), height: 180 });
    this.draw();
  }
}

const throughput = new TimeChart($("throughput"), ["collected", "bridged", "processed", "served"]);

// ------------------------------------------------------------------------------ the view

let view = null;

/** Fetch `/v1/console` once; a 401 asks for the token, a 503 says there is no view yet. */
async function poll() {
  let resp;
  try {
    resp = await fetch("/v1/console", { headers: auth.headers(), cache: "no-store" });
  } catch (err) {
    feed("error", `gateway unreachable: ${err}`);
    return;
  }
  const body = await resp.json().catch(() => ({}));
  if (resp.status === 401 || resp.status === 403) {
    askForToken(`refused (${resp.status}): ${body.error ?? ""}`);
    return;
  }
  if (!resp.ok) {
    feed("waiting", `no view (${resp.status}): ${body.error ?? ""}`);
    return;
  }
  $("token-form").hidden = true; // a token that works is asked for no more
  const fresh = !view || body.at !== view.at;
  view = body;
  const stale = body.age_s > 15;
  feed(stale ? "stale" : "live", `view ${fmt(body.age_s, 1)} s old · up ${fmt(body.uptime_s)} s`);
  render(body, fresh);
}

function render(v, fresh) {
  renderViews(v.views ?? []);
  renderTiers(v.tiers);
  renderPromise(v);
  renderStreams(v.streams);
  renderJobs(v.jobs);
  renderArchive(v.streams);
  if (fresh) {
    const rate = (tier, key) => v.tiers.find((t) => t.tier === tier)?.rates?.[key] ?? null;
    throughput.push(v.at, {
      collected: rate("collector", "accepted"),
      bridged: rate("bridge", "published"),
      processed: rate("analysis", "processed"),
      served: rate("gateway", "events_sent"),
    });
  }
}

/** Links to the pages a config serves beside the console (`[gateway.views]`). */
function renderViews(names) {
  const box = $("views");
  if (box.dataset.names === names.join()) return;
  box.dataset.names = names.join();
  const token = new URLSearchParams(location.search).get("token");
  box.replaceChildren(
    ...names.map((n) => {
      const a = el("a", "view", n);
      a.href = `/${encodeURIComponent(n)}/${token ? `?token=${encodeURIComponent(token)}` : ""}`;
      return a;
    }),
  );
}

/** The headline figures of a tier's box: its rate, then what says whether it keeps up. */
function tierFigures(t) {
  const r = t.rates ?? {};
  switch (t.tier) {
    case "collector":
      return [["accepted/s", r.accepted], ["503s/s", r.overloaded], ["in flight", t.load]];
    case "logger":
      return [["logged/s", r.logged], ["pending", t.load]];
    case "bridge":
      return [["published/s", r.published], ["failed/s", r.failed], ["in flight", t.load]];
    case "jetstream": {
      const out = [["stored/s", r.stored], ["events", t.messages]];
      if (t.archive_lag) out.push(["archive lag", t.archive_lag]);
      if (t.replication_lag !== null && t.replication_lag !== undefined) out.push(["copy lag", t.replication_lag]);
      return out;
    }
    case "analysis":
      return [["processed/s", r.processed], ["lag", t.lag], ["late", t.late_events]];
    case "results":
      return [["published/s", r.published], ["held", t.messages]];
    case "gateway":
      return [["sent/s", r.events_sent], ["clients", t.load], ["lag+drops/s", (r.lag_warnings ?? 0) + (r.dropped ?? 0)]];
    default:
      return [];
  }
}

function renderTiers(tiers) {
  const list = $("tiers");
  const old = new Map([...list.children].map((li) => [li.dataset.tier, li]));
  list.replaceChildren(
    ...tiers.map((t) => {
      const li = old.get(t.tier) ?? el("li", "tier");
      li.dataset.tier = t.tier;
      li.dataset.state = t.state;
      const unit = t.tier === "jetstream" ? "stream" : t.tier === "analysis" || t.tier === "results" ? "job" : "replica";
      const count = t.replicas === 1 ? unit : `${unit}s`;
      const nodes = t.nodes?.length ? ` on ${t.nodes.length} node${t.nodes.length > 1 ? "s" : ""}` : "";
      const facts = el("dl", "facts");
      for (const [k, v] of tierFigures(t)) facts.append(el("dt", "", k), el("dd", "", fmt(v, 1)));
      if (t.restarts) facts.append(el("dt", "", "restarts"), el("dd", "", fmt(t.restarts)));
      li.replaceChildren(
        el("h3", "", TIER_TITLES[t.tier] ?? t.tier),
        el("p", "meta", `${fmt(t.replicas)} ${count}${nodes}`),
        facts,
        el("p", "why", t.why || (t.state === "ok" ? "keeping up" : t.state)),
      );
      li.setAttribute("aria-label", `${TIER_TITLES[t.tier]}: ${t.state}${t.why ? `, ${t.why}` : ""}`);
      return li;
    }),
  );
}

function renderPromise(v) {
  const facts = [
    ["dead letters", fmt(v.dead_letters)],
    ["escalation", v.escalated ?? "none"],
    ["last verifier run", verdictText(v.verifier)],
    ["nodes", fmt((v.nodes ?? []).filter((n) => n.alive).length)],
  ];
  $("promise").replaceChildren(...facts.flatMap(([k, val]) => [el("dt", "", k), el("dd", "", String(val))]));
  $("promise").dataset.verdict = v.verifier?.verdict ?? "";
}

/** The last audit's verdict (`tierflow audit`): what, over how much, and when. */
function verdictText(verdict) {
  if (!verdict) return "none on record (tierflow audit)";
  const streams = Object.values(verdict.streams ?? {});
  const events = streams.reduce((a, s) => a + (s.events ?? 0), 0);
  const when = new Date(verdict.at * 1000).toLocaleTimeString([], { hour12: false });
  const why = verdict.why ? `: ${verdict.why}` : "";
  return `${verdict.verdict}${why} (${verdict.kind}, ${fmt(events)} events in ${streams.length} streams, ${when})`;
}

function limitsText(l) {
  const parts = [];
  if (l.max_age_s) parts.push(`age ${fmt(l.max_age_s)} s`);
  if (l.max_bytes) parts.push(`${fmt(l.max_bytes)} B`);
  if (l.max_msgs) parts.push(`${fmt(l.max_msgs)} msgs`);
  if (l.max_msgs_per_subject) parts.push(`${fmt(l.max_msgs_per_subject)}/subject`);
  return parts.join(", ") || "none";
}

function renderStreams(streams) {
  const body = $("streams").tBodies[0];
  body.replaceChildren(
    ...streams.map((s) => {
      const tr = el("tr");
      tr.dataset.stream = s.name;
      const name = el("th", "", "");
      name.scope = "row";
      const pick = el("button", "link", s.name);
      pick.type = "button";
      pick.addEventListener("click", () => tail.open(s.name, $("tail-filter").value.trim()));
      name.append(pick);
      tr.append(
        name,
        el("td", "", s.subjects.join(", ")),
        el("td", "num", fmt(s.rate, 1)),
        el("td", "num", fmt(s.messages)),
        el("td", "num", fmt(s.bytes)),
        el("td", "", limitsText(s.limits)),
        el("td", "", s.compact ? `by ${s.compact.key}, keep ${s.compact.keep}` : "–"),
        el("td", "", s.archive ? `by ${s.archive.partitioning}, ${fmt(s.archive.lag)} behind` : "–"),
        el("td", "num", fmt(s.dead_letters)),
      );
      return tr;
    }),
  );
  const select = $("tail-stream");
  const names = streams.map((s) => s.name);
  if ([...select.options].map((o) => o.value).join() !== names.join()) {
    const keep = select.value;
    select.replaceChildren(...names.map((n) => new Option(n, n)));
    if (names.includes(keep)) select.value = keep;
  }
}

function renderJobs(jobs) {
  const body = $("jobs").tBodies[0];
  body.replaceChildren(
    ...jobs.map((j) => {
      const tr = el("tr");
      tr.dataset.job = j.name;
      tr.dataset.health = j.health;
      const name = el("th", "", "");
      name.scope = "row";
      const pick = el("button", "link", j.name);
      pick.type = "button";
      pick.addEventListener("click", () => results.open(j));
      name.append(pick);
      const state = el("td", "state", j.why ? `${j.state}: ${j.why}` : j.state);
      tr.append(
        name,
        el("td", "", j.kind),
        el("td", "", j.streams.join(", ")),
        state,
        el("td", "num", fmt(j.batch_ms)),
        el("td", "num", fmt(j.input_rows_per_s, 1)),
        el("td", "num", fmt(j.processed_rows_per_s, 1)),
        el("td", "num", fmt(j.lag)),
        el("td", "num", fmt(j.late_events)),
        el("td", "num", fmt(j.results)),
      );
      return tr;
    }),
  );
}

function renderArchive(streams) {
  const archived = streams.filter((s) => s.archive);
  const rows = archived.map((s) => {
    const tr = el("tr");
    tr.append(el("th", "", s.name), el("td", "", s.archive.partitioning), el("td", "num", fmt(s.archive.lag)), el("td", "num", fmt(s.messages)), el("td", "num", fmt(s.first_seq)));
    return tr;
  });
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "meta", "no stream is archived");
    td.colSpan = 5;
    tr.append(td);
    rows.push(tr);
  }
  $("archive").tBodies[0].replaceChildren(...rows);
}

// ------------------------------------------------------------------------------ WebSocket

/** One WebSocket for the tail, the dead letters and a job's results; reconnects with
 * backoff and subscribes again from after the last event each subscription showed. */
class Socket {
  constructor() {
    this.subs = new Map();
    this.ws = null;
    this.attempt = 0;
  }

  url() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const token = auth.token ? `?token=${encodeURIComponent(auth.token)}` : "";
    return `${scheme}//${location.host}/v1/ws${token}`;
  }

  start() {
    const ws = new WebSocket(this.url());
    this.ws = ws;
    ws.onopen = () => {
      this.attempt = 0;
      this.subs.forEach((s) => this.send(s));
    };
    ws.onmessage = (e) => this.frame(JSON.parse(e.data));
    ws.onclose = (e) => {
      if (ws !== this.ws) return;
      this.ws = null;
      if (e.code === 4401 || e.code === 4403) {
        askForToken(`the gateway refused the token (${e.code})`);
        return;
      }
      this.attempt += 1;
      setTimeout(() => this.start(), Math.min(10000, 250 * 2 ** this.attempt));
    };
  }

  restart() {
    const old = this.ws;
    this.ws = null;
    old?.close();
    this.start();
  }

  subscribe(id, stream, filter, from, onEvent, onError) {
    this.unsubscribe(id);
    const sub = { id, stream, filter, from, onEvent, onError, last: 0 };
    this.subs.set(id, sub);
    if (this.ws?.readyState === WebSocket.OPEN) this.send(sub);
  }

  unsubscribe(id) {
    if (this.subs.delete(id) && this.ws?.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify({ op: "unsubscribe", id }));
    }
  }

  send(sub) {
    const frame = { op: "subscribe", id: sub.id, stream: sub.stream, from: sub.last ? sub.last + 1 : sub.from };
    if (sub.filter) frame.filter = sub.filter;
    this.ws.send(JSON.stringify(frame));
  }

  frame(f) {
    const sub = this.subs.get(f.id);
    if (!sub) return;
    if (f.op === "event" && f.seq > sub.last) {
      sub.last = f.seq;
      sub.onEvent(f);
    } else if (f.op === "error") {
      this.subs.delete(f.id);
      sub.onError(f);
    }
  }
}

const socket = new Socket();

function eventLine(frame) {
  const li = el("li", "event");
  li.dataset.seq = frame.seq;
  li.append(el("span", "seq", `#${frame.seq}`), " ", el("code", "", JSON.stringify(frame.data)));
  return li;
}

/** The live tail of one stream through the SQL filter box, and that stream's dead letters. */
const tail = {
  open(stream, filter) {
    const info = view?.streams.find((s) => s.name === stream);
    const from = info ? Math.max(1, info.last_seq - TAIL_ROWS + 1) : "new";
    $("tail-stream").value = stream;
    $("tail-name").textContent = stream;
    $("tail").replaceChildren();
    let n = 0;
    const shown = filter || "SELECT *";
    $("tail-status").textContent = `${stream}: ${shown} · waiting for events…`;
    socket.subscribe(
      "tail",
      stream,
      filter,
      from,
      (f) => {
        n += 1;
        $("tail").prepend(eventLine(f));
        while ($("tail").children.length > TAIL_ROWS) $("tail").lastChild.remove();
        $("tail-status").textContent = `${stream}: ${shown} · ${n} events`;
      },
      (f) => {
        $("tail-status").textContent = `refused (${f.code}): ${f.reason}`;
      },
    );
    this.deadLetters(stream);
  },

  deadLetters(stream) {
    const dl = view?.streams.find((s) => s.name === "deadletter");
    $("dl-name").textContent = stream;
    $("deadletters").replaceChildren();
    if (!dl) {
      $("dl-status").textContent = "no dead-letter stream this token may read";
      socket.unsubscribe("deadletters");
      return;
    }
    let n = 0;
    $("dl-status").textContent = `${fmt(view.streams.find((s) => s.name === stream)?.dead_letters)} dead letters in all`;
    socket.subscribe(
      "deadletters",
      "deadletter",
      `WHERE _subject = 'deadletter.${stream.replaceAll("'", "''")}'`,
      Math.max(1, dl.last_seq - 200),
      (f) => {
        n += 1;
        $("deadletters").prepend(eventLine(f));
        while ($("deadletters").children.length > TAIL_ROWS) $("deadletters").lastChild.remove();
      },
      (f) => {
        $("dl-status").textContent = `refused (${f.code}): ${f.reason}`;
      },
    );
  },
};

$("tail-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const stream = $("tail-stream").value;
  if (stream) tail.open(stream, $("tail-filter").value.trim());
});

// ------------------------------------------------------------------------------ results

/** A job's current results (the results KV under its name, then its changes), drawn by
 * kind: top-N as bars, counts as a table and a series, distinct as a figure with its bounds,
 * windows as series, anything else (sql, custom, sample) as a table. */
const results = {
  rows: new Map(),
  job: null,
  chart: null,

  async open(job) {
    this.job = job;
    this.rows = new Map();
    this.chart = null;
    this.totals = [[], []];
    $("results").replaceChildren();
    $("results-name").textContent = `${job.name} (${job.kind})`;
    $("results-status").textContent = "reading…";
    const filter = `WHERE key LIKE '${job.name.replaceAll("'", "''")}.%'`;
    let from = "new";
    try {
      const resp = await fetch(`/v1/kv/results?filter=${encodeURIComponent(filter)}`, { headers: auth.headers(), cache: "no-store" });
      const body = await resp.json();
      if (!resp.ok) throw new Error(`${resp.status}: ${body.error}`);
      for (const e of body.entries) this.rows.set(e.key, e.value);
      from = body.revision + 1;
    } catch (err) {
      $("results-status").textContent = `results: ${err.message}`;
    }
    this.draw();
    socket.subscribe(
      "results",
      "kv:results",
      filter,
      from,
      (f) => {
        if (this.job !== job) return;
        if (f.data.op === "put") this.rows.set(f.data.key, f.data.value);
        else this.rows.delete(f.data.key);
        this.draw();
      },
      (f) => {
        $("results-status").textContent = `refused (${f.code}): ${f.reason}`;
      },
    );
  },

  draw() {
    const job = this.job;
    const rows = [...this.rows.values()].filter((r) => r && typeof r === "object");
    $("results-status").textContent = `${rows.length} result rows · updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
    const windowed = rows.some((r) => r.window_start);
    const box = $("results");
    if (job.kind === "topn" && !windowed) return drawBars(box, rows.find((r) => r.key === "all") ?? rows[0]);
    if (windowed && (job.kind === "count" || job.kind === "distinct" || job.kind === "topn")) {
      return this.drawSeries(box, rows, job.kind === "count" ? "count" : job.kind === "distinct" ? "distinct" : "events");
    }
    if (job.kind === "distinct") return drawDistinct(box, rows[0]);
    if (job.kind === "count") return this.drawCounts(box, rows);
    return drawTable(box, rows);
  },

  /** Counts: the total over time (one point per change seen here), and the rows. */
  drawCounts(box, rows) {
    const count = (r) => {
      const last = Object.values(r).at(-1); // the count is each row's last field (count_as)
      return typeof last === "number" ? last : 0;
    };
    this.totals[0].push(Date.now() / 1000);
    this.totals[1].push(rows.reduce((a, r) => a + count(r), 0));
    if (this.totals[0].length > HISTORY) this.totals.forEach((d) => d.shift());
    if (!this.chart) {
      const node = el("div", "chart");
      node.setAttribute("role", "img");
      node.setAttribute("aria-label", "total count over time");
      box.replaceChildren(node, el("div", "scroll"));
      this.chart = new uPlot(
        { width: Math.max(300, box.clientWidth), height: 160, series: [{}, { label: "total count", stroke: "#16a34a", width: 2 }], axes: [{}, { size: 60 }] },
        this.totals,
        node,
      );
    } else {
      this.chart.setData(this.totals);
    }
    drawTable(box.lastChild, [...rows].sort((a, b) => count(b) - count(a)));
    box.dataset.drawn = "table";
    box.dataset.total = this.totals[1].at(-1);
  },

  drawSeries(box, rows, field) {
    const byStart = new Map();
    for (const r of rows) {
      const t = Date.parse(r.window_start) / 1000;
      const v = field === "events" ? (r.top ?? []).reduce((a, b) => a + b.count, 0) : Number(r[field] ?? r.count ?? 0);
      byStart.set(t, (byStart.get(t) ?? 0) + v);
    }
    const xs = [...byStart.keys()].sort((a, b) => a - b);
    const data = [xs, xs.map((x) => byStart.get(x))];
    if (!this.chart) {
      box.replaceChildren();
      const node = el("div", "chart");
      node.setAttribute("role", "img");
      node.setAttribute("aria-label", `${field} per window`);
      box.append(node);
      this.chart = new uPlot(
        { width: Math.max(300, box.clientWidth), height: 220, series: [{}, { label: `${field} per window`, stroke: "#2563eb", width: 2 }], axes: [{}, { size: 60 }] },
        data,
        node,
      );
      box.dataset.drawn = "series";
    } else {
      this.chart.setData(data);
    }
    box.dataset.points = xs.length;
  },
};

function drawBars(box, row) {
  box.dataset.drawn = "bars";
  const top = [...(row?.top ?? [])].sort((a, b) => b.count - a.count);
  const max = Math.max(1, ...top.map((t) => t.count));
  const list = el("ol", "bars");
  for (const t of top) {
    const li = el("li", "bar");
    li.dataset.item = t.item;
    li.dataset.count = t.count;
    const fill = el("span", "fill");
    fill.style.width = `${((100 * t.count) / max).toFixed(1)}%`;
    const track = el("span", "track");
    track.append(fill);
    li.append(el("span", "label", String(t.item)), track, el("span", "count", fmt(t.count)));
    list.append(li);
  }
  box.replaceChildren(list);
}

function drawDistinct(box, row) {
  box.dataset.drawn = "distinct";
  if (!row) return box.replaceChildren(el("p", "meta", "no result yet"));
  const p = el("p", "big", fmt(row.distinct));
  p.dataset.distinct = row.distinct;
  box.replaceChildren(p, el("p", "meta", `between ${fmt(row.lower)} and ${fmt(row.upper)} (2 standard deviations)`));
}

function drawTable(box, rows) {
  box.dataset.drawn = "table";
  const shown = rows.slice(0, RESULT_ROWS);
  const columns = [...new Set(shown.flatMap((r) => Object.keys(r)))];
  const table = el("table", "grid");
  fillTable(table, columns, shown.map((r) => columns.map((c) => r[c])));
  box.replaceChildren(table);
}

/** `table` with a head of `columns` and a row per array of cells (objects as JSON). */
function fillTable(table, columns, rows) {
  table.replaceChildren();
  const head = table.createTHead().insertRow();
  for (const c of columns) head.append(Object.assign(el("th", "", c), { scope: "col" }));
  const body = table.createTBody();
  for (const cells of rows) {
    const tr = body.insertRow();
    for (const v of cells) {
      tr.insertCell().textContent = v === undefined ? "" : v !== null && typeof v === "object" ? JSON.stringify(v) : String(v);
    }
  }
}

// ------------------------------------------------------------------------------ history

$("sql-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const status = $("sql-status");
  status.textContent = "running…";
  try {
    const resp = await fetch("/v1/sql", {
      method: "POST",
      headers: auth.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ sql: $("sql-input").value.trim(), limit: 200, timeout_s: 60 }),
    });
    const body = await resp.json();
    if (!resp.ok) {
      status.textContent = `refused (${resp.status}): ${body.error}`;
      return;
    }
    fillTable($("sql-result"), body.columns, body.rows);
    status.textContent = `${body.rows.length} rows from ${body.tables.join(", ") || "no table"}${body.truncated ? " (more rows than shown)" : ""}`;
  } catch (err) {
    status.textContent = `failed: ${err}`;
  }
});

// ------------------------------------------------------------------------------ start

socket.start();
poll();
setInterval(poll, POLL_MS);
window.addEventListener("resize", () => throughput.resize());
window.tierflow = { socket, results, tail, poll }; // for the curious (and for tests and the bench)
