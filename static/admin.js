// Greenlane admin page: live state over SSE, SM drawing, small canvas charts, controls.
// Plain browser JS, no dependencies, nothing loaded from outside this server.
"use strict";

(() => {
  const HISTORY = 240; // samples kept per chart (2 minutes at the server's 0.5 s interval)
  const TOKEN_KEY = "greenlane.adminToken";
  const COLORS = {
    prefill: "#f08c2b", decode: "#2f7fd8", brand: "#1f9d62", ink: "#16211c",
    p50: "#2f7fd8", p99: "#c2413a", violet: "#8a63d2",
  };

  const $ = (id) => document.getElementById(id);
  const history = []; // state snapshots, oldest first
  let last = null; // latest snapshot
  let splitsShown = ""; // the splits currently offered by the range input (JSON)

  // ---------------------------------------------------------------- formatting
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const ms = (s) => (isNum(s) ? s * 1000 : null);
  function fmtMs(v) {
    if (!isNum(v)) return "–";
    if (v >= 10000) return (v / 1000).toFixed(1) + " s";
    if (v >= 1000) return (v / 1000).toFixed(2) + " s";
    if (v >= 100) return v.toFixed(0) + " ms";
    return v.toFixed(1) + " ms";
  }
  function fmtNum(v, digits = 0) {
    if (!isNum(v)) return "–";
    if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(2) + "M";
    if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + "k";
    return v.toFixed(digits);
  }
  const fmtTick = (v) => (Math.abs(v) >= 1e4 ? fmtNum(v) : String(+v.toPrecision(3)));
  const fmtPct = (v) => (isNum(v) ? (v * 100).toFixed(1) + "%" : "–");

  // ---------------------------------------------------------------- toast
  let toastTimer = null;
  function toast(message, isError = false) {
    const el = $("toast");
    el.textContent = message;
    el.className = "toast" + (isError ? " error" : "");
    el.hidden = false;
    clearTimeout(toastTimer);
    toastTimer = setTimeout(() => { el.hidden = true; }, isError ? 6000 : 2500);
  }

  // ---------------------------------------------------------------- tiles
  // Chat and scoring latencies apart (a server that does not split them: all of it is chat).
  const EMPTY = { count: 0, p50: null, p90: null, p99: null };
  function chatLatency(s) {
    return s.latency.chat || { ttft_s: s.latency.ttft_s, tpot_s: s.latency.tpot_s };
  }
  function scoreLatency(s) {
    return s.latency.score || { ttft_s: EMPTY, e2e_s: EMPTY };
  }
  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
  }
  function renderTiles(s) {
    setText("stat-waiting", fmtNum(s.queues.waiting));
    setText("stat-running", fmtNum(s.queues.running));
    // A step running over a second (a long prompt in one step): how far it is.
    const st = (s.engine && s.engine.step) || {};
    let stepText = "";
    if (isNum(st.running_s) && st.running_s >= 1) {
      stepText = `step ${st.running_s.toFixed(0)} s in`;
      if (isNum(st.layer)) {
        stepText += `: layer ${st.layer + 1} / ${st.num_layers}, ${fmtNum(st.prefill_tokens)} tokens`;
      }
    }
    setText("stat-running-step", stepText);
    setText("stat-kv", fmtPct(s.kv.usage));
    setText("stat-kv-blocks", isNum(s.kv.blocks_total)
      ? `${s.kv.blocks_used} / ${s.kv.blocks_total} blocks` : "");
    const t = chatLatency(s).ttft_s, p = chatLatency(s).tpot_s, e = scoreLatency(s).e2e_s;
    setText("stat-ttft", fmtMs(ms(t.p50)));
    setText("stat-ttft-p99", t.count ? `p99 ${fmtMs(ms(t.p99))} (n=${t.count})` : "no samples yet");
    setText("stat-tpot", fmtMs(ms(p.p50)));
    setText("stat-tpot-p99", p.count ? `p99 ${fmtMs(ms(p.p99))} (n=${p.count})` : "no samples yet");
    setText("stat-score", fmtMs(ms(e.p50)));
    setText("stat-score-p99", e.count ? `p99 ${fmtMs(ms(e.p99))} (n=${e.count})` : "no samples yet");
    setText("stat-tokps", isNum(s.throughput.tokens_per_s) ? fmtNum(s.throughput.tokens_per_s, 1) + " tok/s" : "–");
    setText("stat-reqps", isNum(s.throughput.requests_per_s) ? s.throughput.requests_per_s.toFixed(2) + " req/s" : "");
    setText("stat-completed", fmtNum(s.throughput.completed_total));
    const hit = s.prefix_cache && s.prefix_cache.hit_rate;
    setText("stat-prefix", isNum(hit) ? `prefix hit ${fmtPct(hit)}` : "");
  }

  // What auto did since the mode was last set (prefill batches per choice; "0" = time-sliced,
  // "layer-sliced" = time-sliced by slices of layers, "chunked" = time-sliced with the prefill
  // cut into chunks sized to the TBT target),
  // and the splits taken out of service after failing on this device.
  function choicesText(part) {
    const parts = [];
    const counts = part.choice_counts || {};
    const total = Object.values(counts).reduce((a, b) => a + b, 0);
    if (total > 0) {
      const special = { "0": "time-sliced", "layer-sliced": "time-sliced by layers",
        "chunked": "time-sliced in chunks" };
      const label = (k) => special[k] || k + " prefill SMs";
      // After "0", before the splits.
      const order = (k) => (k === "layer-sliced" ? 0.5 : k === "chunked" ? 0.25 : Number(k));
      const items = Object.entries(counts)
        .sort((a, b) => order(a[0]) - order(b[0]))
        .map(([k, n]) => `${label(k)} ${n} ` +
          `(${Math.round((100 * n) / total)} %)`);
      parts.push("Auto's choices since the mode was set (prefill batches): " + items.join(" · ") + ".");
    }
    const disabled = Object.entries(part.disabled_splits || {});
    if (disabled.length) {
      parts.push("Taken out of service after failing: " +
        disabled.map(([k, why]) => `${k} (${why})`).join("; ") + ".");
    }
    return parts.join(" ");
  }

  // ---------------------------------------------------------------- SM drawing
  function renderPartition(part) {
    const grid = $("sm-grid");
    const total = isNum(part.total_sms) ? part.total_sms : 0;
    const badge = $("mode-badge");
    const reason = $("partition-reason");

    if (!part.available) {
      badge.textContent = "unavailable";
      badge.className = "badge badge-na";
      reason.hidden = false;
      setText("partition-reason", "SM partitioning is unavailable: " + (part.reason || "no reason given") +
        ". Prefill and decode share the whole device by time-slicing.");
    } else {
      badge.textContent = part.mode + (part.pinned ? " · pinned" : "");
      badge.className = "badge badge-" + part.mode;
      reason.hidden = true;
    }

    // One cell per SM. Prefill takes the first prefill_sms cells and decode the last decode_sms;
    // where they overlap (mode off, or the controller giving every SM to both in turn) the SM is
    // time-sliced; cells in neither are idle (e.g. left over by the split granularity).
    if (grid.childElementCount !== total) {
      grid.replaceChildren(...Array.from({ length: total }, (_, i) => {
        const cell = document.createElement("div");
        cell.className = "sm";
        cell.title = "SM " + i;
        return cell;
      }));
    }
    grid.classList.toggle("unavailable", !part.available);
    // Nothing to draw or to set without SM information / partitioning: hide, don't grey out.
    grid.hidden = total === 0;
    document.querySelector(".legend").hidden = total === 0;
    $("partition-controls").hidden = !part.available;
    $("splits-text").hidden = !part.available;
    const pre = Math.min(part.prefill_sms || 0, total), dec = Math.min(part.decode_sms || 0, total);
    Array.from(grid.children).forEach((cell, i) => {
      const inPre = i < pre, inDec = i >= total - dec;
      const kind = inPre && inDec ? "shared" : inPre ? "prefill" : inDec ? "decode" : "idle";
      const cls = "sm sm-" + kind;
      if (cell.className !== cls) cell.className = cls;
    });

    let text;
    if (!part.available) text = total ? `${total} SMs, not partitioned` : "no SM information on this device";
    else if (pre + dec > total) text = `${total} SMs, time-sliced between prefill and decode`;
    else text = `prefill ${pre} SMs · decode ${dec} SMs · ${total} SMs in all`;
    setText("split-text", text);

    // Controls: mode buttons and a range input over the pre-created splits.
    const splits = Array.isArray(part.splits) ? part.splits : [];
    const range = $("split-range");
    const key = JSON.stringify(splits);
    if (key !== splitsShown) {
      splitsShown = key;
      range.max = String(Math.max(0, splits.length - 1));
      const at = splits.indexOf(part.prefill_sms);
      range.value = String(at >= 0 ? at : Math.floor(splits.length / 2));
      showRangeValue();
    }
    setText("splits-text", splits.length
      ? `Pre-created splits (prefill SMs): ${splits.join(" · ")}. ` +
        "Auto lets the cost-model controller choose among them; Off runs both phases on the whole GPU."
      : "");
    setText("choices-text", choicesText(part));
    const usable = part.available && splits.length > 0;
    range.disabled = !usable;
    $("pin-btn").disabled = !usable;
    $("auto-btn").disabled = !part.available;
    $("auto-btn").classList.toggle("active", part.mode === "auto");
    $("off-btn").classList.toggle("active", part.mode === "off");
  }
  function selectedSplit() {
    let splits = [];
    try { splits = JSON.parse(splitsShown || "[]"); } catch (e) { splits = []; }
    return splits[Number($("split-range").value)];
  }
  function showRangeValue() {
    const sms = selectedSplit();
    const total = last ? last.partition.total_sms : null;
    setText("split-out", isNum(sms) ? `${sms} prefill / ${isNum(total) ? total - sms : "?"} decode` : "–");
  }

  // ---------------------------------------------------------------- policy and cost model
  function renderPolicy(pol) {
    const seg = $("policy-seg");
    const names = pol.available || [];
    if (seg.dataset.names !== names.join(",")) {
      seg.dataset.names = names.join(",");
      seg.replaceChildren(...names.map((name) => {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "policy-btn";
        b.dataset.policy = name;
        b.textContent = name.toUpperCase();
        b.addEventListener("click", () => put("/admin/api/policy", { policy: name }, `policy set to ${name}`));
        return b;
      }));
    }
    for (const b of seg.children) b.classList.toggle("active", b.dataset.policy === pol.current);
    // SRJF's fairness offset in use, and the latency SLO it was derived from (--ttft-slo-ms).
    const lam = pol.fairness_lambda;
    const slo = pol.ttft_slo_ms;
    setText("policy-lambda", isNum(lam)
      ? `fairness λ ${lam.toFixed(3)}` + (isNum(slo) ? ` (from a ${slo} ms latency SLO)` : " (fixed)")
      : "");
  }
  // How much prefill a step takes (PUT /admin/api/prefill changes it): the budget, and beside
  // decodes the token cap (mixed_step_token_budget; auto's chunks past it up to a fixed-part
  // share, chunk_fixed_share) and the TBT target's cut, either or both.
  function renderPrefill(p) {
    if (!p || !isNum(p.token_budget)) { setText("prefill-limits", ""); return; }
    const share = isNum(p.chunk_fixed_share)
      ? ` (auto's chunks more, to a fixed-part share of ${p.chunk_fixed_share})` : "";
    const cap = isNum(p.mixed_step_token_budget)
      ? `${p.mixed_step_token_budget} with decodes${share}` : "the same with decodes";
    const beside = isNum(p.tbt_slo_ms) ? `${cap}, cut to a ${p.tbt_slo_ms} ms TBT target` : cap;
    const chunk = isNum(p.chunk_tokens) ? `; long prompts' MLP in chunks of ${p.chunk_tokens}` : "";
    setText("prefill-limits", `prefill per step: ${p.token_budget} tokens; ${beside}${chunk}`);
  }
  function renderCostModel(cm) {
    const err = (p, m) => (isNum(p) && isNum(m) && m > 0 ? ((p - m) / m * 100).toFixed(1) + "%" : "–");
    setText("cm-pp", fmtMs(cm.predicted_prefill_ms));
    setText("cm-mp", fmtMs(cm.measured_prefill_ms));
    setText("cm-ep", err(cm.predicted_prefill_ms, cm.measured_prefill_ms));
    setText("cm-pd", fmtMs(cm.predicted_decode_ms));
    setText("cm-md", fmtMs(cm.measured_decode_ms));
    setText("cm-ed", err(cm.predicted_decode_ms, cm.measured_decode_ms));
    setText("cm-mape", isNum(cm.mape) ? `mean absolute prediction error: ${(cm.mape * 100).toFixed(1)}%`
      : "no prediction error measured yet");
  }

  // The engine's collector: each pause stops the step loop (runtime/diagnostics/gc_watch.py).
  function renderGc(gc) {
    if (!gc || !isNum(gc.pause_ms_max_ever)) { setText("gc-text", ""); return; }
    const young = isNum(gc.young_pause_ms_max_ever) ? `, young ${gc.young_pause_ms_max_ever.toFixed(1)} ms` : "";
    const full = isNum(gc.full_collections) ? `; ${gc.full_collections} full collections` : "";
    setText("gc-text", `collector: longest pause ${gc.pause_ms_max_ever.toFixed(1)} ms${young}${full}`);
  }

  // ---------------------------------------------------------------- charts
  // Each chart: series of {label, color, dash, get(snapshot) -> number|null}.
  const CHARTS = {
    queues: { unit: "", series: [
      { label: "waiting", color: COLORS.prefill, get: (s) => s.queues.waiting },
      { label: "running", color: COLORS.decode, get: (s) => s.queues.running },
    ] },
    ttft: { unit: "ms", series: [
      { label: "p50", color: COLORS.p50, get: (s) => ms(chatLatency(s).ttft_s.p50) },
      { label: "p90", color: COLORS.violet, get: (s) => ms(chatLatency(s).ttft_s.p90) },
      { label: "p99", color: COLORS.p99, get: (s) => ms(chatLatency(s).ttft_s.p99) },
    ] },
    tpot: { unit: "ms", series: [
      { label: "p50", color: COLORS.p50, get: (s) => ms(chatLatency(s).tpot_s.p50) },
      { label: "p90", color: COLORS.violet, get: (s) => ms(chatLatency(s).tpot_s.p90) },
      { label: "p99", color: COLORS.p99, get: (s) => ms(chatLatency(s).tpot_s.p99) },
    ] },
    score: { unit: "ms", series: [
      { label: "p50", color: COLORS.p50, get: (s) => ms(scoreLatency(s).e2e_s.p50) },
      { label: "p90", color: COLORS.violet, get: (s) => ms(scoreLatency(s).e2e_s.p90) },
      { label: "p99", color: COLORS.p99, get: (s) => ms(scoreLatency(s).e2e_s.p99) },
    ] },
    throughput: { unit: "tok/s", series: [
      { label: "tokens/s", color: COLORS.brand, get: (s) => s.throughput.tokens_per_s },
    ] },
    kv: { unit: "%", max: 100, series: [
      { label: "KV blocks in use", color: COLORS.violet, get: (s) => (isNum(s.kv.usage) ? s.kv.usage * 100 : null) },
    ] },
    cost: { unit: "ms", series: [
      { label: "prefill predicted", color: COLORS.prefill, dash: true, get: (s) => s.cost_model.predicted_prefill_ms },
      { label: "prefill measured", color: COLORS.prefill, get: (s) => s.cost_model.measured_prefill_ms },
      { label: "decode predicted", color: COLORS.decode, dash: true, get: (s) => s.cost_model.predicted_decode_ms },
      { label: "decode measured", color: COLORS.decode, get: (s) => s.cost_model.measured_decode_ms },
    ] },
  };

  function buildLegends() {
    for (const [name, chart] of Object.entries(CHARTS)) {
      const box = document.querySelector(`.chart-legend[data-for="${name}"]`);
      box.replaceChildren(...chart.series.map((ser) => {
        const span = document.createElement("span");
        const sw = document.createElement("i");
        sw.style.background = ser.color;
        sw.style.color = ser.color;
        if (ser.dash) sw.className = "dash";
        span.append(sw, ser.label);
        return span;
      }));
    }
  }

  function niceMax(v) {
    if (!(v > 0)) return 1;
    const mag = Math.pow(10, Math.floor(Math.log10(v)));
    // Tops whose quarters read well: 1, 2, 4, 6, 8, 10 × 10^k.
    for (const m of [1, 2, 4, 6, 8, 10]) if (v <= m * mag) return m * mag;
    return 10 * mag;
  }

  function drawChart(name) {
    const chart = CHARTS[name];
    const canvas = $("chart-" + name);
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth, h = canvas.clientHeight;
    if (!w || !h) return;
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);

    const pad = { l: 46, r: 8, t: 8, b: 18 };
    const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
    const values = chart.series.map((ser) => history.map((s) => {
      const v = ser.get(s);
      return isNum(v) ? v : null;
    }));
    let top = 0;
    for (const vs of values) for (const v of vs) if (v !== null && v > top) top = v;
    top = chart.max ? Math.max(chart.max, top) : niceMax(top * 1.1);

    // grid and y labels
    ctx.font = "11px system-ui, sans-serif";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const y = pad.t + ph - (ph * i) / 4;
      ctx.strokeStyle = i === 0 ? "#c9d3ce" : "#edf1ef";
      ctx.lineWidth = 1;
      ctx.beginPath(); ctx.moveTo(pad.l, Math.round(y) + 0.5); ctx.lineTo(pad.l + pw, Math.round(y) + 0.5); ctx.stroke();
      ctx.fillStyle = "#7b8a83";
      ctx.fillText(fmtTick((top * i) / 4), pad.l - 6, y);
    }
    ctx.textAlign = "left"; ctx.textBaseline = "alphabetic";
    ctx.fillText(`−${Math.round(HISTORY * 0.5 / 60)} min`, pad.l, h - 4);
    ctx.textAlign = "right";
    ctx.fillText("now", pad.l + pw, h - 4);

    const anyData = values.some((vs) => vs.some((v) => v !== null));
    if (!anyData) {
      ctx.textAlign = "center"; ctx.textBaseline = "middle"; ctx.fillStyle = "#9aa8a1";
      ctx.fillText("no data yet", pad.l + pw / 2, pad.t + ph / 2);
      return;
    }
    // series: x by sample index, newest at the right edge
    const x = (i) => pad.l + pw - ((history.length - 1 - i) / (HISTORY - 1)) * pw;
    const y = (v) => pad.t + ph - (Math.min(v, top) / top) * ph;
    chart.series.forEach((ser, k) => {
      ctx.strokeStyle = ser.color;
      ctx.lineWidth = 1.8;
      ctx.setLineDash(ser.dash ? [5, 4] : []);
      ctx.beginPath();
      let pen = false;
      values[k].forEach((v, i) => {
        if (v === null) { pen = false; return; }
        if (pen) ctx.lineTo(x(i), y(v)); else { ctx.moveTo(x(i), y(v)); pen = true; }
      });
      ctx.stroke();
      // a dot on the newest value, so a series with a single sample is visible too
      for (let i = values[k].length - 1; i >= 0; i--) {
        if (values[k][i] === null) continue;
        ctx.fillStyle = ser.color;
        ctx.beginPath(); ctx.arc(x(i), y(values[k][i]), 2.5, 0, 2 * Math.PI); ctx.fill();
        break;
      }
    });
    ctx.setLineDash([]);
  }
  const drawCharts = () => Object.keys(CHARTS).forEach(drawChart);

  // ---------------------------------------------------------------- state handling
  function onState(s) {
    last = s;
    history.push(s);
    if (history.length > HISTORY) history.shift();
    renderTiles(s);
    renderPartition(s.partition);
    renderPolicy(s.policy);
    renderPrefill(s.prefill);
    renderCostModel(s.cost_model);
    renderGc(s.gc);
    showRangeValue();
    drawCharts();
    document.body.dataset.updates = String((Number(document.body.dataset.updates) || 0) + 1);
  }

  function setConn(text, cls) {
    const el = $("conn");
    el.textContent = text;
    el.className = "pill " + cls;
  }

  function authHeaders() {
    const token = $("token-input").value.trim();
    return token ? { Authorization: "Bearer " + token } : {};
  }

  function onStateEvent(data) {
    let s;
    try { s = JSON.parse(data); } catch (e) { return; }
    onState(s);
    if (s.engine.alive) setConn("live", "pill-ok");
    else if (s.engine.starting) setConn("engine starting…", "pill-wait");
    else setConn("engine stopped", "pill-bad");
  }

  // The event stream is read with fetch, not EventSource: EventSource cannot send the
  // Authorization header that the state needs when an admin token is set.
  let streamAbort = null;
  async function connect() {
    if (streamAbort) streamAbort.abort();
    const abort = new AbortController();
    streamAbort = abort;
    try {
      const resp = await fetch("/admin/api/events", { headers: authHeaders(), signal: abort.signal });
      if (resp.status === 401) {
        setConn("admin token needed", "pill-bad");
        return; // reconnects when the token changes
      }
      if (!resp.ok || !resp.body) throw new Error("HTTP " + resp.status);
      setConn("live", "pill-ok");
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n/g, "\n");
        let end;
        while ((end = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, end);
          buf = buf.slice(end + 2);
          let event = "message";
          const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) event = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          }
          if (event === "state" && data.length) onStateEvent(data.join("\n"));
        }
      }
    } catch (e) {
      if (abort.signal.aborted) return;
    }
    if (streamAbort !== abort) return;
    setConn("reconnecting…", "pill-wait");
    setTimeout(() => { if (streamAbort === abort) connect(); }, 1000);
  }

  // ---------------------------------------------------------------- changes
  async function put(path, body, okMessage) {
    const headers = { "Content-Type": "application/json", ...authHeaders() };
    let resp;
    try {
      resp = await fetch(path, { method: "PUT", headers, body: JSON.stringify(body) });
    } catch (e) {
      toast("request failed: " + e, true);
      return;
    }
    let data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    if (!resp.ok) {
      const msg = data && data.error ? data.error.message : resp.statusText;
      toast(`${resp.status}: ${msg}`, true);
      return;
    }
    if (data) onState(data);
    toast(okMessage);
  }

  function wireControls() {
    const tokenInput = $("token-input");
    tokenInput.value = sessionStorage.getItem(TOKEN_KEY) || "";
    tokenInput.addEventListener("input", () => sessionStorage.setItem(TOKEN_KEY, tokenInput.value.trim()));
    tokenInput.addEventListener("change", () => connect());
    $("auto-btn").addEventListener("click", () => put("/admin/api/partition", { mode: "auto" }, "partition: auto"));
    $("off-btn").addEventListener("click", () => put("/admin/api/partition", { mode: "off" }, "partition: off"));
    $("split-range").addEventListener("input", showRangeValue);
    $("pin-btn").addEventListener("click", () => {
      const sms = selectedSplit();
      if (!isNum(sms)) return;
      put("/admin/api/partition", { mode: "static", prefill_sms: sms }, `pinned ${sms} prefill SMs`);
    });
    window.addEventListener("resize", drawCharts);
  }

  async function init() {
    buildLegends();
    wireControls();
    try {
      const resp = await fetch("/admin/api/state", { headers: authHeaders() });
      if (resp.ok) onState(await resp.json());
    } catch (e) {
      setConn("offline", "pill-bad");
    }
    connect();
  }

  init();
})();
