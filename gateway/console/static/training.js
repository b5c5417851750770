// Training charts: fetch the JSON series from data-src, draw one uPlot chart per entry,
// and re-fetch every data-refresh-s seconds (setData when the series are unchanged).
(function () {
  "use strict";
  const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777"];
  const root = document.getElementById("charts");
  if (!root) return;
  const status = document.getElementById("chart-status");
  const sync = uPlot.sync("train");
  let plots = [];
  let layout = "";

  function width(box) {
    return Math.max(box.clientWidth - 12, 200);  // the grid cell, less the box padding
  }

  function options(chart, box) {
    const series = [{ label: "step" }];
    chart.series.forEach((s, i) => series.push({
      label: s.name, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: true,
      points: { show: true, size: 4 },
    }));
    return {
      title: chart.title, width: width(box), height: 220, series: series,
      cursor: { sync: { key: sync.key } },
      // A flat series (a clip ratio of 0 throughout) gets a range around its value, not
      // uPlot's 0-100.
      scales: { x: { time: false }, y: { range: yRange } },
      axes: [{ label: "step" }, { size: 60 }],
      // The legend shows the last step's values until the cursor points elsewhere
      // (uPlot's default is "--" until hover).
      hooks: { ready: [showLast], setData: [showLast],
               setCursor: [(u) => { if (u.cursor.idx == null) showLast(u); }] },
    };
  }

  function yRange(u, min, max) {
    if (min == null || max == null) return [0, 1];
    if (min === max) {
      const pad = Math.abs(min) > 0 ? Math.abs(min) * 0.1 : 1;
      return [min >= 0 ? Math.max(0, min - pad) : min - pad, max + pad];
    }
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  function showLast(u) {
    const n = u.data[0].length;
    if (n > 0) u.setLegend({ idx: n - 1 });
  }

  function draw(data) {
    const key = JSON.stringify(data.charts.map((c) => [c.title, c.series.map((s) => s.name)]));
    const rows = data.charts.map((c) => [data.steps].concat(c.series.map((s) => s.values)));
    if (key === layout) {
      plots.forEach((p, i) => p.setData(rows[i]));
      return;
    }
    plots.forEach((p) => p.destroy());
    root.innerHTML = "";
    plots = data.charts.map((c, i) => {
      const box = document.createElement("div");
      box.className = "chart";
      box.dataset.title = c.title;
      root.appendChild(box);
      return new uPlot(options(c, box), rows[i], box);
    });
    layout = key;
  }

  async function refresh() {
    try {
      const res = await fetch(root.dataset.src, { credentials: "same-origin", cache: "no-store" });
      if (res.redirected || !res.ok) throw new Error("HTTP " + res.status);
      const data = await res.json();
      draw(data);
      // UTC, as every other time on the console.
      if (status) status.textContent = "Updated " + new Date().toISOString().slice(11, 19) + " UTC.";
    } catch (err) {
      if (status) status.textContent = "Could not refresh the charts (" + err.message + ").";
    }
  }

  refresh();
  setInterval(refresh, 1000 * Number(root.dataset.refreshS || 10));
  window.addEventListener("resize", () => plots.forEach((p) => p.setSize({ width: width(p.root.parentNode), height: 220 })));
})();
