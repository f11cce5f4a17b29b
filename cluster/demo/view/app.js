// tierflow live dashboard: one WebSocket to the gateway that served this page (the protocol
// is docs/contracts.md), one subscription per panel. Everything shown comes from the wire:
// panels say "waiting" until real data arrives. No dependencies, no build step.

const TOPN_SUBJECT = "results.meetup_topn";
const CITY_SUBJECT = "results.meetup_city_minute";
const RATE_WINDOW_S = 60;
const CITY_ROWS = 12;
const MAX_MATCHES = 25;
const FATAL_CLOSE = new Map([
  [4401, "no or invalid token: open the page with ?token=…"],
  [4403, "this token may not read these streams"],
]);

const $ = (id) => document.getElementById(id);

/** The gateway that served this page: its HTTP and WebSocket URLs, `?token=` passed on. */
export function endpoints(loc = window.location) {
  const token = new URLSearchParams(loc.search).get("token");
  const ws = loc.protocol === "https:" ? "wss:" : "ws:";
  const query = token ? `?token=${encodeURIComponent(token)}` : "";
  return { http: loc.origin, ws: `${ws}//${loc.host}/v1/ws${query}`, token };
}

/** GET a gateway JSON resource; null when there is nothing there (404). */
async function getJson(ends, path) {
  const headers = ends.token ? { Authorization: `Bearer ${ends.token}` } : {};
  const resp = await fetch(ends.http + path, { headers, cache: "no-store" });
  if (resp.status === 404) return null;
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

/**
 * Subscriptions multiplexed over one WebSocket that reconnects with jittered exponential
 * backoff and resumes each subscription right after the last seq it delivered (or where a
 * "new" subscription began), dropping anything at or below that seq a server sends again.
 */
export class Connection {
  constructor(url, onStatus, { baseMs = 250, capMs = 10000 } = {}) {
    Object.assign(this, { url, onStatus, baseMs, capMs });
    this.clientId = `dash-${Math.random().toString(36).slice(2, 10)}`;
    this.subs = new Map();
    this.ws = null;
    this.attempt = 0;
    this.stats = { reconnects: 0, lagWarnings: 0, dropped: 0, lastLag: null };
  }

  start() {
    this.status("connecting", "connecting…");
    const ws = new WebSocket(this.url);
    this.ws = ws;
    ws.onopen = () => this.subs.forEach((sub) => this.send(this.subscribeFrame(sub)));
    ws.onmessage = (e) => this.onFrame(JSON.parse(e.data));
    ws.onclose = (e) => this.onClose(ws, e);
  }

  subscribe(id, stream, filter, start, onEvent, onError = () => {}) {
    const sub = { id, stream, filter, start, onEvent, onError, lastSeq: 0, fromSeq: null };
    this.subs.set(id, sub);
    if (this.ws?.readyState === WebSocket.OPEN) this.send(this.subscribeFrame(sub));
  }

  unsubscribe(id) {
    if (this.subs.delete(id) && this.ws?.readyState === WebSocket.OPEN) {
      this.send({ op: "unsubscribe", id });
    }
  }

  subscribeFrame(sub) {
    const from = sub.lastSeq > 0 ? sub.lastSeq + 1 : (sub.fromSeq ?? sub.start);
    const frame = { op: "subscribe", id: sub.id, stream: sub.stream, from, client: this.clientId };
    if (sub.filter) frame.filter = sub.filter;
    return frame;
  }

  send(frame) {
    this.ws.send(JSON.stringify(frame));
  }

  onFrame(f) {
    const sub = this.subs.get(f.id);
    if (f.op === "event") {
      if (!sub || f.seq <= sub.lastSeq) return; // unsubscribed, or already shown
      sub.lastSeq = f.seq;
      sub.onEvent(f);
    } else if (f.op === "subscribed") {
      if (sub && sub.fromSeq === null && Number.isInteger(f.from_seq)) sub.fromSeq = f.from_seq;
      this.attempt = 0;
      if (this.state !== "lagging") this.status("live", "live");
    } else if (f.op === "lag") {
      this.stats.lagWarnings += 1;
      this.stats.lastLag = f;
      this.lagging(`lagging: ${f.behind} behind on ${f.id} (policy ${f.policy})`);
    } else if (f.op === "dropped") {
      this.stats.dropped += f.count;
      this.lagging(`server dropped ${f.count} messages of ${f.id}`);
    } else if (f.op === "error") {
      if (sub) {
        this.subs.delete(f.id); // never resend a subscription the server refused
        sub.onError(f);
      } else {
        this.status("error", `gateway error ${f.code}: ${f.reason}`);
      }
    }
  }

  onClose(ws, e) {
    if (ws !== this.ws) return;
    this.ws = null;
    if (FATAL_CLOSE.has(e.code)) {
      this.status("refused", `refused (${e.code}): ${FATAL_CLOSE.get(e.code)}`);
      return;
    }
    this.attempt += 1;
    this.stats.reconnects += 1;
    const ceiling = Math.min(this.capMs, this.baseMs * 2 ** (this.attempt - 1));
    const delay = ceiling / 2 + (Math.random() * ceiling) / 2;
    const why = e.code === 1006 ? "connection lost" : `closed (${e.code})`;
    this.status("reconnecting", `${why}; reconnecting in ${(delay / 1000).toFixed(1)} s`);
    setTimeout(() => this.start(), delay);
  }

  /** Show a lag warning; back to "live" once no warning came for a few seconds. */
  lagging(text) {
    this.status("lagging", text);
    clearTimeout(this.lagTimer);
    this.lagTimer = setTimeout(() => this.ws && this.status("live", "live"), 5000);
  }

  status(state, text) {
    this.state = state;
    this.onStatus(state, text, this.stats);
  }
}

// ------------------------------------------------------------------------------ panels

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const clock = (date = new Date()) => date.toLocaleTimeString([], { hour12: false });

/** Top-N bars, keyed by topic so a bar that moves keeps its element (and its transition). */
export function renderTopN(row, seq) {
  const list = $("topn");
  const top = [...(row.top ?? [])].sort((a, b) => b.count - a.count);
  const max = Math.max(1, ...top.map((t) => t.count));
  const old = new Map([...list.children].map((li) => [li.dataset.item, li]));
  const items = top.map((t) => {
    let li = old.get(t.item);
    if (!li) {
      li = el("li", "bar");
      li.dataset.item = t.item;
      li.append(el("span", "label", t.item), el("span", "track"), el("span", "count"));
      li.children[1].append(el("span", "fill"));
    }
    li.dataset.count = t.count;
    const approx = t.error ? ` ±${t.error}` : "";
    li.children[2].textContent = `${t.count.toLocaleString()}${approx}`;
    li.children[1].firstChild.style.width = `${((100 * t.count) / max).toFixed(1)}%`;
    li.setAttribute("aria-label", `${t.item}: ${t.count} RSVPs${approx}`);
    return li;
  });
  list.replaceChildren(...items);
  const events = row.events !== undefined ? `${row.events.toLocaleString()} RSVPs counted · ` : "";
  $("topn-meta").textContent = `${events}updated ${clock()} · result seq ${seq}`;
}

/** RSVPs per second, counted in the browser per wall-clock second of arrival. */
class RateMeter {
  constructor() {
    this.counts = new Map();
    this.bars = [];
    const chart = $("rate-chart");
    for (let i = 0; i < RATE_WINDOW_S; i += 1) this.bars.push(chart.appendChild(el("span")));
  }

  add(n = 1) {
    const s = Math.floor(Date.now() / 1000);
    this.first ??= s; // joined mid-second: that second's count is partial
    this.counts.set(s, (this.counts.get(s) ?? 0) + n);
  }

  render() {
    const now = Math.floor(Date.now() / 1000);
    for (const s of this.counts.keys()) if (s < now - RATE_WINDOW_S) this.counts.delete(s);
    // Complete seconds only: the current one is still counting.
    const series = this.bars.map((_, i) => this.counts.get(now - RATE_WINDOW_S + i) ?? 0);
    const max = Math.max(1, ...series);
    series.forEach((v, i) => {
      this.bars[i].style.height = `${(100 * v) / max}%`;
      this.bars[i].title = `${v} RSVPs`;
    });
    if (this.first < now - 1) $("rate").textContent = series.at(-1).toLocaleString(); // 0 too
  }
}

/** The latest minute of each city, busiest first. */
class CityTable {
  constructor() {
    this.byCity = new Map();
  }

  add(row) {
    const seen = this.byCity.get(row.city);
    if (!seen || row.minute >= seen.minute) this.byCity.set(row.city, row);
    const rows = [...this.byCity.values()].sort(
      (a, b) => b.minute.localeCompare(a.minute) || b.rsvps - a.rsvps,
    );
    const body = $("cities").tBodies[0];
    body.replaceChildren(
      ...rows.slice(0, CITY_ROWS).map((r) => {
        const tr = el("tr");
        tr.dataset.city = r.city;
        const when = String(r.minute).replace("T", " ").replace(/:00(\.0+)?Z$/, "");
        tr.append(el("th", "", r.city), el("td", "", when), el("td", "num", String(r.rsvps)));
        tr.firstChild.scope = "row";
        return tr;
      }),
    );
    $("city-meta").textContent = `latest event-time minute per city, ${this.byCity.size} cities`;
  }
}

/** Flatten a (projected) RSVP into "a.b: value" pairs for one line of text. */
export function flatten(value, prefix = "", out = []) {
  if (value !== null && typeof value === "object" && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else {
    out.push([prefix, Array.isArray(value) ? JSON.stringify(value) : String(value)]);
  }
  return out;
}

/** The SQL filter box: one subscription to the raw stream per applied filter. */
class FilterPanel {
  constructor(conn) {
    this.conn = conn;
    this.n = 0;
    this.matched = 0;
    $("filter-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.apply($("filter-input").value.trim());
    });
  }

  apply(filter) {
    this.conn.unsubscribe(`filter-${this.n}`);
    this.n += 1;
    this.matched = 0;
    $("matches").replaceChildren();
    const shown = filter || "SELECT *";
    $("filter-status").textContent = `applied: ${shown} · waiting for matching RSVPs…`;
    this.conn.subscribe(
      `filter-${this.n}`,
      "meetup",
      filter,
      "new",
      (f) => this.show(f, shown),
      (f) => {
        $("filter-status").textContent = `rejected (${f.code}): ${f.reason}`;
      },
    );
  }

  show(frame, shown) {
    this.matched += 1;
    const li = el("li", "match");
    li.dataset.seq = frame.seq;
    for (const [k, v] of flatten(frame.data)) {
      li.append(el("span", "k", `${k}:`), " ", el("span", "v", v), " ");
    }
    $("matches").prepend(li);
    while ($("matches").children.length > MAX_MATCHES) $("matches").lastChild.remove();
    $("filter-status").textContent = `applied: ${shown} · ${this.matched} matching RSVPs`;
  }
}

// ------------------------------------------------------------------------------ wiring

function showStatus(state, text, stats) {
  $("conn").dataset.state = state;
  $("conn-text").textContent = text;
  $("stat-reconnects").textContent = stats.reconnects;
  const lag = stats.lastLag ? ` (last: ${stats.lastLag.behind} behind)` : "";
  $("stat-lag").textContent = `${stats.lagWarnings}${lag}`;
  $("stat-dropped").textContent = stats.dropped;
}

/** One minute before an ISO minute (`2016-09-06T10:52:00Z`), in the same format. */
function minuteBefore(iso) {
  const t = new Date(iso);
  return Number.isNaN(t.getTime()) ? "" : new Date(t - 60000).toISOString().replace(".000Z", "Z");
}

/**
 * Data sync (book ch. 7) for each panel: the current state first, then the changes after
 * exactly that position, so nothing between the two is missed. Without a current state
 * (an empty stream, or the gateway unreachable at load) a panel starts with new changes.
 */
async function startTopN(conn, ends) {
  let from = "new";
  try {
    const latest = await getJson(ends, `/v1/streams/results/latest?subject=${TOPN_SUBJECT}`);
    if (latest) {
      renderTopN(latest.data, latest.seq);
      from = latest.seq + 1;
    }
  } catch (err) {
    console.warn("top-N snapshot:", err);
  }
  const filter = `WHERE _subject = '${TOPN_SUBJECT}'`;
  conn.subscribe("topn", "results", filter, from, (f) => renderTopN(f.data, f.seq), refused);
}

/** A panel whose subscription the gateway refused says so instead of waiting forever. */
function refused(frame) {
  const where = { topn: "topn-meta", cities: "city-meta", rate: "rate-meta" }[frame.id];
  if (where) $(where).textContent = `refused by the gateway (${frame.code}): ${frame.reason}`;
}

async function startCities(conn, ends, cities) {
  let from = "new";
  try {
    // Only the last two minutes of the snapshot: older minutes are history, not the table.
    const latest = await getJson(ends, `/v1/streams/results/latest?subject=${CITY_SUBJECT}`);
    const since = latest ? ` AND value.minute >= '${minuteBefore(latest.data.minute)}'` : "";
    const filter = `SELECT value WHERE value.city IS NOT NULL${since}`;
    const snap = await getJson(ends, `/v1/kv/results?filter=${encodeURIComponent(filter)}`);
    if (snap) {
      snap.entries.forEach((e) => cities.add(e.value));
      from = snap.revision + 1;
    }
  } catch (err) {
    console.warn("city snapshot:", err);
  }
  const deltas = "SELECT value WHERE value.city IS NOT NULL";
  conn.subscribe("cities", "kv:results", deltas, from, (f) => cities.add(f.data.value), refused);
}

/** The SQL box: POST /v1/sql, then the rows as a table (or the gateway's reason). */
export class SqlPanel {
  constructor(ends) {
    this.ends = ends;
    $("sql-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.run($("sql-input").value.trim());
    });
  }

  async run(sql) {
    const status = $("sql-status");
    status.textContent = "running…";
    const headers = { "Content-Type": "application/json" };
    if (this.ends.token) headers.Authorization = `Bearer ${this.ends.token}`;
    let body;
    try {
      const resp = await fetch(this.ends.http + "/v1/sql", {
        method: "POST",
        headers,
        body: JSON.stringify({ sql, limit: 200, timeout_s: 60 }),
      });
      body = await resp.json();
      if (!resp.ok) {
        status.textContent = `refused (${resp.status}): ${body.error}`;
        return;
      }
    } catch (err) {
      status.textContent = `failed: ${err}`;
      return;
    }
    this.render(body);
    const more = body.truncated ? " (more rows than shown)" : "";
    status.textContent = `${body.rows.length} rows from ${body.tables.join(", ") || "no table"}${more}`;
  }

  render(body) {
    const table = $("sql-result");
    table.replaceChildren();
    const head = table.createTHead().insertRow();
    body.columns.forEach((c) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = c;
      head.appendChild(th);
    });
    const rows = table.createTBody();
    body.rows.forEach((r) => {
      const tr = rows.insertRow();
      r.forEach((v) => {
        tr.insertCell().textContent = v !== null && typeof v === "object" ? JSON.stringify(v) : String(v);
      });
    });
  }
}

function main() {
  const ends = endpoints();
  const conn = new Connection(ends.ws, showStatus);
  const rate = new RateMeter();
  const cities = new CityTable();
  conn.start();
  startTopN(conn, ends);
  startCities(conn, ends, cities);
  conn.subscribe("rate", "meetup", "SELECT rsvp_id", "new", () => rate.add(), refused);
  new FilterPanel(conn).apply($("filter-input").value.trim());
  new SqlPanel(ends);
  setInterval(() => rate.render(), 1000);
  window.tierflow = { conn }; // for the curious (and for tests): read-only use, please
}

main();
