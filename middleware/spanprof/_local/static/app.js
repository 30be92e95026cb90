// spanprof local mode: SLO breaches -> that request's flame graph (CPU, allocated or in-use
// memory), trace and pprof; per route, breaching requests against the others.
// Plain browser JavaScript on top of the vendored d3 and d3-flame-graph; no build step.
"use strict";

(function () {
  const WINDOW_S = 300; // latency plot: the last five minutes
  const REFRESH_MS = 2000;
  const PROFILE_RETRY_MS = 1000;
  const PROFILE_RETRIES = 20; // uploads arrive every second; give a slow machine time
  const SETTLED_S = 4; // seconds after a span's end when no more samples will come

  // What each kind of the switches draws, and how its values read (the API's units).
  const KINDS = {
    cpu: { what: "CPU", unit: "nanoseconds", verb: "CPU" },
    alloc_space: { what: "allocated memory", unit: "bytes", verb: "allocated" },
    inuse_space: { what: "memory in use", unit: "bytes", verb: "in use" },
  };

  const state = {
    selected: null, // {span_id, trace_id}
    breaches: [],
    profileTimer: null,
    flamegraphFor: null, // "span id/kind" drawn, and its total: redraw only when either changes
    flamegraphTotal: 0,
    kind: "cpu", // the span flame graph's
    compareKind: "cpu", // the route comparison's
  };

  function $(id) {
    return document.getElementById(id);
  }

  async function getJSON(url) {
    const response = await fetch(url, { cache: "no-store" });
    if (!response.ok) {
      throw new Error(url + ": HTTP " + response.status);
    }
    return response.json();
  }

  function ms(seconds) {
    const value = seconds * 1000;
    return value >= 100 ? value.toFixed(0) + " ms" : value.toFixed(1) + " ms";
  }

  function mb(bytes) {
    return bytes >= 1e6 ? (bytes / 1e6).toFixed(1) + " MB" : (bytes / 1e3).toFixed(0) + " kB";
  }

  // Bytes in the unit that reads best; memory values are estimates, so no false precision.
  function size(bytes) {
    const abs = Math.abs(bytes);
    if (abs >= 1e9) return (bytes / 1e9).toFixed(2) + " GB";
    if (abs >= 1e6) return (bytes / 1e6).toFixed(1) + " MB";
    if (abs >= 1e3) return (bytes / 1e3).toFixed(1) + " kB";
    return Math.round(bytes) + " B";
  }

  // A value of the API's unit: nanoseconds of CPU, bytes, or a count of objects.
  function amount(value, unit) {
    if (unit === "nanoseconds") return ms(value / 1e9);
    if (unit === "bytes") return size(value);
    return Math.round(value) + " objects";
  }

  function signed(value, unit) {
    return (value > 0 ? "+" : "") + amount(value, unit);
  }

  // The switches: one button per kind, the pressed one is the kind shown.
  function setupSwitch(id, onChange) {
    const group = $(id);
    group.querySelectorAll("button").forEach((button) => {
      button.addEventListener("click", () => {
        group.querySelectorAll("button").forEach((b) => b.setAttribute("aria-pressed", String(b === button)));
        onChange(button.dataset.kind);
      });
    });
  }

  function clock(unixSeconds) {
    const d = new Date(unixSeconds * 1000);
    const pad = (n, w) => String(n).padStart(w || 2, "0");
    return (
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + "." +
      pad(d.getMilliseconds(), 3)
    );
  }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (key === "text") node.textContent = value;
      else if (key === "class") node.className = value;
      else node.setAttribute(key, value);
    }
    for (const child of children || []) node.appendChild(child);
    return node;
  }

  function describeSlo(slo) {
    const routes = Object.entries(slo.routes || {}).map(([r, s]) => r + " " + ms(s));
    return "SLO " + ms(slo.default_s) + (routes.length ? " (" + routes.join(", ") + ")" : "");
  }

  // -- status line ----------------------------------------------------------------------------

  function renderStatus(status) {
    const p = status.profiles;
    const parts = [
      status.requests + " requests",
      status.breaches + " breaches",
      p.pushes + " profile uploads",
      (p.labelled_ns / 1e9).toFixed(1) + " s CPU labelled with a span",
      describeSlo(status.slo),
    ];
    // Everything is kept in memory within a budget; say when the oldest had to go.
    const kept = status.kept || {};
    const dropped = [
      [kept.evicted_traces, "traces"],
      [kept.evicted_requests, "requests"],
      [p.evicted_spans, "spans' samples"],
    ].filter(([count]) => count > 0).map(([count, what]) => count + " " + what);
    if (dropped.length) parts.push("dropped the oldest " + dropped.join(", ") + " to stay within memory");
    const node = $("status");
    node.textContent = parts.join(" · ");
    const errors = status.receiver_errors || [];
    if (errors.length) {
      node.appendChild(el("span", { class: "warn", text: " · receiver: " + errors[errors.length - 1] }));
    }
  }

  // -- breach table -------------------------------------------------------------------------

  function renderBreaches(breaches) {
    state.breaches = breaches;
    const body = document.querySelector("#breaches tbody");
    body.textContent = "";
    for (const b of breaches) {
      const row = el("tr", {
        class: "breach" + (state.selected && state.selected.span_id === b.span_id ? " selected" : ""),
        "data-span-id": b.span_id,
        "data-trace-id": b.trace_id,
      }, [
        el("td", { class: "mono", text: clock(b.start) }),
        el("td", { text: b.route || b.name }),
        el("td", {}, [
          el("span", { class: "over", text: ms(b.duration_s) }),
          el("span", { class: "slo", text: b.threshold_s != null ? " > " + ms(b.threshold_s) : "" }),
        ]),
        el("td", { class: "mono", title: b.trace_id, text: b.trace_id.slice(0, 8) + "…" }),
        el("td", { class: "mono", text: b.span_id }),
        el("td", { text: b.profile_ns ? ms(b.profile_ns / 1e9) : "…" }),
        el("td", { class: "alloc", text: b.alloc_bytes ? mb(b.alloc_bytes) : "–" }),
      ]);
      row.addEventListener("click", () => select(b.span_id, b.trace_id));
      body.appendChild(row);
    }
    $("no-breaches").hidden = breaches.length > 0;
    $("breach-count").textContent = breaches.length ? "(" + breaches.length + ", newest first)" : "";
  }

  // -- latency plot ---------------------------------------------------------------------------

  function renderLatency(data) {
    const container = $("latency");
    const width = Math.max(container.clientWidth, 300);
    const height = container.clientHeight || 220;
    const margin = { top: 10, right: 16, bottom: 24, left: 56 };
    const points = data.points;
    const now = Date.now() / 1000;
    // From the first request kept (at most WINDOW_S ago) to now, so a fresh session fills it.
    const first = d3.min(points, (p) => p.start);
    const from = Math.max(now - WINDOW_S, Math.min(first === undefined ? now : first, now - 30) - 2);
    const x = d3.scaleTime()
      .domain([new Date(from * 1000), new Date(now * 1000)])
      .range([margin.left, width - margin.right]);
    const maxY = Math.max(
      d3.max(points, (p) => p.duration_s) || 0,
      data.slo.default_s * 1.2,
    );
    const y = d3.scaleLinear().domain([0, maxY * 1.05]).nice()
      .range([height - margin.bottom, margin.top]);

    const svg = d3.select(container).selectAll("svg").data([null]).join("svg")
      .attr("width", width).attr("height", height);
    svg.selectAll("*").remove();
    svg.append("g").attr("class", "axis")
      .attr("transform", "translate(0," + (height - margin.bottom) + ")")
      .call(d3.axisBottom(x).ticks(Math.max(2, Math.floor(width / 110))));
    svg.append("g").attr("class", "axis")
      .attr("transform", "translate(" + margin.left + ",0)")
      .call(d3.axisLeft(y).ticks(5).tickFormat((v) => (v * 1000).toFixed(0) + " ms"));

    // p95 per bucket: the line a dashboard would draw from the duration histogram.
    const bucket = Math.max(1, (now - from) / 60);
    const groups = d3.rollups(points, (v) => d3.quantile(v.map((p) => p.duration_s).sort(d3.ascending), 0.95),
      (p) => Math.floor(p.start / bucket));
    groups.sort((a, b) => a[0] - b[0]);
    svg.append("path").attr("class", "p95")
      .attr("d", d3.line().x((g) => x(new Date((g[0] + 0.5) * bucket * 1000))).y((g) => y(g[1]))(groups));

    const slo = data.slo.default_s;
    svg.append("line").attr("class", "slo")
      .attr("x1", margin.left).attr("x2", width - margin.right)
      .attr("y1", y(slo)).attr("y2", y(slo));
    svg.append("text").attr("class", "slo-label")
      .attr("x", width - margin.right - 4).attr("y", y(slo) - 4).attr("text-anchor", "end")
      .text("SLO " + ms(slo));

    svg.append("g").selectAll("circle").data(points.filter((p) => !p.breached)).join("circle")
      .attr("class", "request").attr("r", 2)
      .attr("cx", (p) => x(new Date(p.start * 1000))).attr("cy", (p) => y(p.duration_s));
    svg.append("g").selectAll("circle").data(points.filter((p) => p.breached)).join("circle")
      .attr("class", (p) => "exemplar" + (state.selected && state.selected.span_id === p.span_id ? " selected" : ""))
      .attr("data-span-id", (p) => p.span_id)
      .attr("r", 5)
      .attr("cx", (p) => x(new Date(p.start * 1000))).attr("cy", (p) => y(p.duration_s))
      .on("click", (event, p) => select(p.span_id, p.trace_id))
      .append("title").text((p) => p.route + ": " + ms(p.duration_s) + " > " + ms(p.threshold_s) +
        "\ntrace " + p.trace_id + "\nspan " + p.span_id);
  }

  // -- one breach -------------------------------------------------------------------------------

  function select(spanId, traceId) {
    state.selected = { span_id: spanId, trace_id: traceId };
    history.replaceState(null, "", "#span=" + spanId + "&trace=" + traceId);
    document.querySelectorAll("tr.breach").forEach((row) => {
      row.classList.toggle("selected", row.dataset.spanId === spanId);
    });
    d3.selectAll(".exemplar").classed("selected", (p) => p.span_id === spanId);
    $("detail").hidden = false;
    showFlamegraph(spanId, 0);
    showTrace(traceId, spanId);
  }

  function renderMeta(span, spanId, traceId, allocBytes) {
    const meta = $("detail-meta");
    meta.textContent = "";
    const rows = [["trace id", traceId], ["span id", spanId]];
    if (allocBytes) rows.push(["allocated (memory profile)", mb(allocBytes)]);
    if (span) {
      $("detail-title").textContent = span.name;
      rows.unshift(
        ["duration", ms(span.duration_s) + (span.threshold_s != null ? " (SLO " + ms(span.threshold_s) + ")" : "")],
        ["started", clock(span.start)],
        ["service", span.service],
      );
      if (span.status_code != null) rows.push(["status", String(span.status_code)]);
      if (span.attributes && span.attributes["spanprof.cpu_time_s"] != null) {
        rows.push(["CPU (its samples)", ms(span.attributes["spanprof.cpu_time_s"])]);
      }
      if (span.verdict_source) rows.push(["verdict", span.verdict_source === "span" ? "marked by the middleware" : "duration vs SLO (local)"]);
    } else {
      $("detail-title").textContent = "span " + spanId;
    }
    for (const [k, v] of rows) {
      meta.appendChild(el("dt", { text: k }));
      meta.appendChild(el("dd", { class: k.endsWith("id") ? "mono" : "", text: v }));
    }
  }

  async function showFlamegraph(spanId, attempt) {
    clearTimeout(state.profileTimer);
    const kind = state.kind;
    const link = $("pprof-link");
    link.href = "/api/pprof?span_id=" + spanId + (kind === "cpu" ? "" : "&kind=" + kind);
    link.setAttribute("download", "spanprof-" + spanId + (kind === "cpu" ? "" : "-memory") + ".pb.gz");
    $("flamegraph-scope").textContent = "only samples labelled span_id=" + spanId;
    let data;
    try {
      data = await getJSON("/api/flamegraph?span_id=" + spanId + "&kind=" + kind);
    } catch (err) {
      $("flamegraph-status").textContent = String(err);
      return;
    }
    // Another span or kind was picked meanwhile.
    if (!state.selected || state.selected.span_id !== spanId || state.kind !== kind) return;
    renderMeta(data.span, spanId, state.selected.trace_id, data.alloc_bytes);
    // The pprof download is the kind drawn: CPU samples, or the span's memory profile.
    link.classList.toggle("disabled", kind === "cpu" ? data.total_ns === 0 : data.total === 0);
    if (data.total === 0) {
      const chart = $("flamegraph");
      chart.textContent = "";
      chart.dataset.kind = kind;
      state.flamegraphFor = null;
      // Uploads come every second: a span that ended a few seconds ago has all it will get.
      const ended = data.span ? data.span.start + data.span.duration_s : null;
      const settled = ended !== null && data.now - ended > SETTLED_S;
      if (!settled && attempt < PROFILE_RETRIES) {
        $("flamegraph-status").textContent = "Waiting for the profiler's next upload (every second)…";
        state.profileTimer = setTimeout(() => showFlamegraph(spanId, attempt + 1), PROFILE_RETRY_MS);
      } else if (kind === "cpu") {
        $("flamegraph-status").textContent =
          "No CPU samples carry this span id: the request spent its time waiting (I/O, locks, " +
          "another service) or used less than a sampling period of CPU. The trace below shows " +
          "where the time went; click a span marked ▲ for its own flame graph.";
      } else if (kind === "inuse_space") {
        $("flamegraph-status").textContent =
          "None of this span's sampled allocations was still in use at the last upload " +
          "(or the profiler sends no memory profiles: SPANPROF_MEMORY).";
      } else {
        $("flamegraph-status").textContent =
          "No allocation samples carry this span id: it allocated less than the sampling " +
          "interval (one sample per ~512 kB on average), or the profiler sends no memory " +
          "profiles (SPANPROF_MEMORY).";
      }
      return;
    }
    const key = spanId + "/" + kind;
    if (state.flamegraphFor === key && state.flamegraphTotal === data.total) return;
    state.flamegraphTotal = data.total;
    const unit = data.unit;
    let status = amount(data.total, unit) + " " + KINDS[kind].verb + " in " + data.stacks + " distinct stacks";
    if (kind === "cpu") status += " (" + Math.round(data.total / data.period_ns) + " samples)";
    if (kind === "inuse_space" && data.inuse_at) status += ", at the upload of " + clock(data.inuse_at);
    $("flamegraph-status").textContent = status;
    renderFlamegraph(data.root, spanId, kind, unit);
    state.flamegraphFor = key;
    // Late uploads (the last second of the request) can still add samples: refresh once.
    if (attempt < 2) {
      state.profileTimer = setTimeout(() => showFlamegraph(spanId, PROFILE_RETRIES), 2 * PROFILE_RETRY_MS);
    }
  }

  function renderFlamegraph(root, spanId, kind, unit) {
    const container = $("flamegraph");
    container.textContent = "";
    const total = root.value;
    const verb = KINDS[kind].verb;
    const chart = flamegraph.default()
      .width(Math.max(container.clientWidth, 300))
      .cellHeight(17)
      .inverted(true)
      .minFrameSize(2)
      .transitionDuration(250)
      .title("")
      .selfValue(false)
      .label((d) => d.data.name + (d.data.file ? "  " + d.data.file : "") + "\n" +
        amount(d.value, unit) + " " + verb + ", " + (100 * d.value / total).toFixed(1) + "%");
    d3.select(container).datum(root).call(chart);
    container.dataset.spanId = spanId;
    container.dataset.kind = kind;
  }

  async function showTrace(traceId, spanId) {
    $("trace-scope").textContent = "trace_id=" + traceId;
    let data;
    try {
      data = await getJSON("/api/trace?trace_id=" + traceId);
    } catch (err) {
      $("waterfall").textContent = String(err);
      return;
    }
    renderWaterfall(data.spans, spanId);
  }

  function renderWaterfall(spans, selectedId) {
    const box = $("waterfall");
    box.textContent = "";
    if (!spans.length) {
      box.appendChild(el("p", { class: "empty", text: "The spans of this trace are no longer kept." }));
      return;
    }
    const byId = new Map(spans.map((s) => [s.span_id, s]));
    const depth = (s) => {
      let d = 0;
      let cur = s;
      while (cur.parent_id && byId.has(cur.parent_id) && d < 32) {
        cur = byId.get(cur.parent_id);
        d += 1;
      }
      return d;
    };
    const start = Math.min(...spans.map((s) => s.start));
    const end = Math.max(...spans.map((s) => s.start + s.duration_s));
    const total = Math.max(end - start, 1e-6);
    // Children under their parents, siblings by start time.
    const children = new Map();
    for (const s of spans) {
      const parent = s.parent_id && byId.has(s.parent_id) ? s.parent_id : null;
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(s);
    }
    const ordered = [];
    const visit = (parent) => {
      for (const s of (children.get(parent) || []).sort((a, b) => a.start - b.start)) {
        ordered.push(s);
        visit(s.span_id);
      }
    };
    visit(null);
    for (const s of ordered) {
      const bar = el("div", {
        class: "waterfall-bar" + (s.kind === "SERVER" ? " server" : "") + (s.breached ? " breached" : ""),
      });
      bar.style.left = (100 * (s.start - start) / total) + "%";
      bar.style.width = (100 * s.duration_s / total) + "%";
      const name = el("div", { class: "waterfall-name" }, [
        document.createTextNode("\u00a0".repeat(depth(s) * 3) + s.name),
        el("span", { class: "service", text: s.service + " · " + s.kind.toLowerCase() }),
      ]);
      if (s.profile_ns) {
        name.appendChild(el("span", { class: "flame-badge", text: "▲ " + ms(s.profile_ns / 1e9) + " CPU" }));
      }
      const row = el("div", {
        class: "waterfall-row" + (s.span_id === selectedId ? " selected" : "") + (s.profile_ns ? " profiled" : ""),
        "data-span-id": s.span_id,
        title: s.name + " (" + s.span_id + ")" + (s.profile_ns ? ": click for its flame graph" : ""),
      }, [name, el("div", { class: "waterfall-track" }, [bar]), el("div", { class: "waterfall-dur", text: ms(s.duration_s) })]);
      if (s.profile_ns) {
        row.addEventListener("click", () => {
          state.selected = { span_id: s.span_id, trace_id: s.trace_id };
          box.querySelectorAll(".waterfall-row").forEach((r) => r.classList.toggle("selected", r === row));
          showFlamegraph(s.span_id, 0);
        });
      }
      box.appendChild(row);
    }
  }

  // -- breach vs ok, per route ------------------------------------------------------------------

  function us(value) {
    return (value >= 1000 ? (value / 1000).toFixed(2) + " ms" : value.toFixed(0) + " µs");
  }

  function renderCompareRoutes(listing) {
    const select = $("compare-route");
    const routes = listing.routes.map((r) => r.route);
    const empty = $("compare-empty");
    empty.hidden = routes.length > 0;
    if (!routes.length) {
      empty.textContent = state.compareKind === "cpu"
        ? "No samples labelled slo=breached or slo=ok yet (the exact profiler labels them when each request ends)."
        : state.compareKind === "inuse_space"
          ? "No memory in use from a request yet (the exact profiler's memory profiles, SPANPROF_MEMORY)."
          : "No allocations labelled slo=breached or slo=ok yet (the exact profiler's memory profiles, SPANPROF_MEMORY).";
      $("compare-counts").textContent = "";
      $("compare-functions").querySelector("tbody").textContent = "";
      $("compare-flamegraph").textContent = "";
    }
    const current = Array.from(select.options).map((o) => o.value);
    if (current.join("\n") !== routes.join("\n")) {
      const chosen = select.value;
      select.textContent = "";
      for (const route of routes) select.appendChild(el("option", { value: route, text: route }));
      if (routes.includes(chosen)) select.value = chosen;
    }
    return select.value;
  }

  async function showCompare(route) {
    if (!route) return;
    const kind = state.compareKind;
    let data;
    try {
      data = await getJSON("/api/compare?route=" + encodeURIComponent(route) + "&kind=" + kind);
    } catch (err) {
      $("compare-counts").textContent = String(err);
      return;
    }
    if (state.compareKind !== kind) return; // switched meanwhile
    const unit = data.unit;
    const what = KINDS[kind].what;
    $("compare-counts").textContent =
      data.requests.breached + " breaching requests · " + data.requests.ok + " within SLO";
    $("compare-metric").textContent = kind === "cpu"
      ? "extra self CPU per breaching request"
      : "extra " + what + " per breaching request";
    $("compare-legend").textContent =
      "a breaching request's average; red: more " + what + " than a request within its SLO, blue: less";
    const body = $("compare-functions").querySelector("tbody");
    body.textContent = "";
    for (const f of data.functions.slice(0, 15)) {
      body.appendChild(el("tr", { class: f.extra > 0 ? "worse" : "" }, [
        el("td", { text: f.function, title: f.file }),
        el("td", { text: signed(f.extra, unit) }),
        el("td", { text: amount(f.breached, unit) }),
        el("td", { text: amount(f.ok, unit) }),
      ]));
    }
    renderDifferential(data.flamegraph, kind, unit);
  }

  function renderDifferential(root, kind, unit) {
    const container = $("compare-flamegraph");
    container.textContent = "";
    container.dataset.kind = kind;
    if (!root.value) return;
    const chart = flamegraph.default()
      .width(Math.max(container.clientWidth, 300))
      .cellHeight(17)
      .inverted(true)
      .minFrameSize(2)
      .transitionDuration(0)
      .title("")
      .setColorMapper(flamegraph.colorMapper.differentialColorMapper)
      .selfValue(false)
      .label((d) => d.data.name + (d.data.file ? "  " + d.data.file : "") + "\n" +
        amount(d.data.value, unit) + " per breaching request, " + amount(d.data.ok_value, unit) +
        " within SLO (" + signed(d.data.delta, unit) + ")");
    d3.select(container).datum(root).call(chart);
  }

  // -- polling --------------------------------------------------------------------------------

  async function refreshCompare() {
    const kind = state.compareKind;
    const listing = await getJSON("/api/compare?kind=" + kind);
    if (state.compareKind !== kind) return; // switched meanwhile
    await showCompare(renderCompareRoutes(listing));
  }

  async function refresh() {
    try {
      const since = Date.now() / 1000 - WINDOW_S;
      const [status, breaches, latency] = await Promise.all([
        getJSON("/api/status"),
        getJSON("/api/breaches"),
        getJSON("/api/latency?since=" + since.toFixed(3)),
      ]);
      renderStatus(status);
      renderBreaches(breaches.breaches);
      renderLatency(latency);
      await refreshCompare();
    } catch (err) {
      $("status").textContent = "cannot reach the local mode server: " + err;
    }
  }

  function fromHash() {
    const params = new URLSearchParams(location.hash.slice(1));
    const span = params.get("span");
    const traceId = params.get("trace");
    if (span && traceId && /^[0-9a-f]{16}$/.test(span) && /^[0-9a-f]{32}$/.test(traceId)) {
      select(span, traceId);
    }
  }

  $("compare-route").addEventListener("change", (event) => showCompare(event.target.value));
  setupSwitch("flamegraph-kind", (kind) => {
    state.kind = kind;
    if (state.selected) showFlamegraph(state.selected.span_id, 0);
  });
  setupSwitch("compare-kind", (kind) => {
    state.compareKind = kind;
    refreshCompare().catch((err) => { $("compare-counts").textContent = String(err); });
  });
  refresh().then(fromHash);
  setInterval(refresh, REFRESH_MS);
})();
