// The report's explorer: memory over time drawn with uPlot (zoom, pan, hover, the x axis in seconds or events),
// and a click on a moment lists what was live then, computed here from the embedded allocations
// (analyzer/report/interactive.py documents the encoding). Input strings only ever reach the page as textContent.
"use strict";
(() => {
  document.documentElement.classList.add("js");
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const TEXT = DATA.text;
  const ITEMS_SHOWN = 200;   // allocations listed under one group before "… N more"
  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  const bytes = (n) => {
    let p = UNITS.length - 1;
    while (p > 0 && Math.abs(n) < 1024 ** p) p--;
    return p === 0 ? `${n.toFixed(0)} B` : `${(n / 1024 ** p).toFixed(2)} ${UNITS[p]}`;
  };
  // y ticks at round values of one binary unit (0, 16, 32, 48 GiB), never decimal-GB positions written in GiB
  const TICK_STEPS = [0.25, 0.5, 1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000];
  const binaryUnit = (n) => { let p = UNITS.length - 1; while (p > 0 && Math.abs(n) < 1024 ** p) p--; return p; };
  const binaryTicks = (u, axis, min, max) => {
    const unit = 1024 ** binaryUnit(max), top = max / unit;
    const step = TICK_STEPS.find((s) => top / s <= 6) || Math.ceil(top / 6);
    const ticks = [];
    for (let k = 0; k * step <= top + 1e-9; k++) ticks.push(k * step * unit);
    return ticks;
  };
  const tickLabels = (u, ticks) => {
    const p = binaryUnit(Math.max(...ticks, 1));
    return ticks.map((v) => `${+(v / 1024 ** p).toFixed(2)} ${UNITS[p]}`);
  };
  // the y axis as wide as its longest label, so no label is clipped at any width
  const labelRoom = (u, values) => (values && values.length ? Math.max(...values.map((v) => String(v).length)) * 7 + 22 : 50);
  const pct = (share) => (share < 0.1 ? `${(share * 100).toFixed(1)}%` : `${(share * 100).toFixed(0)}%`);
  const undelta = (xs) => { let s = 0; return xs.map((v) => (s += v)); };
  const words = (i) => (i < 0 ? "—" : TEXT[i].replaceAll("_", " "));
  const el = (tag, props = {}, ...children) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props)) {
      if (k === "text") e.textContent = v; else if (k === "class") e.className = v; else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  };
  const lastAtOrBefore = (sorted, v) => {   // index of the last element <= v (0 when none)
    let lo = 0, hi = sorted.length - 1;
    while (lo < hi) { const mid = (lo + hi + 1) >> 1; if (sorted[mid] <= v) lo = mid; else hi = mid - 1; }
    return lo;
  };

  function decode(dev) {
    const al = dev.alloc;
    const born = undelta(al.a).map((v) => v - 1);   // the first difference is from -1
    const end = born.map((a, i) => (al.l[i] === 0 ? Infinity : a + al.l[i]));
    const ch = dev.chart;
    const chart = ch && {
      seq: undelta(ch.seq), t: ch.t && undelta(ch.t).map((us) => us / 1e6), reserved: ch.reserved && undelta(ch.reserved),
      allocated: undelta(ch.allocated), stack: ch.stack.map(undelta),
    };
    const settle = new Map((al.f || []).map(([i, seq]) => [i, seq]));
    return { born, end, bytes: al.b, cat: al.c, mod: al.m, phase: al.p, stack: al.s, chart, settle, temporary: al.ft };
  }

  // the category in force just after event `seq`: a state's new value is a temporary until the old one is freed
  const categoryAt = (d, i, seq) => (d.settle.has(i) && seq < d.settle.get(i) ? d.temporary : d.cat[i]);

  function liveAt(d, seq) {
    const out = [];
    for (let i = 0; i < d.born.length && d.born[i] <= seq; i++) if (d.end[i] > seq) out.push(i);
    return out;
  }

  const site = (s) => {
    if (s < 0) return "no frames recorded";
    const [where, op] = DATA.stacks[s];
    return where >= 0 ? TEXT[where] : op >= 0 ? `no user frame; ${TEXT[op]}` : "no user frame recorded";
  };

  function stackList(s) {
    if (s < 0) return el("p", { class: "muted", text: "No frames were recorded for this allocation." });
    const row = DATA.stacks[s];
    const list = el("ol", { class: "stack-frames" });
    for (const f of row.slice(3)) {
      const user = f < 0;
      const text = TEXT[user ? ~f : f];
      list.append(el("li", { class: user ? "user" : "lib" }, user ? el("strong", { class: "frame", text }) :
        el("span", { class: "frame", text })));
    }
    if (!row.slice(3).length) list.append(el("li", { class: "lib muted", text: "no Python frames recorded" }));
    if (row[2]) list.append(el("li", { class: "lib muted", text: `… ${row[2]} outer frames left out` }));
    return list;
  }

  class Device {
    constructor(root, dev) {
      this.root = root;
      this.dev = dev;
      this.d = decode(dev);
      this.group = "module";
      this.sort = { key: "bytes", down: true };
      this.query = "";
      this.open = new Set();
      this.searchText = new Map();
      if (this.d.chart) this.chart(); else root.querySelector(".uchart").remove();
      this.liveControls();
      this.select(dev.peak);
    }

    // --- memory over time ---------------------------------------------------------------------------------
    chart() {
      const c = this.d.chart, ch = this.dev.chart;
      this.axis = "seq";   // by event: the peak and the OOM are a few events apart, and a few ms on a clock
      const pick = this.root.querySelector("select.xaxis");
      pick.value = "seq";
      if (!c.t) pick.querySelector("option[value=t]").disabled = true;
      pick.addEventListener("change", () => { this.axis = pick.value; this.draw(); });
      this.root.querySelector("button.reset").addEventListener("click", () => this.plot.setScale("x", this.full()));
      const box = this.root.querySelector(".uchart");
      box.addEventListener("keydown", (e) => this.key(e));
      this.readout = this.root.querySelector(".readout");
      this.cumulative = [];
      let below = c.seq.map(() => 0);
      for (const s of c.stack) { below = below.map((v, i) => v + s[i]); this.cumulative.push(below); }
      this.names = ch.categories.map((x) => words(x.name));
      this.draw();
      new ResizeObserver(() => this.plot && this.plot.setSize(this.size())).observe(box);
    }

    xs() { return this.axis === "t" ? this.d.chart.t : this.d.chart.seq; }
    xOf(seq) { const c = this.d.chart; return this.axis === "t" ? c.t[lastAtOrBefore(c.seq, seq)] : seq; }
    full() { const x = this.xs(); return { min: x[0], max: x[x.length - 1] + (this.axis === "seq" ? 1 : 0) }; }
    size() { return { width: Math.max(this.root.querySelector(".uchart").clientWidth, 300), height: 320 }; }

    draw() {
      const c = this.d.chart, ch = this.dev.chart, box = this.root.querySelector(".uchart");
      if (this.plot) this.plot.destroy();
      const stepped = uPlot.paths.stepped({ align: 1 });
      const order = [...ch.categories.keys()].reverse();   // the top of the stack first: lower areas paint over it
      const series = [{ label: this.axis === "t" ? "time (s)" : "allocator event" }];
      for (const k of order) {
        const color = ch.categories[k].color;
        series.push({ label: this.names[k], stroke: color, fill: color, width: 0, paths: stepped, points: { show: false } });
      }
      if (c.reserved) series.push({ label: "reserved", stroke: "#1b1f24", width: 1.25, paths: stepped, points: { show: false } });
      const data = [this.xs(), ...order.map((k) => this.cumulative[k]), ...(c.reserved ? [c.reserved] : [])];
      const opts = {
        ...this.size(), legend: { show: false },
        cursor: { drag: { x: true, y: false }, points: { show: false } },
        scales: { x: { time: false, range: (u, lo, hi) => [lo, hi] }, y: { range: (u, lo, hi) => [0, Math.max(hi, ch.capacity && ch.capacity <= 1.5 * hi ? ch.capacity : 0) * 1.08 || 1] } },
        axes: [{ label: this.axis === "t" ? "seconds since the first event" : "allocator event" },
               { splits: binaryTicks, values: tickLabels, size: labelRoom }],
        series,
        hooks: { drawClear: [(u) => this.bands(u)], draw: [(u) => this.marks(u), (u) => this.sayAxis(u, box)],
                 setCursor: [(u) => this.hover(u)] },
      };
      this.plot = new uPlot(opts, data, box);
      const over = this.plot.over;
      let down = null;
      over.addEventListener("mousedown", (e) => { down = [e.clientX, e.clientY]; });
      over.addEventListener("click", (e) => {
        const moved = down && Math.hypot(e.clientX - down[0], e.clientY - down[1]) > 3;
        if (!moved && this.plot.cursor.idx != null) this.select(c.seq[this.plot.cursor.idx]);
      });
      over.addEventListener("wheel", (e) => this.wheel(e), { passive: false });
      this.cursor = c.seq.indexOf(this.dev.peak);
    }

    sayAxis(u, box) {   // what the y axis shows, on the page for a reader of the DOM (and the browser tests)
      box.dataset.yTicks = (u.axes[1]._values || []).join("|");
      box.dataset.yAxisWidth = String(u.axes[1]._size);
      box.dataset.xAxis = this.axis;
    }

    bands(u) {
      const ctx = u.ctx, { top, height } = u.bbox, ch = this.dev.chart;
      ctx.save();
      ctx.globalAlpha = 0.12;
      for (const [start, end, phase] of ch.bands) {
        const x0 = u.valToPos(this.xOf(start), "x", true), x1 = u.valToPos(this.xOf(end), "x", true);
        if (x1 - x0 < 0.5) continue;
        ctx.fillStyle = DATA.phase_colors[phase];
        ctx.fillRect(x0, top, x1 - x0, height);
      }
      ctx.restore();
    }

    marks(u) {
      const ctx = u.ctx, { top, height } = u.bbox, ch = this.dev.chart, dpr = devicePixelRatio || 1;
      const right = u.bbox.left + u.bbox.width * 0.85;
      const line = (seq, color, dash, label, row = 1) => {
        const x = u.valToPos(this.xOf(seq), "x", true);
        ctx.strokeStyle = color; ctx.setLineDash(dash); ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + height);
        ctx.stroke();
        if (!label) return;
        ctx.fillStyle = color;
        ctx.textAlign = x > right ? "right" : "left";
        ctx.fillText(label, x + (x > right ? -3 : 3) * dpr, top + 12 * row * dpr);
      };
      ctx.save();
      ctx.font = `${11 * dpr}px sans-serif`;
      ctx.lineWidth = dpr;
      const spacing = u.bbox.width / Math.max(ch.steps.length, 1);
      for (const [seq, step] of ch.steps) line(seq, "#8c8c8c", [2 * dpr, 3 * dpr], spacing > 60 * dpr ? `step ${step}` : null);
      ctx.lineWidth = 1.5 * dpr;
      line(this.dev.peak, "#b00020", [5 * dpr, 3 * dpr], `peak ${bytes(this.dev.peak_bytes)}`, 2);
      for (const seq of ch.ooms) line(seq, "#000000", [], "OOM", 3);
      if (this.selected != null) { ctx.lineWidth = dpr; line(this.selected, "#3b6fc4", [], null); }
      ctx.restore();
    }

    hover(u) {
      const i = u.cursor.idx;
      if (i == null) return;
      this.cursor = i;
      const c = this.d.chart, ch = this.dev.chart;
      const parts = [`event ${c.seq[i]}`];
      if (c.t) parts.push(`${c.t[i].toFixed(3)} s`);
      if (ch.phase[i] >= 0) parts.push(words(ch.phase[i]));
      if (ch.step[i] != null) parts.push(`step ${ch.step[i]}`);
      if (ch.module[i] >= 0) parts.push(TEXT[ch.module[i]]);
      const values = el("span", { class: "values" },
        el("strong", { class: "allocated", text: `allocated ${bytes(c.allocated[i])}` }),
        c.reserved ? `, reserved ${bytes(c.reserved[i])}` : ", reserved not recorded");
      for (let k = c.stack.length - 1; k >= 0; k--) {
        if (c.stack[k][i]) values.append(`; ${this.names[k]} ${bytes(c.stack[k][i])}`);
      }
      this.readout.replaceChildren(el("span", { text: parts.join(" · ") + " — " }), values);
    }

    key(e) {
      const n = this.d.chart.seq.length;
      const steps = { ArrowLeft: -1, ArrowRight: 1, PageUp: -Math.ceil(n / 20), PageDown: Math.ceil(n / 20) };
      if (e.key in steps || e.key === "Home" || e.key === "End") {
        const i = e.key === "Home" ? 0 : e.key === "End" ? n - 1 : Math.min(n - 1, Math.max(0, (this.cursor ?? 0) + steps[e.key]));
        const u = this.plot;
        u.setCursor({ left: u.valToPos(this.xs()[i], "x"), top: u.bbox.height / (2 * (devicePixelRatio || 1)) });
        this.cursor = i;
        e.preventDefault();
      } else if (e.key === "Enter" || e.key === " ") {
        if (this.cursor != null && this.cursor >= 0) this.select(this.d.chart.seq[this.cursor]);
        e.preventDefault();
      }
    }

    wheel(e) {   // zoom around the cursor; with Shift, pan
      e.preventDefault();
      const u = this.plot, { min, max } = u.scales.x, span = max - min;
      const at = u.posToVal(u.cursor.left ?? u.over.clientWidth / 2, "x");
      const lim = this.full();
      let lo, hi;
      if (e.shiftKey) { const dx = span * 0.1 * Math.sign(e.deltaY); lo = min + dx; hi = max + dx; }
      else { const f = e.deltaY < 0 ? 0.8 : 1.25; lo = at - (at - min) * f; hi = at + (max - at) * f; }
      u.setScale("x", { min: Math.max(lim.min, lo), max: Math.min(lim.max, hi) });
    }

    // --- what was live -------------------------------------------------------------------------------------
    liveControls() {
      const group = this.root.querySelector("select.group");
      group.addEventListener("change", () => { this.group = group.value; this.open.clear(); this.table(); });
      const search = this.root.querySelector("input.search");
      search.addEventListener("input", () => { this.query = search.value.trim().toLowerCase(); this.table(); });
      for (const th of this.root.querySelectorAll("th[data-sort] button")) {
        th.addEventListener("click", () => {
          const key = th.parentElement.dataset.sort;
          this.sort = { key, down: this.sort.key === key ? !this.sort.down : key !== "name" };
          this.table();
        });
      }
    }

    select(seq) {
      const exact = this.dev.exact;
      let note = "";
      if (exact) {
        const near = exact.reduce((best, s) => (Math.abs(s - seq) < Math.abs(best - seq) ? s : best), exact[0]);
        if (near !== seq) note = ` (the nearest of the ${exact.length} moments whose live set this page holds; you clicked event ${seq})`;
        seq = near;
      }
      this.selected = seq;
      if (this.d.settle.size) this.searchText.clear();   // a category in the search text may differ now
      this.live = liveAt(this.d, seq);
      this.total = this.live.reduce((s, i) => s + this.d.bytes[i], 0);
      this.root.dataset.seq = seq;
      this.root.dataset.liveBytes = this.total;
      this.root.dataset.liveCount = this.live.length;
      const c = this.d.chart;
      const when = c && c.t ? ` at ${c.t[lastAtOrBefore(c.seq, seq)].toFixed(3)} s` : "";
      const what = seq === this.dev.peak ? "the peak, " : this.dev.chart && this.dev.chart.ooms.includes(seq) ? "the out-of-memory, " : "";
      this.root.querySelector(".moment").textContent = `${what}just after allocator event ${seq}${when}${note}`;
      this.open.clear();
      this.table();
      if (this.plot) this.plot.redraw(false);
    }

    key_of(i) {
      if (this.group === "module") return TEXT[this.d.mod[i]];
      if (this.group === "category") return words(categoryAt(this.d, i, this.selected));
      if (this.group === "site") return site(this.d.stack[i]);
      return "";
    }

    matches(i) {
      if (!this.query) return true;
      let text = this.searchText.get(i);
      if (text === undefined) {
        const s = this.d.stack[i];
        const frames = s < 0 ? [] : DATA.stacks[s].slice(3).map((f) => TEXT[f < 0 ? ~f : f]);
        text = [TEXT[this.d.mod[i]], TEXT[categoryAt(this.d, i, this.selected)], TEXT[this.d.phase[i]], site(s),
          ...frames].join("\n").toLowerCase();
        this.searchText.set(i, text);
      }
      return text.includes(this.query);
    }

    table() {
      const items = this.live.filter((i) => this.matches(i));
      const groups = new Map();
      for (const i of items) {
        const k = this.key_of(i);
        const g = groups.get(k) || { name: k, count: 0, bytes: 0, items: [] };
        g.count++; g.bytes += this.d.bytes[i]; g.items.push(i);
        groups.set(k, g);
      }
      const { key, down } = this.sort;
      const rows = [...groups.values()].sort((a, b) => {
        const order = key === "name" ? a.name.localeCompare(b.name) : a[key] - b[key];
        return (down ? -order : order) || a.name.localeCompare(b.name);
      });
      const shown = items.reduce((s, i) => s + this.d.bytes[i], 0);
      this.root.dataset.shownBytes = shown;
      this.root.dataset.shownCount = items.length;
      this.root.querySelector(".live-summary").textContent = this.query
        ? `${items.length} of ${this.live.length} allocations match, ${bytes(shown)} of ${bytes(this.total)}.`
        : `${this.live.length} allocations, ${bytes(this.total)} together.`;
      const body = this.root.querySelector("tbody.live");
      body.replaceChildren();
      for (const th of this.root.querySelectorAll("th[data-sort]")) {
        th.setAttribute("aria-sort", th.dataset.sort === key ? (down ? "descending" : "ascending") : "none");
      }
      for (const g of rows) {
        const flat = this.group === "none";
        if (!flat) {
          const open = this.open.has(g.name);
          const toggle = el("button", { class: "group-toggle", "aria-expanded": String(open), text: `${open ? "▾" : "▸"} ${g.name}` });
          toggle.addEventListener("click", () => { if (open) this.open.delete(g.name); else this.open.add(g.name); this.table(); });
          body.append(el("tr", { class: "group-row" }, el("td", { colspan: "3" }, toggle),
            el("td", { class: "num", text: String(g.count) }), el("td", { class: "num", text: bytes(g.bytes) }),
            el("td", { class: "num", text: pct(this.total ? g.bytes / this.total : 0) })));
          if (!open) continue;
        }
        const list = g.items.sort((a, b) => this.d.bytes[b] - this.d.bytes[a]);
        for (const i of list.slice(0, ITEMS_SHOWN)) body.append(this.itemRow(i));
        if (list.length > ITEMS_SHOWN) {
          const rest = list.slice(ITEMS_SHOWN).reduce((s, i) => s + this.d.bytes[i], 0);
          body.append(el("tr", {}, el("td", { colspan: "6", class: "muted", text: `… ${list.length - ITEMS_SHOWN} smaller allocations, ${bytes(rest)} together` })));
        }
      }
    }

    itemRow(i) {
      const s = this.d.stack[i];
      const details = el("details", { class: "alloc" }, el("summary", {}, el("span", { class: "frame", text: site(s) })));
      details.addEventListener("toggle", () => { if (details.open && details.children.length === 1) details.append(stackList(s)); }, { once: false });
      return el("tr", { class: "item-row" }, el("td", { class: "wrap" }, details),
        el("td", { text: words(categoryAt(this.d, i, this.selected)) }),
        el("td", { class: "wrap" }, el("code", { text: TEXT[this.d.mod[i]] })),
        el("td", { class: "num", text: "1" }), el("td", { class: "num", text: bytes(this.d.bytes[i]) }),
        el("td", { class: "num", text: pct(this.total ? this.d.bytes[i] / this.total : 0) }));
    }
  }

  for (const root of document.querySelectorAll("section.explore")) {
    const dev = DATA.devices[Number(root.dataset.index)];
    root.explorer = new Device(root, dev);
  }
  document.documentElement.dataset.interactiveMs = performance.now().toFixed(0);
})();
